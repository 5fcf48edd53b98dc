// The CUDA fused store (SPEC §8) behind a host-only API: per token RMSNorm
// -> RoPE -> Hadamard -> BF16 -> the format's quantization -> scatter by
// slot, optionally writing the BF16 a later load returns (cast_back).
// Bit-exact with the CPU reference (kernels/reference/fused.h).
//
// Like kernels.h: the launcher checks only what it can without reading
// device memory (format, ranges, sizes, null and alignment); the caller
// runs ValidateFused (with the host copy of the positions) and
// ValidateStore (host copy of the slots) first.
#ifndef KVDEPOT_KERNELS_CUDA_FUSED_KERNELS_H_
#define KVDEPOT_KERNELS_CUDA_FUSED_KERNELS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/kernels.h"
#include "kernels/format.h"
#include "kernels/fused.h"

namespace kvdepot::gpu {

// Fused store into one pool layer.
//   layer:        the layer's base (layout.layer_bytes), 16-byte aligned
//   kv:           [num_tokens][format.elements()] BF16, 16-byte aligned
//   params:       ranges as FusedParams; its arrays are device memory:
//                 norm_weight 16-byte aligned, positions [num_tokens]
//                 (REQUIRES each in [0, max_position)), cos_sin
//                 [max_position][rope_dim]
//   slot_mapping: [num_tokens]; -1 = padding, skip; REQUIRES validated
//   cast_back:    [num_tokens][format.elements()] BF16, 16-byte aligned, or
//                 null; -1 slots get theirs too
// num_tokens = 0 launches nothing.
absl::Status FusedStore(const PoolLayout& layout, void* layer,
                        const uint16_t* kv, const FusedParams& params,
                        const int32_t* slot_mapping, int64_t num_tokens,
                        uint16_t* cast_back, const LaunchOptions& options = {});

}  // namespace kvdepot::gpu

#endif  // KVDEPOT_KERNELS_CUDA_FUSED_KERNELS_H_
