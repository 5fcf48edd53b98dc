// The layout check of the CPU reference's entry points. The checks of the
// requests themselves (slots, segments) are the contract's
// (//kernels:format, kernels/store_load_host.h).
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "kernels/format.h"
#include "kernels/format_host.h"
#include "kernels/reference/reference_internal.h"

namespace kvdepot::internal {

absl::Status ValidateLayout(const PoolLayout& layout) {
  absl::StatusOr<PoolLayout> want = MakePoolLayout(
      layout.format, layout.block_size, layout.num_blocks, layout.num_layers);
  if (!want.ok()) return want.status();
  if (want->block_stride != layout.block_stride ||
      want->layer_bytes != layout.layer_bytes ||
      want->layer_stride != layout.layer_stride ||
      want->total_bytes != layout.total_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "layout strides (block_stride %d, layer_bytes %d, layer_stride %d, "
        "total_bytes %d) do not match its format and sizes (expected %d, %d, "
        "%d, %d)",
        layout.block_stride, layout.layer_bytes, layout.layer_stride,
        layout.total_bytes, want->block_stride, want->layer_bytes,
        want->layer_stride, want->total_bytes));
  }
  return absl::OkStatus();
}

}  // namespace kvdepot::internal
