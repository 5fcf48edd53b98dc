// Mappings of daemon memory into the caller (CPU backend: memfds received
// on the companion socket, validated like the daemon validates a client's).
// Both are move-only RAII types opened by a static Open; destruction
// unmaps and closes.
#ifndef KVDEPOT_CLIENT_MAPPINGS_H_
#define KVDEPOT_CLIENT_MAPPINGS_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/memfd.h"
#include "common/unique_fd.h"
#include "kvdepot/v1/kvdepot.pb.h"

namespace kvdepot {

// A pool mapped read-write. Layer l starts at data() + l * layer_stride.
class PoolMapping {
 public:
  // Maps `fd`, the memfd of the pool `info` describes (total_bytes).
  static absl::StatusOr<PoolMapping> Open(const v1::PoolInfo& info,
                                          UniqueFd fd);

  PoolMapping(PoolMapping&&) = default;
  PoolMapping& operator=(PoolMapping&&) = default;

  uint8_t* data() const { return region_.data(); }
  uint8_t* layer(int64_t l) const {
    return data() + l * info_.layout().layer_stride();
  }
  const v1::PoolInfo& info() const { return info_; }
  const v1::PoolLayout& layout() const { return info_.layout(); }

 private:
  PoolMapping(MemfdRegion region, v1::PoolInfo info)
      : region_(std::move(region)), info_(std::move(info)) {}

  MemfdRegion region_;  // the pool's memfd, mapped
  v1::PoolInfo info_;   // as the daemon described it
};

// A daemon-allocated buffer mapped read-write.
class BufferMapping {
 public:
  static absl::StatusOr<BufferMapping> Open(const v1::BufferInfo& info,
                                            UniqueFd fd);

  BufferMapping(BufferMapping&&) = default;
  BufferMapping& operator=(BufferMapping&&) = default;

  uint64_t id() const { return id_; }
  uint8_t* data() const { return region_.data(); }
  int64_t size() const { return region_.size(); }

  // A DataRef naming [offset, offset + length) of this buffer.
  v1::DataRef Slice(int64_t offset, int64_t length) const;

 private:
  BufferMapping(MemfdRegion region, uint64_t id)
      : region_(std::move(region)), id_(id) {}

  MemfdRegion region_;
  uint64_t id_ = 0;
};

// A DataRef naming [offset, offset + length) of buffer `id`.
v1::DataRef SliceRef(uint64_t buffer_id, int64_t offset, int64_t length);
// Inline request bytes / an inline reply request, as DataRefs.
v1::DataRef InlineData(std::string bytes);
v1::DataRef InlineOutput();

}  // namespace kvdepot

#endif  // KVDEPOT_CLIENT_MAPPINGS_H_
