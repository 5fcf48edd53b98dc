// The boundary between the fused store's launcher (fused_kernels.cc, plain
// C++ with absl) and its kernel (fused.cu, nvcc without absl): sizes the
// grid, picks the specialization (format x Hadamard length) and launches.
#ifndef KVDEPOT_KERNELS_CUDA_FUSED_INTERNAL_H_
#define KVDEPOT_KERNELS_CUDA_FUSED_INTERNAL_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/launch_internal.h"
#include "kernels/format.h"
#include "kernels/fused.h"
#include "kernels/named_formats.h"

namespace kvdepot::gpu::internal {

// kv: [n][D] BF16; slots: [n], -1 = skip; cast_back: [n][D] BF16 or null.
// The params' arrays are device memory. REQUIRES: ValidateFused and the
// slots validated on host copies, n > 0, hadamard_len in {0, 64, 128, 256,
// 512}, kv / layer / cast_back / norm_weight 16-byte aligned.
cudaError_t LaunchFusedStore(FormatId id, const PoolLayout& layout,
                             uint8_t* layer, const uint16_t* kv,
                             const FusedParams& params, const int32_t* slots,
                             int64_t n, uint16_t* cast_back,
                             const Launch& launch);

// DS_MLA_FP8 in the MLA configuration (norm [0, 512) or none, RoPE on
// [512, 576) or none, no Hadamard): fused_mla.cu's register-only kernel,
// the same bytes as LaunchFusedStore's general one. FusedMlaApplies says
// whether params are that configuration (LaunchFusedMla refuses others).
bool FusedMlaApplies(const FusedParams& params);
cudaError_t LaunchFusedMla(const PoolLayout& layout, uint8_t* layer,
                           const uint16_t* kv, const FusedParams& params,
                           const int32_t* slots, int64_t n, uint16_t* cast_back,
                           const Launch& launch);

// V41, V41_FP4 and BF16(512) (`elements`: the format's) with a Hadamard
// over the whole token or none (RoPE, if any, in [256, 512) from a multiple
// of 8; NeoX with rope_dim a multiple of 16): fused_h512.cu's register-only
// kernel, the same bytes as the general one. cos_sin 16-byte aligned.
bool FusedH512Applies(FormatId id, int32_t elements, const FusedParams& params);
cudaError_t LaunchFusedH512(FormatId id, const PoolLayout& layout,
                            uint8_t* layer, const uint16_t* kv,
                            const FusedParams& params, const int32_t* slots,
                            int64_t n, uint16_t* cast_back,
                            const Launch& launch);

// FP4_INDEX, FP8_FP32SF_INDEX and MXFP8_INDEX without RoPE, with a
// Hadamard over the whole token or none, above 64K tokens: fused_row.cu's
// kernels (one or two lanes per token), the same bytes as the general one
// (which keeps the smaller batches).
bool FusedRowApplies(FormatId id, const FusedParams& params, int64_t n);
cudaError_t LaunchFusedRow(FormatId id, const PoolLayout& layout,
                           uint8_t* layer, const uint16_t* kv,
                           const FusedParams& params, const int32_t* slots,
                           int64_t n, uint16_t* cast_back,
                           const Launch& launch);

}  // namespace kvdepot::gpu::internal

#endif  // KVDEPOT_KERNELS_CUDA_FUSED_INTERNAL_H_
