// Mappings of daemon memory into the caller (CPU backend: POSIX shm). Both
// are move-only RAII types opened by a static Open; destruction unmaps (the
// daemon owns the shm names and unlinks them).
#ifndef KVDEPOT_CLIENT_MAPPINGS_H_
#define KVDEPOT_CLIENT_MAPPINGS_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/shm.h"
#include "kvdepot/v1/kvdepot.pb.h"

namespace kvdepot {

// A pool mapped read-write. Layer l starts at data() + l * layer_stride.
class PoolMapping {
 public:
  // Maps the pool of `info` (its handle must be a shm name).
  static absl::StatusOr<PoolMapping> Open(const v1::PoolInfo& info);

  PoolMapping(PoolMapping&&) = default;
  PoolMapping& operator=(PoolMapping&&) = default;

  uint8_t* data() const { return region_.data() + offset_; }
  uint8_t* layer(int64_t l) const {
    return data() + l * info_.layout().layer_stride();
  }
  const v1::PoolInfo& info() const { return info_; }
  const v1::PoolLayout& layout() const { return info_.layout(); }

 private:
  PoolMapping(ShmRegion region, int64_t offset, v1::PoolInfo info)
      : region_(std::move(region)), offset_(offset), info_(std::move(info)) {}

  ShmRegion region_;    // the shm object, mapped from its base
  int64_t offset_ = 0;  // pool start inside the mapping
  v1::PoolInfo info_;   // as the daemon described it
};

// A daemon-allocated buffer (or a client's own shm buffer) mapped
// read-write.
class BufferMapping {
 public:
  static absl::StatusOr<BufferMapping> Open(const v1::BufferInfo& info);

  BufferMapping(BufferMapping&&) = default;
  BufferMapping& operator=(BufferMapping&&) = default;

  uint64_t id() const { return id_; }
  uint8_t* data() const { return region_.data() + offset_; }
  int64_t size() const { return size_; }

  // A DataRef naming [offset, offset + length) of this buffer.
  v1::DataRef Slice(int64_t offset, int64_t length) const;

 private:
  BufferMapping(ShmRegion region, uint64_t id, int64_t offset, int64_t size)
      : region_(std::move(region)), id_(id), offset_(offset), size_(size) {}

  ShmRegion region_;
  uint64_t id_ = 0;
  int64_t offset_ = 0;
  int64_t size_ = 0;
};

// Inline request bytes / an inline reply request, as DataRefs.
v1::DataRef InlineData(std::string bytes);
v1::DataRef InlineOutput();

}  // namespace kvdepot

#endif  // KVDEPOT_CLIENT_MAPPINGS_H_
