#include "client/mappings.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace kvdepot {

absl::StatusOr<PoolMapping> PoolMapping::Open(const v1::PoolInfo& info,
                                              UniqueFd fd) {
  ASSIGN_OR_RETURN(
      MemfdRegion region,
      MemfdRegion::Import(absl::StrCat("pool \"", info.name(), "\""),
                          std::move(fd), info.layout().total_bytes()));
  return PoolMapping(std::move(region), info);
}

absl::StatusOr<BufferMapping> BufferMapping::Open(const v1::BufferInfo& info,
                                                  UniqueFd fd) {
  ASSIGN_OR_RETURN(
      MemfdRegion region,
      MemfdRegion::Import(absl::StrCat("buffer ", info.buffer_id()),
                          std::move(fd), info.size()));
  return BufferMapping(std::move(region), info.buffer_id());
}

v1::DataRef BufferMapping::Slice(int64_t offset, int64_t length) const {
  return SliceRef(id_, offset, length);
}

v1::DataRef SliceRef(uint64_t buffer_id, int64_t offset, int64_t length) {
  v1::DataRef ref;
  v1::BufferSlice* s = ref.mutable_slice();
  s->set_buffer_id(buffer_id);
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
