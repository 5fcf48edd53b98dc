// Memory handed over as a descriptor (SPEC §11): the CPU backend's pools and
// buffers, and clients' own buffers, are memfds. A memfd has no name: only
// a process that is handed the descriptor (SCM_RIGHTS, common/fd_passing.h)
// can map it.
//
// Created memfds are sized, fully allocated (fallocate) and sealed against
// shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), so no
// holder can truncate them under another's mapping (the SIGBUS of shm
// objects). A descriptor received from a peer is accepted only when it is
// what it claims (ValidateMemfd).
//
// What sealing does not stop: a holder can punch holes (fallocate
// PUNCH_HOLE) later; tmpfs refills them with zero pages on the next touch,
// charged to whoever touches them. Nothing crashes. Read-only sharing
// cannot be enforced between processes of one uid (/proc/PID/fd reopens
// read-write), so every mapping here is read-write.
#ifndef KVDEPOT_COMMON_MEMFD_H_
#define KVDEPOT_COMMON_MEMFD_H_

#include <fcntl.h>
#include <sys/types.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/unique_fd.h"

namespace kvdepot {

// The seals every accepted memfd carries (at least).
inline constexpr int kRequiredSeals = F_SEAL_SHRINK | F_SEAL_GROW;

// OK when `fd` is a read-write memfd on tmpfs (regular file, seals
// readable), sealed against shrinking and growing, not against writing, of
// exactly `size` bytes, all of them allocated. Otherwise INVALID_ARGUMENT
// saying which check failed; the message names `field`.
absl::Status ValidateMemfd(absl::string_view field, int fd, int64_t size);

// A memfd mapped read-write (MAP_SHARED) from offset 0.
class MemfdRegion {
 public:
  // A new memfd of `size` > 0 bytes (zero-filled, fully allocated, sealed
  // as above), mapped. `name` shows in /proc/PID/fd only ("memfd:<name>").
  // RESOURCE_EXHAUSTED when the memory cannot be allocated.
  static absl::StatusOr<MemfdRegion> Create(absl::string_view name,
                                            int64_t size);

  // Validates a peer's descriptor (ValidateMemfd), then maps it. The region
  // keeps the descriptor only when `keep_fd` (to hand it on later).
  static absl::StatusOr<MemfdRegion> Import(absl::string_view field,
                                            UniqueFd fd, int64_t size,
                                            bool keep_fd = false);

  MemfdRegion() = default;
  MemfdRegion(MemfdRegion&& other) noexcept;
  MemfdRegion& operator=(MemfdRegion&& other) noexcept;
  MemfdRegion(const MemfdRegion&) = delete;
  MemfdRegion& operator=(const MemfdRegion&) = delete;
  ~MemfdRegion();

  uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }
  // The descriptor, or -1 when not kept.
  int fd() const { return fd_.get(); }
  // The file's identity (st_dev, st_ino): tells one memfd from another.
  dev_t dev() const { return dev_; }
  ino_t ino() const { return ino_; }
  // A new descriptor of the same memfd (close-on-exec), to hand over.
  absl::StatusOr<UniqueFd> Dup() const;

 private:
  void Reset();

  UniqueFd fd_;
  uint8_t* data_ = nullptr;  // mapping base (MAP_SHARED)
  int64_t size_ = 0;         // mapped bytes
  dev_t dev_ = 0;
  ino_t ino_ = 0;
};

}  // namespace kvdepot

#endif  // KVDEPOT_COMMON_MEMFD_H_
