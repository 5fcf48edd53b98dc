// DS_MLA_FP8 (SPEC §2.1) tile math on the device, shared by the store/load
// kernels (ds_mla.cu) and the fused stores (fused_mla.cu, fused.cu), in two
// lane layouts of a warp holding one token: the generic fused kernel's (a
// tile of 128 elements is 8 neighbouring lanes of 16 elements each: lanes
// 8k..8k+7 hold tile k) and the coalesced chunk layout below. Bit-exact with
// the CPU reference (kernels/reference/ds_mla.cc) through quant.h's
// primitives; a tile's amax and flags do not depend on how it is split.
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

// A lane's largest |x| bits over n values (unsigned max of the magnitude
// bits: for finite values the float order; a NaN is above 0x7F800000 and an
// Inf equal to it, so the tile's maximum alone tells NaN > Inf > finite).
template <int kN>
__device__ __forceinline__ uint32_t DsMlaLaneMaxBits(const float* x) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < kN; ++i) m = max(m, FloatBits(x[i]) & 0x7FFFFFFFu);
  return m;
}

// quant.h's DsMlaScaleExponent without the division, from the bits of a
// finite amax >= 0: amax = m 2^E with m in [1, 2) gives amax / 448 =
// (m / 1.75) 2^(E - 8), whose ceil(log2) is E - 8 for m <= 1.75 and E - 7
// above. The division's rounding cannot land on a power of two from above
// (amax's spacing there is coarser than the quotient's half-ulp), and the
// floor 1e-4 lies in (2^-14, 2^-13), so both give the same e; CheckEncoders
// (diagnostics.h) compares them for every finite amax on the device.
__device__ __forceinline__ int DsMlaScaleExponentOfBits(uint32_t amax_bits) {
  if (amax_bits < 0x00800000u) return -13;  // zero or subnormal
  const int e = static_cast<int>(amax_bits >> 23) - 135 +
                ((amax_bits & 0x7FFFFFu) > 0x600000u ? 1 : 0);
  return max(e, -13);
}

// A lane's n values of a tile whose largest magnitude bits are known (the
// whole tile's): n / 4 code words, and the tile's scale bits (SPEC §2.1: NaN
// tile -> NaN scale and 0x7F codes; Inf tile -> Inf scale, codes by sign;
// else the power-of-two scale of amax / 448).
template <bool kHw, int kN>
__device__ __forceinline__ void DsMlaQuantize(const float* x, uint32_t max_bits,
                                              uint32_t* scale_bits,
                                              uint32_t (&w)[kN / 4]) {
  if (max_bits > 0x7F800000u) {
    *scale_bits = kDsMlaNanScaleBits;
#pragma unroll
    for (int i = 0; i < kN / 4; ++i) w[i] = 0x7F7F7F7Fu;
    return;
  }
#pragma unroll
  for (int i = 0; i < kN / 4; ++i) w[i] = 0;
  if (max_bits == 0x7F800000u) {
    *scale_bits = kDsMlaInfScaleBits;
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      w[i / 4] |= static_cast<uint32_t>(DsMlaInfTileCode(x[i]))
                  << (8 * (i % 4));
    }
    return;
  }
  const int e = DsMlaScaleExponentOfBits(max_bits);
  *scale_bits = static_cast<uint32_t>(e + 127) << 23;
  const float inv = BitsToFloat(static_cast<uint32_t>(127 - e) << 23);  // 2^-e
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) {  // finite, |x * 2^-e| <= 448: no NaN
    w[i / 2] |=
        E4M3x2<kHw>(__fmul_rn(x[2 * i], inv), __fmul_rn(x[2 * i + 1], inv))
        << (16 * (i % 2));
  }
}

// Quantizes one lane's 16 elements of a tile; every lane of the warp calls it
// (shuffles among the 8 lanes of a tile). Returns the 16 codes and sets the
// tile's scale bits (the same in all 8 lanes).
template <bool kHw>
__device__ __forceinline__ uint4 DsMlaEncode16(const float (&x)[16],
                                               uint32_t* scale_bits) {
  uint32_t m = DsMlaLaneMaxBits<16>(x);
#pragma unroll
  for (int off = 1; off < 8; off *= 2) {
    m = max(m, __shfl_xor_sync(kFullMask, m, off));
  }
  uint32_t w[4];
  DsMlaQuantize<kHw, 16>(x, m, scale_bits, w);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// n / 2 words of codes with their tile's fp32 scale -> n BF16 (n / 2 words):
// bf16_rne(q x s) as quant.h computes it; NaN results canonical (0x7FC0).
// The hardware decodes every e4m3 code exactly as DecodeE4M3 does (the NaN
// codes to a NaN) and rounds like FloatToBf16 but for a NaN's bits, so only
// a tile with a NaN code or a NaN / Inf scale, whose products can be NaN,
// takes the canonicalizing rounding; the common path skips its selects.
template <int kWords>
__device__ __forceinline__ void DsMlaDecode(const uint32_t (&q)[kWords],
                                            uint32_t scale_bits,
                                            uint32_t (&out)[2 * kWords]) {
  const float scale = BitsToFloat(scale_bits);
  uint32_t nan = 0;
#pragma unroll
  for (int i = 0; i < kWords; ++i) nan |= (q[i] & 0x7F7F7F7Fu) + 0x01010101u;
  if ((nan & 0x80808080u) != 0 || (scale_bits & 0x7F800000u) == 0x7F800000u) {
#pragma unroll
    for (int i = 0; i < 2 * kWords; ++i) {
      const float2 f = HwE4M3x2ToFloat2(q[i / 2] >> (16 * (i % 2)));
      out[i] = HwBf16x2Canonical(__fmul_rn(f.x, scale), __fmul_rn(f.y, scale));
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 2 * kWords; ++i) {
    const float2 f = HwE4M3x2ToFloat2(q[i / 2] >> (16 * (i % 2)));
    out[i] = HwBf16x2(__fmul_rn(f.x, scale), __fmul_rn(f.y, scale));
  }
}

// 16 codes with their tile's fp32 scale -> 16 BF16 (8 words).
__device__ __forceinline__ void DsMlaDecode16(uint4 q, uint32_t scale_bits,
                                              uint32_t (&out)[8]) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  DsMlaDecode<4>(w, scale_bits, out);
}

// The record's byte address of slot >= 0 in a layer whose blocks are
// block_stride bytes apart (div: by block_size).
__device__ __forceinline__ uint8_t* DsMlaRecordAt(uint8_t* layer,
                                                  int64_t block_stride,
                                                  const FastDiv& div,
                                                  int32_t slot) {
  const int32_t block = div.Div(slot);
  return layer + block * block_stride +
         static_cast<int64_t>(slot - block * div.d) * kDsMlaRecord;
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
  uint8_t* rec = DsMlaRecordAt(layer, block_stride, div, slot);
  StoreStream16(rec + 16 * lane, q);
  if (lane == 0) StoreStream16(rec + 512, make_uint4(s0, s1, s2, s3));
  if (lane < 8) StoreStream16(rec + kDsMlaTailOffset + 16 * lane, tail);
}

// The cast-back row of what DsMlaPutRecord wrote (the BF16 a later load
// returns): lane l's 16 decoded elements and, lanes 0-7, the tail. Default
// store policy: the prefill attention reads the row next.
__device__ __forceinline__ void DsMlaPutCastBack(uint16_t* row, uint4 q,
                                                 uint32_t scale_bits,
                                                 uint4 tail, int lane) {
  uint32_t w[8];
  DsMlaDecode16(q, scale_bits, w);
  Store16(row + 16 * lane, make_uint4(w[0], w[1], w[2], w[3]));
  Store16(row + 16 * lane + 8, make_uint4(w[4], w[5], w[6], w[7]));
  if (lane < 8) Store16(row + 512 + 8 * lane, tail);
}

// The coalesced layout of the plain store and load (ds_mla.cu) and the MLA
// fused store (fused_mla.cu): lane l holds chunks l and 32 + l of 8
// elements, i.e. elements [8l, 8l + 8) of tile l / 16 and [256 + 8l, +8) of
// tile 2 + l / 16; a tile is 16 neighbouring lanes. Every warp-wide access
// is contiguous: 512 B per 16-byte load or store of a BF16 row, 256 B per
// 8-byte load or store of the codes. (With 16 elements per lane, each
// 16-byte access of a row covered every other 16 B, so every 32-byte
// sector was requested twice.)
struct DsMlaChunks {
  uint2 q0, q1;       // codes of chunks l and 32 + l
  uint32_t sb0, sb1;  // their tiles' scale bits
};

// The largest |x| bits (as fp32 bits) of 8 BF16 values packed in 4 words:
// DsMlaLaneMaxBits on the packed halves (max.u16x2), for values that are
// BF16 exactly.
__device__ __forceinline__ uint32_t DsMlaBf16MaxBits(const uint32_t* w) {
  uint32_t m = w[0] & 0x7FFF7FFFu;
#pragma unroll
  for (int i = 1; i < 4; ++i) {
    const uint32_t a = w[i] & 0x7FFF7FFFu;
    asm("max.u16x2 %0, %0, %1;" : "+r"(m) : "r"(a));
  }
  return max(m & 0xFFFFu, m >> 16) << 16;
}

// Quantizes a lane's two chunks (x[0, 8): chunk l; x[8, 16): chunk 32 + l)
// whose own largest magnitude bits are m0, m1; every lane of the warp calls
// it (tiles meet by xor shuffles over 16 lanes, both tiles at once).
template <bool kHw>
__device__ __forceinline__ DsMlaChunks DsMlaEncodeChunks(const float (&x)[16],
                                                         uint32_t m0,
                                                         uint32_t m1) {
#pragma unroll
  for (int off = 1; off < 16; off *= 2) {
    m0 = max(m0, __shfl_xor_sync(kFullMask, m0, off));
    m1 = max(m1, __shfl_xor_sync(kFullMask, m1, off));
  }
  DsMlaChunks c;
  uint32_t w0[2], w1[2];
  DsMlaQuantize<kHw, 8>(x, m0, &c.sb0, w0);
  DsMlaQuantize<kHw, 8>(x + 8, m1, &c.sb1, w1);
  c.q0 = make_uint2(w0[0], w0[1]);
  c.q1 = make_uint2(w1[0], w1[1]);
  return c;
}

// The same for BF16 values x, also given packed (w[0, 4): chunk l,
// w[4, 8): chunk 32 + l): the store's input and the fused store's rounded
// values are BF16 exactly.
template <bool kHw>
__device__ __forceinline__ DsMlaChunks
DsMlaEncodeChunksBf16(const float (&x)[16], const uint32_t (&w)[8]) {
  return DsMlaEncodeChunks<kHw>(x, DsMlaBf16MaxBits(w),
                                DsMlaBf16MaxBits(w + 4));
}

// The BF16 tail (64 elements, 128 bytes) at `at`, from registers in either
// of two layouts: a uint4 on each of lanes 0-7 (elements [8l, 8l + 8)) or
// a uint32_t on every lane (elements 2l, 2l + 1: the fused store's, whose
// RoPE pairs then lie one per lane). kStreaming: evict-first stores.
template <bool kStreaming>
__device__ __forceinline__ void DsMlaPutTail(uint8_t* at, uint4 tail,
                                             int lane) {
  if (lane >= 8) return;
  if constexpr (kStreaming) {
    StoreStream16(at + 16 * lane, tail);
  } else {
    Store16(at + 16 * lane, tail);
  }
}
template <bool kStreaming>
__device__ __forceinline__ void DsMlaPutTail(uint8_t* at, uint32_t tail,
                                             int lane) {
  if constexpr (kStreaming) {
    StoreStream4(at + 4 * lane, tail);
  } else {
    *reinterpret_cast<uint32_t*>(at + 4 * lane) = tail;
  }
}

// Writes one lane's part of a record in the chunk layout: its two code
// chunks, the four scales (lane 0) and its part of the BF16 tail (Tail:
// DsMlaPutTail's layouts). Every lane of the warp calls it, whatever the
// slot. kStreaming: evict-first stores; else the default policy, which
// keeps a record's 32-byte sectors that it shares with its neighbours
// (records are 656 bytes) in L2 until both halves are written.
template <bool kStreaming = true, class Tail>
__device__ __forceinline__ void DsMlaPutRecordChunks(
    uint8_t* layer, int64_t block_stride, const FastDiv& div, int32_t slot,
    const DsMlaChunks& c, Tail tail, int lane) {
  // Tiles 0, 1 are chunks 0-15, 16-31 (first chunks of lanes 0-15, 16-31);
  // tiles 2, 3 the second chunks of the same lanes: lane 0 has tiles 0 and
  // 2, lane 16 tiles 1 and 3.
  const uint32_t s1 = __shfl_sync(kFullMask, c.sb0, 16);
  const uint32_t s3 = __shfl_sync(kFullMask, c.sb1, 16);
  if (slot < 0) return;
  uint8_t* rec = DsMlaRecordAt(layer, block_stride, div, slot);
  if constexpr (kStreaming) {
    StoreStream8(rec + 8 * lane, c.q0);
    StoreStream8(rec + 256 + 8 * lane, c.q1);
    if (lane == 0) StoreStream16(rec + 512, make_uint4(c.sb0, s1, c.sb1, s3));
  } else {
    *reinterpret_cast<uint2*>(rec + 8 * lane) = c.q0;
    *reinterpret_cast<uint2*>(rec + 256 + 8 * lane) = c.q1;
    if (lane == 0) {
      *reinterpret_cast<uint4*>(rec + 512) = make_uint4(c.sb0, s1, c.sb1, s3);
    }
  }
  DsMlaPutTail<kStreaming>(rec + kDsMlaTailOffset, tail, lane);
}

// A BF16 row [576] of a record's lane part in the chunk layout (the load's
// output with evict-first stores, or with kStreaming = false the fused
// store's cast-back, which the prefill attention reads next). Tail:
// DsMlaPutTail's layouts.
template <bool kStreaming = true, class Tail>
__device__ __forceinline__ void DsMlaPutRowChunks(uint16_t* row,
                                                  const DsMlaChunks& c,
                                                  Tail tail, int lane) {
  const uint32_t q0[2] = {c.q0.x, c.q0.y}, q1[2] = {c.q1.x, c.q1.y};
  uint32_t w0[4], w1[4];
  DsMlaDecode<2>(q0, c.sb0, w0);
  DsMlaDecode<2>(q1, c.sb1, w1);
  const uint4 a = make_uint4(w0[0], w0[1], w0[2], w0[3]);
  const uint4 b = make_uint4(w1[0], w1[1], w1[2], w1[3]);
  if constexpr (kStreaming) {
    StoreStream16(row + 8 * lane, a);
    StoreStream16(row + 256 + 8 * lane, b);
  } else {
    Store16(row + 8 * lane, a);
    Store16(row + 256 + 8 * lane, b);
  }
  DsMlaPutTail<kStreaming>(reinterpret_cast<uint8_t*>(row + 512), tail, lane);
}

}  // namespace kvdepot::gpu::internal

#endif  // KVDEPOT_KERNELS_CUDA_DS_MLA_CUH_
