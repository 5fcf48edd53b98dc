#include "client/mappings.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvdepot {
namespace {

absl::StatusOr<ShmRegion> MapHandle(const v1::SharedHandle& h) {
  if (h.kind_case() != v1::SharedHandle::kShmName) {
    return absl::UnimplementedError(
        "the handle is a CUDA IPC handle, not a shm name: open it with "
        "CudaIpcMapping (//common/cuda:cuda_mappings)");
  }
  if (h.offset() < 0 || h.offset() > h.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "handle.offset = ", h.offset(), " is outside [0, ", h.size(), "]"));
  }
  return ShmRegion::Open(h.shm_name(), h.size());
}

}  // namespace

absl::StatusOr<PoolMapping> PoolMapping::Open(const v1::PoolInfo& info) {
  absl::StatusOr<ShmRegion> region = MapHandle(info.handle());
  if (!region.ok()) return region.status();
  if (info.handle().offset() + info.layout().total_bytes() >
      info.handle().size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pool \"", info.name(), "\": total_bytes ", info.layout().total_bytes(),
        " do not fit the handle's ", info.handle().size(), " bytes"));
  }
  return PoolMapping(*std::move(region), info.handle().offset(), info);
}

absl::StatusOr<BufferMapping> BufferMapping::Open(const v1::BufferInfo& info) {
  absl::StatusOr<ShmRegion> region = MapHandle(info.handle());
  if (!region.ok()) return region.status();
  return BufferMapping(*std::move(region), info.buffer_id(),
                       info.handle().offset(), info.size());
}

v1::DataRef BufferMapping::Slice(int64_t offset, int64_t length) const {
  v1::DataRef ref;
  v1::BufferSlice* s = ref.mutable_slice();
  s->set_buffer_id(id_);
  s->set_offset(offset);
  s->set_length(length);
  return ref;
}

v1::DataRef InlineData(std::string bytes) {
  v1::DataRef ref;
  ref.set_inline_data(std::move(bytes));
  return ref;
}

v1::DataRef InlineOutput() {
  v1::DataRef ref;
  ref.set_inline_output(true);
  return ref;
}

}  // namespace kvdepot
