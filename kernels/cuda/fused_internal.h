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
// [512, 576) or none, no Hadamard): fused_mla.cu's kernels, the same bytes
// as LaunchFusedStore's general one. FusedMlaApplies says whether params
// are that configuration (LaunchFusedMla refuses others). The kernels:
// kWarps, one warp per token with its values in registers; kAhead and
// kAhead5, the same with the next token's loads in flight, built for at
// least 7 and 5 CTAs per SM (more warps, or more registers: 6 resident
// with the norm and interleaved RoPE); kBulk, the token rows
// brought into shared memory by bulk copies two tiles ahead and each
// record written by one bulk store (ds_mla_bulk.cuh), for RoPE none or
// interleaved with a 16-byte aligned layer and block stride. Tests and
// benchmarks name one (kBulk where it cannot run: cudaErrorNotSupported,
// nothing launched). The bulk kernel's crossover on an H100 (% of copy,
// warps / bulk, 2026-12-06 ~04:31, BENCHMARKS.md):
//   tokens        16K        32K        64K        128K       1M
//   mla           71.1/65.6  80.0/74.0  85.9/82.8  88.5/88.9  89.5/94.5
//   + cast_back   79.9/77.4  85.6/82.6  87.9/87.2  88.8/89.9  87.3/91.9
// the same as the plain store's kDsMlaBulkMinTokens.
enum class FusedMlaPath { kAuto, kWarps, kAhead, kAhead5, kBulk };
inline constexpr int64_t kFusedMlaBulkMinTokens = int64_t{1} << 17;
// kAuto takes the load-ahead kernels from kFusedMlaAheadMinTokens tokens,
// for RoPE none or interleaved: kAhead5 with cast_back or from
// kFusedMlaAhead5MinTokens tokens, else kAhead; and kBulk from
// kFusedMlaBulkMinTokens only on a device whose peak memory bandwidth per
// SM is at most kFusedMlaBulkMaxBytesPerSmSecond: the bulk pipeline's
// bytes in flight per SM are fixed, and where each SM must carry more (an
// H200: 4.8 TB/s over 132 SMs, 36 GB/s each; an H100 SXM: 3.35 TB/s, 25
// GB/s) it falls behind (on the H200 of 2026-12-07: 64.5 % at 64K against
// the load-ahead kernel's 77.6 %). % of copy on an H100 under MPS at 70 %
// of its SMs, the H200's bandwidth per SM (2026-12-07 ~08:05,
// BENCHMARKS.md; the same stand-in put the earlier load-ahead kernel at
// 79.8-80.3 % at 64K, which measured 77.6 % on the H200):
//   tokens              32K   64K   128K  1M
//   mla, kAhead         81.8  86.1  89.0  88.0
//   mla, kAhead5        81.4  85.5  88.7  90.0
//   + cast_back, kAhead       79.6        77.3
//   + cast_back, kAhead5      82.9        79.6
// On all 132 SMs of the H100 the two are within 0.7 points.
inline constexpr int64_t kFusedMlaAheadMinTokens = int64_t{1} << 15;
inline constexpr int64_t kFusedMlaAhead5MinTokens = int64_t{1} << 20;
inline constexpr double kFusedMlaBulkMaxBytesPerSmSecond = 30e9;
bool FusedMlaApplies(const FusedParams& params);
cudaError_t LaunchFusedMla(const PoolLayout& layout, uint8_t* layer,
                           const uint16_t* kv, const FusedParams& params,
                           const int32_t* slots, int64_t n, uint16_t* cast_back,
                           const Launch& launch,
                           FusedMlaPath path = FusedMlaPath::kAuto);

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
// Hadamard over the whole token or none, above kMaxQuadTokens
// tokens: fused_row.cu's kernels (one or two lanes per token), the same
// bytes as the general one (which keeps the smaller batches).
//
// Up to kMaxQuadTokens tokens fused.cu's four-tokens-per-warp kernel runs.
// At 1-1024 tokens (graph replay, H200) it takes 1.6-2.0 us, the two-lane
// kernel 2.3-3.2 and the one-lane kernel 3.8-4.5. The two cross between
// 22K and 24K tokens; % of copy, four per warp -> two lanes, means of two
// runs (docs/BENCHMARKS.md, 2026-12-03 ~18:05; 32K and 64K ~17:50):
//                     16K          22K          24K          32K   64K
//   MXFP8_INDEX       29.3 -> 26.2 32.4 -> 30.8 31.8 -> 34.2 +1.9  +1.1
//   FP4_INDEX         21.8 -> 20.9 25.4 -> 24.2 23.6 -> 26.0 +2.4  +3.9
//   FP8_FP32SF_INDEX  28.2 -> 26.7 31.4 -> 30.6 30.5 -> 33.3 +3.0  +4.5
inline constexpr int64_t kMaxQuadTokens = 23552;
// Above kMaxQuadTokens and up to this many, two lanes per token; above,
// one (FP8_FP32SF_INDEX: always two). % of copy at 64K + 1, 256K and 1M
// tokens, one lane -> two lanes (means of two runs, 2026-12-03 ~16:00):
//   MXFP8_INDEX       44.0 -> 46.5, 63.9 -> 64.3, 76.3 -> 72.3
//   FP4_INDEX         33.0 -> 36.5, 47.7 -> 48.7, 54.4 -> 52.8
//   FP8_FP32SF_INDEX  40.5 -> 48.4, 59.9 -> 68.3, 71.6 -> 77.2
inline constexpr int64_t kMaxPairTokens = 262144;
bool FusedRowApplies(FormatId id, const FusedParams& params, int64_t n);
cudaError_t LaunchFusedRow(FormatId id, const PoolLayout& layout,
                           uint8_t* layer, const uint16_t* kv,
                           const FusedParams& params, const int32_t* slots,
                           int64_t n, uint16_t* cast_back,
                           const Launch& launch);

}  // namespace kvdepot::gpu::internal

#endif  // KVDEPOT_KERNELS_CUDA_FUSED_INTERNAL_H_
