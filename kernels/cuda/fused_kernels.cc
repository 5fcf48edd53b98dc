#include "kernels/cuda/fused_kernels.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_status.h"
#include "common/status_macros.h"
#include "kernels/cuda/fused_internal.h"
#include "kernels/format_host.h"
#include "kernels/fused_host.h"
#include "kernels/named_formats.h"

namespace kvdepot::gpu {
namespace {

absl::Status CheckPointer(const void* p, absl::string_view name,
                          uintptr_t alignment) {
  if (p == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is null"));
  }
  if (reinterpret_cast<uintptr_t>(p) % alignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " is not ", alignment, "-byte aligned"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status FusedStore(const PoolLayout& layout, void* layer,
                        const uint16_t* kv, const FusedParams& params,
                        const int32_t* slot_mapping, int64_t num_tokens,
                        uint16_t* cast_back, const LaunchOptions& options) {
  const std::optional<FormatId> id = IdentifyFormat(layout.format);
  if (!id.has_value()) {
    return absl::InvalidArgumentError(
        "format is not one of the supported formats (SPEC §2)");
  }
  if (layout.block_size <= 0 || layout.num_blocks <= 0 ||
      layout.num_slots() > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout: block_size = ", layout.block_size, ", num_blocks = ",
        layout.num_blocks, " must be positive with slots fitting int32"));
  }
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens = ", num_tokens, " is negative"));
  }
  // Ranges, lengths and pointers; the positions are the caller's (host).
  RETURN_IF_ERROR(ValidateFused(layout.format, params, {}));
  if (num_tokens == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckPointer(layer, "layer", 16));
  RETURN_IF_ERROR(CheckPointer(kv, "kv", 16));
  RETURN_IF_ERROR(CheckPointer(slot_mapping, "slot_mapping", 4));
  if (cast_back != nullptr) {
    RETURN_IF_ERROR(CheckPointer(cast_back, "cast_back", 16));
  }
  if (params.norm()) {
    RETURN_IF_ERROR(CheckPointer(params.norm_weight, "norm_weight", 16));
  }
  if (params.rope != RopeStyle::kNone) {
    RETURN_IF_ERROR(CheckPointer(params.positions, "positions", 8));
    // Rows are read as float4 (fused_mla.cu, fused_h512.cu).
    RETURN_IF_ERROR(CheckPointer(params.cos_sin, "cos_sin", 16));
  }
  RETURN_IF_CUDA_ERROR(
      internal::LaunchFusedStore(
          *id, layout, static_cast<uint8_t*>(layer), kv, params, slot_mapping,
          num_tokens, cast_back,
          {static_cast<cudaStream_t>(options.stream), options.pdl}),
      "launching the fused store kernel");
  return absl::OkStatus();
}

}  // namespace kvdepot::gpu
