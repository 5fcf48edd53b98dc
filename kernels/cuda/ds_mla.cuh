// DS_MLA_FP8 (SPEC §2.1) tile math on the device, shared by the store/load
// kernels (ds_mla.cu) and the fused store (fused.cu). A tile of 128
// elements is 8 neighbouring lanes of 16 elements each (lanes 8k..8k+7 hold
// tile k of a token when a warp holds one token). Bit-exact with the CPU
// reference (kernels/reference/ds_mla.cc) through quant.h's primitives.
#ifndef KVDEPOT_KERNELS_CUDA_DS_MLA_CUH_
#define KVDEPOT_KERNELS_CUDA_DS_MLA_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_quant.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/named_formats.h"
#include "kernels/quant.h"

namespace kvdepot::gpu::internal {

inline constexpr int kDsMlaRecord = kFormatDsMlaFp8.bytes_per_token();  // 656
inline constexpr int kDsMlaElems = kFormatDsMlaFp8.elements();          // 576
inline constexpr int kDsMlaTailOffset =
    kFormatDsMlaFp8.quantized_bytes() + kFormatDsMlaFp8.sf_bytes();  // 528
static_assert(kFormatDsMlaFp8.elements_per_sf == 128 &&
              kFormatDsMlaFp8.quantized_elements == 512 &&
              kFormatDsMlaFp8.bf16_elements == 64 && kDsMlaTailOffset == 528);

// Quantizes one lane's 16 elements of a tile; every lane of the warp calls it
// (shuffles among the 8 lanes of a tile). Returns the 16 codes and sets the
// tile's scale bits (the same in all 8 lanes).
template <bool kHw>
__device__ __forceinline__ uint4 DsMlaEncode16(const float (&x)[16],
                                               uint32_t* scale_bits) {
  float amax = 0.0f;
  uint32_t flags = 0;  // 1: a NaN, 2: an Inf
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const uint32_t a = FloatBits(x[i]) & 0x7FFFFFFFu;
    flags |= a > 0x7F800000u ? 1u : (a == 0x7F800000u ? 2u : 0u);
    amax = fmaxf(amax, BitsToFloat(a));  // fmaxf ignores NaN
  }
#pragma unroll
  for (int off = 1; off < 8; off *= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
    flags |= __shfl_xor_sync(kFullMask, flags, off);
  }
  if (flags & 1u) {
    *scale_bits = kDsMlaNanScaleBits;
    const uint32_t w = 0x7F7F7F7Fu;
    return make_uint4(w, w, w, w);
  }
  uint32_t w[4] = {0, 0, 0, 0};
  if (flags & 2u) {
    *scale_bits = kDsMlaInfScaleBits;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      w[i / 4] |= static_cast<uint32_t>(DsMlaInfTileCode(x[i]))
                  << (8 * (i % 4));
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
  const uint32_t u = FloatBits(fmaxf(__fdiv_rn(amax, kE4M3Max), kAmaxFloor));
  const int e = static_cast<int>(u >> 23) - 127 + ((u & 0x7FFFFFu) ? 1 : 0);
  *scale_bits = static_cast<uint32_t>(e + 127) << 23;
  const float inv = BitsToFloat(static_cast<uint32_t>(127 - e) << 23);  // 2^-e
#pragma unroll
  for (int i = 0; i < 8; ++i) {  // finite, |x * 2^-e| <= 448: no NaN bytes
    w[i / 2] |=
        E4M3x2<kHw>(__fmul_rn(x[2 * i], inv), __fmul_rn(x[2 * i + 1], inv))
        << (16 * (i % 2));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// 16 codes with their tile's fp32 scale -> 16 BF16 (8 words): bf16_rne(q x
// s) as quant.h computes it; NaN results canonical (0x7FC0).
__device__ __forceinline__ void DsMlaDecode16(uint4 q, uint32_t scale_bits,
                                              uint32_t (&out)[8]) {
  const float scale = BitsToFloat(scale_bits);
  const uint32_t nan = (((q.x & 0x7F7F7F7Fu) + 0x01010101u) |
                        ((q.y & 0x7F7F7F7Fu) + 0x01010101u) |
                        ((q.z & 0x7F7F7F7Fu) + 0x01010101u) |
                        ((q.w & 0x7F7F7F7Fu) + 0x01010101u)) &
                       0x80808080u;
  if (nan != 0 || (scale_bits & 0x7F800000u) == 0x7F800000u) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t w = (&q.x)[i / 2] >> (16 * (i % 2));
      out[i] = FloatToBf16(__fmul_rn(DecodeE4M3(w & 0xFFu), scale)) |
               (static_cast<uint32_t>(
                    FloatToBf16(__fmul_rn(DecodeE4M3((w >> 8) & 0xFFu), scale)))
                << 16);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float2 f = HwE4M3x2ToFloat2((&q.x)[i / 2] >> (16 * (i % 2)));
    out[i] = HwBf16x2(__fmul_rn(f.x, scale), __fmul_rn(f.y, scale));
  }
}

// Writes one lane's part of a token's 656-byte record at slot >= 0 of a
// layer whose blocks are block_stride bytes apart (div: by block_size): the
// lane's 16 codes, the four tiles' scales (lane 0) and the BF16 tail words
// (lanes 0-7). Every lane of the warp calls it, whatever the slot (the
// scales meet by shuffles).
__device__ __forceinline__ void DsMlaPutRecord(uint8_t* layer,
                                               int64_t block_stride,
                                               const FastDiv& div, int32_t slot,
                                               uint4 q, uint32_t scale_bits,
                                               uint4 tail, int lane) {
  const uint32_t s0 = __shfl_sync(kFullMask, scale_bits, 0);
  const uint32_t s1 = __shfl_sync(kFullMask, scale_bits, 8);
  const uint32_t s2 = __shfl_sync(kFullMask, scale_bits, 16);
  const uint32_t s3 = __shfl_sync(kFullMask, scale_bits, 24);
  if (slot < 0) return;
  const int32_t block = div.Div(slot);
  uint8_t* rec = layer + block * block_stride +
                 static_cast<int64_t>(slot - block * div.d) * kDsMlaRecord;
  StoreStream16(rec + 16 * lane, q);
  if (lane == 0) StoreStream16(rec + 512, make_uint4(s0, s1, s2, s3));
  if (lane < 8) StoreStream16(rec + kDsMlaTailOffset + 16 * lane, tail);
}

// The cast-back row of what DsMlaPutRecord wrote (the BF16 a later load
// returns): lane l's 16 decoded elements and, lanes 0-7, the tail.
__device__ __forceinline__ void DsMlaPutCastBack(uint16_t* row, uint4 q,
                                                 uint32_t scale_bits,
                                                 uint4 tail, int lane) {
  uint32_t w[8];
  DsMlaDecode16(q, scale_bits, w);
  StoreStream16(row + 16 * lane, make_uint4(w[0], w[1], w[2], w[3]));
  StoreStream16(row + 16 * lane + 8, make_uint4(w[4], w[5], w[6], w[7]));
  if (lane < 8) StoreStream16(row + 512 + 8 * lane, tail);
}

}  // namespace kvdepot::gpu::internal

#endif  // KVDEPOT_KERNELS_CUDA_DS_MLA_CUH_
