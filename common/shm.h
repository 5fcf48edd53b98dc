// POSIX shared-memory regions: the CPU backend's pools and buffers, mapped by
// the daemon and by clients on the same host.
//
// A region is a shm object (/dev/shm/<name>) mapped read-write. The creator
// owns the name: it unlinks the object when the region is destroyed, so a
// mapping held elsewhere stays valid but nobody new can open it.
#ifndef KVDEPOT_COMMON_SHM_H_
#define KVDEPOT_COMMON_SHM_H_

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvdepot {

// 2 * num_bytes lowercase hex digits from getrandom(2).
absl::StatusOr<std::string> RandomHex(int num_bytes);

// "/kvdepot-" followed by 32 hex digits from getrandom(2): unguessable.
absl::StatusOr<std::string> RandomShmName();

// Checks that `name` is a valid shm object name: "/" then 1..249 characters
// from [A-Za-z0-9_.-], the first not '.'. The message names `field`.
absl::Status ValidateShmName(absl::string_view field, absl::string_view name);

class ShmRegion {
 public:
  // Creates a new object with a random name, `size` > 0 bytes (zero-filled),
  // permission bits `mode` (e.g. 0600), and maps it. The region owns the name.
  static absl::StatusOr<ShmRegion> Create(int64_t size, mode_t mode);

  // Maps `size` bytes of an existing object. Fails unless the object holds
  // at least `size` bytes. The region does not own the name.
  static absl::StatusOr<ShmRegion> Open(absl::string_view name, int64_t size);

  ShmRegion() = default;
  ShmRegion(ShmRegion&& other) noexcept;
  ShmRegion& operator=(ShmRegion&& other) noexcept;
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;
  ~ShmRegion();

  uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  bool owner() const { return owner_; }

 private:
  void Reset();

  std::string name_;         // shm object name, "/..."
  uint8_t* data_ = nullptr;  // mapping base (MAP_SHARED)
  int64_t size_ = 0;         // mapped bytes
  bool owner_ = false;       // unlink the name on destruction
};

}  // namespace kvdepot

#endif  // KVDEPOT_COMMON_SHM_H_
