// The fused store (SPEC §8): per token RMSNorm -> RoPE -> Hadamard -> round
// to BF16 -> quantize with the format's math -> scatter by slot, and the
// optional cast_back (the BF16 a later load returns). One warp per token,
// persistent grid, the next token's row loaded while the current one is
// processed. Specialized on the format and the Hadamard length only; norm
// and RoPE are runtime flags.
//
// Bit-exactness with kernels/reference/fused.cc: every product, sum, sqrt
// and division is an explicit round-to-nearest intrinsic (__fmul_rn,
// __fadd_rn, __fsub_rn, __fsqrt_rn, __fdiv_rn), so nothing can be
// contracted to an FMA (the file is also compiled with -fmad=false), and
// the RMSNorm sum follows SPEC §8's tree: lane l holds the token's 8-element
// chunks c = l, l + 32, l + 64, ... (c mod 32 = l, increasing c), sums each
// left to right into its slot, and the slots meet by xor shuffles 16...1.
//
//   registers:  lane l, chunk k: elements [8c, 8c + 8), c = l + 32k (16 B)
//   shared:     the token as fp32 [D] per warp (RoPE pairs and the
//               Hadamard butterflies cross lanes), XOR-swizzled in 16-byte
//               units (Swz: conflict-free for every access pattern below)
//   Hadamard L: two passes through shared memory (pass A: lane l holds
//               [begin + l L/32, +L/32), stages h < L/32 in registers;
//               pass B: lane holds the element bits log2(L/32)..2 log2(L/32)
//               in registers, the rest by xor shuffles: 16 shuffles per
//               value instead of 80 for a one-pass L = 512)
//   quantize:   lane l holds elements [16l, 16l + 16) as the store kernels
//               (index formats: lanes 0-7; DS_MLA_FP8 tail: lanes 0-7 with
//               8 elements each; BF16(N): 8 elements per chunk, lane-strided)
//
// Two tokens in flight per warp with their first cos/sin pair, the norm
// weights kept in registers for the whole grid-stride loop; the 128-element
// index formats take four tokens per warp
// (FusedStoreKernelQuad, the next four loaded while these are processed;
// above 23K tokens without RoPE and with a Hadamard of 128 or none they go
// to fused_row.cu's kernels, one or two lanes per token), where a
// Hadamard over the whole token ends in registers (HadamardQuad128: xor
// shuffles for h = 16 ... 64) and is quantized from there. (The
// round-1 shape, an unswizzled buffer with a one-pass Hadamard, one token
// prefetched, was deleted once this one had replaced it.)
// The order of the Hadamard stages h = 1, 2, 4, ... and each a + b / a - b
// is the reference's (a data layout only changes who holds what).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_quant.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/ds_mla.cuh"
#include "kernels/cuda/fused_internal.h"
#include "kernels/format.h"
#include "kernels/fused.h"
#include "kernels/named_formats.h"
#include "kernels/quant.h"

namespace kvdepot::gpu::internal {
namespace {

constexpr int kThreads = 128;
constexpr int kWarpsPerCta = kThreads / kWarp;

// Per format: the quantized format (if any) and the token's element count
// (0 = known at run time: BF16(N)).
template <FormatId kId>
struct FusedTraits;
template <>
struct FusedTraits<FormatId::kV41> {
  using Q = V41Format;
  static constexpr int kD = 512;
};
template <>
struct FusedTraits<FormatId::kV41Fp4> {
  using Q = V41Fp4Format;
  static constexpr int kD = 512;
};
template <>
struct FusedTraits<FormatId::kFp4Index> {
  using Q = Fp4IndexFormat;
  static constexpr int kD = 128;
};
template <>
struct FusedTraits<FormatId::kFp8Fp32SfIndex> {
  using Q = Fp8Fp32SfFormat;
  static constexpr int kD = 128;
};
template <>
struct FusedTraits<FormatId::kMxfp8Index> {
  using Q = Mxfp8IndexFormat;
  static constexpr int kD = 128;
};
template <>
struct FusedTraits<FormatId::kDsMlaFp8> {
  using Q = void;
  static constexpr int kD = kDsMlaElems;
};
template <>
struct FusedTraits<FormatId::kBf16> {
  using Q = void;
  static constexpr int kD = 0;
};

template <FormatId kId>
constexpr int MaxElems() {
  return FusedTraits<kId>::kD > 0 ? FusedTraits<kId>::kD : kFusedMaxElements;
}

template <FormatId kId>
constexpr int MaxChunks() {  // 8-element chunks per lane
  return (MaxElems<kId>() / 8 + kWarp - 1) / kWarp;
}

constexpr int Log2(int x) { return x <= 1 ? 0 : 1 + Log2(x / 2); }

// The float index of element e in a warp's token buffer: e with its
// 16-byte unit within the 128-byte row XORed with the row (and bit 8 of e),
// a bijection inside each 32-float row that keeps every aligned float4
// contiguous.
__device__ __forceinline__ int Swz(int e) {
  const int r = (e >> 5) ^ ((e >> 8) << 2);
  return e ^ ((r & 7) << 2);
}

// One token's input as loaded (raw BF16), its slot and position.
template <int kChunks>
struct TokenIn {
  uint4 v[kChunks];
  int32_t slot = -1;
  int64_t pos = 0;
  float cos0 = 0.0f, sin0 = 0.0f;  // cos_sin[pos][lane], [pos][half + lane]
};

template <int kChunks>
__device__ __forceinline__ void LoadToken(const uint16_t* kv, int64_t token,
                                          int32_t d, const int32_t* slots,
                                          const FusedParams& p, int lane,
                                          TokenIn<kChunks>& in) {
  const uint16_t* row = kv + token * d;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int c = lane + kWarp * k;
    in.v[k] = c < d / 8 ? LoadStream16(row + 8 * c) : make_uint4(0, 0, 0, 0);
  }
  in.slot = __ldg(slots + token);
  in.pos = p.rope != RopeStyle::kNone ? __ldg(p.positions + token) : 0;
  const int half = p.rope_dim / 2;
  if (p.rope != RopeStyle::kNone && lane < half) {
    const float* cs = p.cos_sin + in.pos * p.rope_dim;
    in.cos0 = __ldg(cs + lane);
    in.sin0 = __ldg(cs + half + lane);
  }
}

// The norm weights of the lane's chunks (zero outside the norm range).
template <int kChunks>
__device__ __forceinline__ void LoadWeights(const FusedParams& p, int lane,
                                            uint4 (&w)[kChunks]) {
  const int c0 = p.norm_begin / 8, c1 = p.norm_end / 8;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int c = lane + kWarp * k;
    w[k] = p.norm() && c >= c0 && c < c1
               ? __ldg(reinterpret_cast<const uint4*>(p.norm_weight +
                                                      (8 * c - p.norm_begin)))
               : make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ float SumSquares8(const float (&x)[8]) {
  float s = __fmul_rn(x[0], x[0]);
#pragma unroll
  for (int i = 1; i < 8; ++i) s = __fadd_rn(s, __fmul_rn(x[i], x[i]));
  return s;
}

// Step 1 in registers, then the token to shared memory.
template <int kChunks>
__device__ __forceinline__ void NormToShared(const TokenIn<kChunks>& in,
                                             int32_t d, const FusedParams& p,
                                             const uint4 (&wpre)[kChunks],
                                             int lane, float* y) {
  float x[kChunks][8];
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const uint32_t w[4] = {in.v[k].x, in.v[k].y, in.v[k].z, in.v[k].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[k][2 * i] = BitsToFloat(w[i] << 16);
      x[k][2 * i + 1] = BitsToFloat(w[i] & 0xFFFF0000u);
    }
  }
  if (p.norm()) {
    const int c0 = p.norm_begin / 8, c1 = p.norm_end / 8;
    float slot = 0.0f;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int c = lane + kWarp * k;
      if (c >= c0 && c < c1) slot = __fadd_rn(slot, SumSquares8(x[k]));
    }
#pragma unroll
    for (int h = 16; h >= 1; h /= 2) {
      slot = __fadd_rn(slot, __shfl_xor_sync(kFullMask, slot, h));
    }
    const float sum = __shfl_sync(kFullMask, slot, 0);
    const float mean =
        __fdiv_rn(sum, static_cast<float>(p.norm_end - p.norm_begin));
    const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, p.eps)));
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int c = lane + kWarp * k;
      if (c < c0 || c >= c1) continue;
      const uint4 wv = wpre[k];
      const uint32_t w[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[k][2 * i] =
            __fmul_rn(__fmul_rn(x[k][2 * i], r), BitsToFloat(w[i] << 16));
        x[k][2 * i + 1] = __fmul_rn(__fmul_rn(x[k][2 * i + 1], r),
                                    BitsToFloat(w[i] & 0xFFFF0000u));
      }
    }
  }
  __syncwarp();  // the previous token's readers are done with y
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int c = lane + kWarp * k;
    if (c >= d / 8) continue;
    *reinterpret_cast<float4*>(y + Swz(8 * c)) =
        make_float4(x[k][0], x[k][1], x[k][2], x[k][3]);
    *reinterpret_cast<float4*>(y + Swz(8 * c + 4)) =
        make_float4(x[k][4], x[k][5], x[k][6], x[k][7]);
  }
  __syncwarp();
}

// Step 2 on shared memory.
__device__ __forceinline__ void Rope(const FusedParams& p, int64_t pos,
                                     float cos0, float sin0, int lane,
                                     float* y) {
  const int half = p.rope_dim / 2;
  const bool neox = p.rope == RopeStyle::kNeox;
  const float* cs = p.cos_sin + pos * p.rope_dim;
  const int r = p.rope_offset;
  for (int k = lane; k < half; k += kWarp) {
    const int ia = Swz(r + (neox ? k : 2 * k));
    const int ib = Swz(r + (neox ? k + half : 2 * k + 1));
    const float a = y[ia], b = y[ib];
    float c, s;
    if (k == lane) {  // prefetched with the token
      c = cos0;
      s = sin0;
    } else {
      c = __ldg(cs + k);
      s = __ldg(cs + half + k);
    }
    y[ia] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    y[ib] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  }
  __syncwarp();
}

// Step 3 on shared memory: stages h = 1, 2, 4, ... in order, in two passes
// over the swizzled buffer. Pass A: lane l holds elements begin + [l kPer,
// l kPer + kPer), stages h = 1 ... kPer / 2 in registers. Pass B: lane l,
// register i holds element begin + (l mod kPer) + kPer i + kPer^2 (l /
// kPer), stages h = kPer ... kPer^2 / 2 in registers, then h = kPer^2 ...
// L / 2 by xor shuffles (lane bit log2(h / kPer)). Each stage pairs the
// same (a, b) as the reference and writes a + b to the lower element,
// a - b to the upper.
template <int kLen>
__device__ __forceinline__ void HadamardTwoPass(int32_t begin, int lane,
                                                float* y) {
  constexpr int kPer = kLen / kWarp;
  constexpr int kP = Log2(kPer);
  static_assert(kPer >= 2 && kLen % kWarp == 0 && kPer * kPer <= kLen);
  float v[kPer];
  const int a0 = begin + kPer * lane;
  const bool vec = kPer >= 4 && (begin & 3) == 0;
  if (vec) {
#pragma unroll
    for (int q = 0; q < kPer / 4; ++q) {
      const float4 f = *reinterpret_cast<const float4*>(y + Swz(a0 + 4 * q));
      v[4 * q] = f.x;
      v[4 * q + 1] = f.y;
      v[4 * q + 2] = f.z;
      v[4 * q + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kPer; ++i) v[i] = y[Swz(a0 + i)];
  }
  RegisterButterflies<1, kPer>(v);
  // Each lane rewrites only what it read: no other lane touched it since
  // the last __syncwarp.
  if (vec) {
#pragma unroll
    for (int q = 0; q < kPer / 4; ++q) {
      *reinterpret_cast<float4*>(y + Swz(a0 + 4 * q)) =
          make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kPer; ++i) y[Swz(a0 + i)] = v[i];
  }
  __syncwarp();
  const int b0 = begin + (lane & (kPer - 1)) + kPer * kPer * (lane >> kP);
#pragma unroll
  for (int i = 0; i < kPer; ++i) v[i] = y[Swz(b0 + kPer * i)];
  RegisterButterflies<1, kPer>(v);  // h = kPer * s
#pragma unroll
  for (int m = kPer; m < kWarp; m *= 2) {  // h = kPer * m: partner lane ^ m
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const float o = __shfl_xor_sync(kFullMask, v[i], m);
      v[i] = upper ? __fsub_rn(o, v[i]) : __fadd_rn(v[i], o);
    }
  }
  const float scale = BitsToFloat(kHadamardScaleBits[Log2(kLen)]);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    y[Swz(b0 + kPer * i)] = __fmul_rn(v[i], scale);
  }
  __syncwarp();
}

// Step 4: 16 (or 8) values of shared memory, elements [e0, e0 + kN) (e0 a
// multiple of 4), rounded to BF16, as fp32 and as packed BF16 words.
template <int kN>
__device__ __forceinline__ void RoundBf16(const float* y, int e0,
                                          float (&x)[kN],
                                          uint32_t (&w)[kN / 2]) {
#pragma unroll
  for (int i = 0; i < kN / 4; ++i) {
    const float4 f = *reinterpret_cast<const float4*>(y + Swz(e0 + 4 * i));
    const uint32_t b0 = FloatToBf16(f.x), b1 = FloatToBf16(f.y);
    const uint32_t b2 = FloatToBf16(f.z), b3 = FloatToBf16(f.w);
    w[2 * i] = b0 | (b1 << 16);
    w[2 * i + 1] = b2 | (b3 << 16);
    x[4 * i] = BitsToFloat(b0 << 16);
    x[4 * i + 1] = BitsToFloat(b1 << 16);
    x[4 * i + 2] = BitsToFloat(b2 << 16);
    x[4 * i + 3] = BitsToFloat(b3 << 16);
  }
}

// Steps 5-6 for the §3 formats on a lane's 16 values already rounded to
// BF16 (elements [16 sub, +16) of its token): the store kernels' lane math
// (store.cu), then the decode of the lane's codes.
template <class Q>
__device__ __forceinline__ void QuantizeLaneValues(
    const PoolLayout& layout, const FastDiv& div, uint8_t* layer,
    const float (&x)[16], int32_t slot, int lane, bool active,
    uint16_t* cast_row) {
  // Inactive lanes (past the token) take part in the shuffles only.
  constexpr int kLpt = Q::kLanesPerToken;
  static_assert(kLpt == kWarp || kLpt == 8);
  const int sub = lane % kLpt;
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(x[i]));  // no NaN
#pragma unroll
  for (int off = 1; off < Q::kLanesPerGroup; off *= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
  }
  const GroupScale scale = ScaleOf<Q>(amax);
  const uint4 q = Encode16<Q, true>(x, scale.multiplier);
  uint32_t word = scale.stored;
  if constexpr (Q::kSf != ScaleFormat::kFP32) {
    const int base = lane - sub;
    word = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int src = base + ((4 * sub + i) * Q::kLanesPerGroup) % kLpt;
      word |= (__shfl_sync(kFullMask, scale.stored, src) & 0xFFu) << (8 * i);
    }
  }
  if (!active) return;
  if (slot >= 0) {
    const int32_t block = div.Div(slot);
    const int32_t t = slot - block * div.d;
    uint8_t* data =
        layer + DataOffset<Q>(layout, block, t) + sub * Q::kDataBytesPerLane;
    if constexpr (Q::kDataBytesPerLane == 16) {
      StoreStream16(data, q);
    } else {
      StoreStream8(data, make_uint2(q.x, q.y));
    }
    if (sub < Q::kScaleWords) {
      StoreStream4(layer + ScaleOffset<Q>(layout, block, t) + 4 * sub, word);
    }
  }
  if (cast_row != nullptr) CastBack16<Q>(q, scale.stored, cast_row + 16 * sub);
}

// The same for the lane's 16 elements of the token in the swizzled buffer
// y, rounded to BF16 here.
template <class Q>
__device__ __forceinline__ void QuantizeLane(const PoolLayout& layout,
                                             const FastDiv& div, uint8_t* layer,
                                             const float* y, int32_t slot,
                                             int lane, bool active,
                                             uint16_t* cast_row) {
  float x[16];
  uint32_t bf[8];
  RoundBf16<16>(y, 16 * (lane % Q::kLanesPerToken), x, bf);
  QuantizeLaneValues<Q>(layout, div, layer, x, slot, lane, active, cast_row);
}

// Steps 5-6 for DS_MLA_FP8 (SPEC §2.1): the 656-byte record of ds_mla.cu.
__device__ __forceinline__ void QuantizeDsMla(const PoolLayout& layout,
                                              const FastDiv& div,
                                              uint8_t* layer, const float* y,
                                              int32_t slot, int lane,
                                              uint16_t* cast_row) {
  float x[16];
  uint32_t bf[8];
  RoundBf16<16>(y, 16 * lane, x, bf);
  float xt[8];
  uint32_t tail[4] = {0, 0, 0, 0};
  if (lane < 8) RoundBf16<8>(y, 512 + 8 * lane, xt, tail);
  uint32_t sb;
  const uint4 q = DsMlaEncode16<true>(x, &sb);
  const uint4 t4 = make_uint4(tail[0], tail[1], tail[2], tail[3]);
  DsMlaPutRecord(layer, layout.block_stride, div, slot, q, sb, t4, lane);
  if (cast_row != nullptr) DsMlaPutCastBack(cast_row, q, sb, t4, lane);
}

// Steps 5-6 for BF16(N): the rounded values are the record and the load.
__device__ __forceinline__ void StoreBf16Row(const PoolLayout& layout,
                                             const FastDiv& div, uint8_t* layer,
                                             const float* y, int32_t d,
                                             int32_t slot, int lane,
                                             uint16_t* cast_row) {
  uint8_t* row = nullptr;
  if (slot >= 0) {
    const int32_t block = div.Div(slot);
    row = layer + layout.data_offset(block, slot - block * div.d);
  }
  for (int c = lane; c < d / 8; c += kWarp) {
    float x[8];
    uint32_t w[4];
    RoundBf16<8>(y, 8 * c, x, w);
    const uint4 v = make_uint4(w[0], w[1], w[2], w[3]);
    if (row != nullptr) StoreStream16(row + 16 * c, v);
    if (cast_row != nullptr) Store16(cast_row + 8 * c, v);
  }
}

// Steps 1-6 of one token whose input is `in`, through the warp's buffer y.
template <FormatId kId, int kHad, int kChunks>
__device__ __forceinline__ void ProcessToken(const PoolLayout& layout,
                                             const FastDiv& div, uint8_t* layer,
                                             const FusedParams& p,
                                             const TokenIn<kChunks>& in,
                                             const uint4 (&weights)[kChunks],
                                             int32_t d, int lane, float* y,
                                             uint16_t* cast_row) {
  NormToShared<kChunks>(in, d, p, weights, lane, y);
  if (p.rope != RopeStyle::kNone) {
    Rope(p, in.pos, in.cos0, in.sin0, lane, y);
  }
  if constexpr (kHad > 0) HadamardTwoPass<kHad>(p.hadamard_begin, lane, y);
  if constexpr (kId == FormatId::kDsMlaFp8) {
    QuantizeDsMla(layout, div, layer, y, in.slot, lane, cast_row);
  } else if constexpr (kId == FormatId::kBf16) {
    StoreBf16Row(layout, div, layer, y, d, in.slot, lane, cast_row);
  } else {
    using Q = typename FusedTraits<kId>::Q;
    QuantizeLane<Q>(layout, div, layer, y, in.slot, lane,
                    lane < Q::kLanesPerToken, cast_row);
  }
}

// The general kernel: tokens t + W and t + 2 W (W = the grid's warps) in
// flight while t is processed, their first cos/sin pair with them; the norm
// weights loaded once. At least kMinCtas CTAs per SM (registers <= 128;
// BF16(N), with its run-time width, spills 40-44 bytes there, but three
// CTAs per SM without spills measured 37 / 39 % of copy against 41 / 44 %
// for norm+rope on the H200).
constexpr int kMinCtas = 4;

template <FormatId kId, int kHad>
__global__ void __launch_bounds__(kThreads, kMinCtas)
    FusedStoreKernelCurrent(PoolLayout layout, FastDiv div, uint8_t* layer,
                            const uint16_t* kv, FusedParams p,
                            const int32_t* slots, int64_t n,
                            uint16_t* cast_back) {
  constexpr int kChunks = MaxChunks<kId>();
  __shared__ __align__(16) float tokens[kWarpsPerCta][MaxElems<kId>()];
  PdlWait();
  PdlLaunchDependents();
  const int32_t d = FusedTraits<kId>::kD > 0 ? FusedTraits<kId>::kD
                                             : layout.format.elements();
  const int lane = threadIdx.x % kWarp;
  float* y = tokens[threadIdx.x / kWarp];
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  int64_t token =
      static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarp;
  if (token >= n) return;  // warp-uniform
  TokenIn<kChunks> cur, next;
  LoadToken<kChunks>(kv, token, d, slots, p, lane, cur);
  if (token + warps < n) {
    LoadToken<kChunks>(kv, token + warps, d, slots, p, lane, next);
  }
  uint4 weights[kChunks];
  LoadWeights(p, lane, weights);
  for (; token < n; token += warps) {
    TokenIn<kChunks> after;
    if (token + 2 * warps < n) {
      LoadToken<kChunks>(kv, token + 2 * warps, d, slots, p, lane, after);
    }
    uint16_t* cast_row = cast_back == nullptr ? nullptr : cast_back + token * d;
    ProcessToken<kId, kHad>(layout, div, layer, p, cur, weights, d, lane, y,
                            cast_row);
    cur = next;
    next = after;
  }
}

// The kernel for the 128-element index formats: four tokens per
// warp iteration (1 KB of input, contiguous). Loads: lane l holds chunk
// l mod 16 of tokens l / 16 and 2 + l / 16. Token q's fp32 buffer is
// y + kQuadStride q (swizzled within the token; the 8-float pad puts the
// tokens' equal offsets on different banks). Hadamard and quantize: lanes
// 8q ... 8q + 7 work on token q.
constexpr int kQuadD = 128;
constexpr int kQuadStride = kQuadD + 8;

struct QuadIn {
  uint4 v[2];
  int32_t slot = -1;  // of token lane / 8
  int64_t pos = 0;    // of token lane / 8
};

__device__ __forceinline__ void LoadQuad(const uint16_t* kv, int64_t base,
                                         int64_t n, const int32_t* slots,
                                         const FusedParams& p, int lane,
                                         QuadIn& in) {
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int64_t t = base + 2 * k + lane / 16;
    in.v[k] = t < n ? LoadStream16(kv + t * kQuadD + 8 * (lane % 16))
                    : make_uint4(0, 0, 0, 0);
  }
  const int64_t t = base + lane / 8;
  in.slot = t < n ? __ldg(slots + t) : -1;
  in.pos = p.rope != RopeStyle::kNone && t < n ? __ldg(p.positions + t) : 0;
}

// Step 3 for four tokens, lanes 8q + m on token q: pass A, lane holds
// begin + [m kPer, m kPer + kPer), stages h < kPer in registers; pass B,
// register i holds begin + m + 8 i, stages h = kPer ... L / 2 in registers
// (register distance h / 8). No shuffles.
template <int kLen>
__device__ __forceinline__ void HadamardQuad(int32_t begin, int lane,
                                             float* y) {
  constexpr int kPer = kLen / 8;
  static_assert(kPer >= 8 && kLen <= kQuadD);
  float* t = y + kQuadStride * (lane / 8);
  const int m = lane % 8;
  float v[kPer];
  const int a0 = begin + kPer * m;
  const bool vec = (begin & 3) == 0;
  if (vec) {
#pragma unroll
    for (int q = 0; q < kPer / 4; ++q) {
      const float4 f = *reinterpret_cast<const float4*>(t + Swz(a0 + 4 * q));
      v[4 * q] = f.x;
      v[4 * q + 1] = f.y;
      v[4 * q + 2] = f.z;
      v[4 * q + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kPer; ++i) v[i] = t[Swz(a0 + i)];
  }
  RegisterButterflies<1, kPer>(v);
  if (vec) {
#pragma unroll
    for (int q = 0; q < kPer / 4; ++q) {
      *reinterpret_cast<float4*>(t + Swz(a0 + 4 * q)) =
          make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kPer; ++i) t[Swz(a0 + i)] = v[i];
  }
  __syncwarp();
  const int b0 = begin + m;
#pragma unroll
  for (int i = 0; i < kPer; ++i) v[i] = t[Swz(b0 + 8 * i)];
  RegisterButterflies<kPer / 8, kPer>(v);  // h = 8 s
  const float scale = BitsToFloat(kHadamardScaleBits[Log2(kLen)]);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    t[Swz(b0 + 8 * i)] = __fmul_rn(v[i], scale);
  }
  __syncwarp();
}

// Step 3 for four tokens when the Hadamard covers the whole 128-element
// token (kLen = 128 forces begin = 0), lanes 8q + m on token q, ending in
// registers: v[i] = element 16 m + i, the layout QuantizeLaneValues takes.
// Stages h = 1 ... 8 in registers, then h = 16, 32, 64 by xor shuffles with
// lane m ^ (h / 16) (the lower element takes a + b, the upper a - b, as the
// reference pairs them), then the scale; no second pass through y.
__device__ __forceinline__ void HadamardQuad128(int lane, const float* y,
                                                float (&v)[16]) {
  const float* t = y + kQuadStride * (lane / 8);
  const int m = lane % 8;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float4 f = *reinterpret_cast<const float4*>(t + Swz(16 * m + 4 * q));
    v[4 * q] = f.x;
    v[4 * q + 1] = f.y;
    v[4 * q + 2] = f.z;
    v[4 * q + 3] = f.w;
  }
  RegisterButterflies<1, 16>(v);
#pragma unroll
  for (int mm = 1; mm < 8; mm *= 2) {
    // The upper lane's a - b as o + (-v): IEEE defines a - b as a + (-b),
    // so the bits are the same for every number (a NaN stays a NaN, and
    // the quantization maps every NaN alike). Computed as one fma(v, ±1,
    // o): v × ±1 is exact, so it rounds o ± v once, the add's bits
    // (zeros' signs included); one instruction where a sign-bit xor and
    // an add were two.
    const float sign = (m & mm) != 0 ? -1.0f : 1.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float o = __shfl_xor_sync(kFullMask, v[i], mm);
      v[i] = __fmaf_rn(v[i], sign, o);
    }
  }
  const float scale = BitsToFloat(kHadamardScaleBits[Log2(128)]);
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(v[i], scale);
}

// 16 values that are only quantized afterwards, rounded to BF16 by the
// hardware (RNE, as FloatToBf16 for every number), back as floats: a NaN
// stays a NaN (the quantization ignores it in amax and encodes every NaN
// alike, so its payload is never stored).
__device__ __forceinline__ void RoundBf16Hw16(const float (&v)[16],
                                              float (&x)[16]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t w = HwBf16x2(v[2 * i], v[2 * i + 1]);
    x[2 * i] = BitsToFloat(w << 16);
    x[2 * i + 1] = BitsToFloat(w & 0xFFFF0000u);
  }
}

// Steps 1-6 of tokens base ... base + 3 (those < n).
template <FormatId kId, int kHad>
__device__ __forceinline__ void ProcessQuad(const PoolLayout& layout,
                                            const FastDiv& div, uint8_t* layer,
                                            const FusedParams& p,
                                            const QuadIn& in, uint4 weight,
                                            int64_t base, int64_t n, int lane,
                                            float* y, uint16_t* cast_back) {
  static_assert(FusedTraits<kId>::kD == kQuadD);
  const int c = lane % 16;  // the lane's chunk of tokens k * 2 + lane / 16
  float x[2][8];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint32_t w[4] = {in.v[k].x, in.v[k].y, in.v[k].z, in.v[k].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[k][2 * i] = BitsToFloat(w[i] << 16);
      x[k][2 * i + 1] = BitsToFloat(w[i] & 0xFFFF0000u);
    }
  }
  if (p.norm()) {
    const int c0 = p.norm_begin / 8, c1 = p.norm_end / 8;
    const bool in_range = c >= c0 && c < c1;
    const uint32_t w[4] = {weight.x, weight.y, weight.z, weight.w};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      // SPEC 8's tree on a 128-element token: slot j < 16 is chunk j,
      // slots 16-31 are 0, so step h = 16 is slot + 0 and steps 8 ... 1
      // stay inside each half-warp (one token each).
      float slot = 0.0f;
      if (in_range) slot = __fadd_rn(slot, SumSquares8(x[k]));
      slot = __fadd_rn(slot, 0.0f);
#pragma unroll
      for (int h = 8; h >= 1; h /= 2) {
        slot = __fadd_rn(slot, __shfl_xor_sync(kFullMask, slot, h));
      }
      const float sum = __shfl_sync(kFullMask, slot, lane & 16);
      const float mean =
          __fdiv_rn(sum, static_cast<float>(p.norm_end - p.norm_begin));
      const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, p.eps)));
      if (in_range) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          x[k][2 * i] =
              __fmul_rn(__fmul_rn(x[k][2 * i], r), BitsToFloat(w[i] << 16));
          x[k][2 * i + 1] = __fmul_rn(__fmul_rn(x[k][2 * i + 1], r),
                                      BitsToFloat(w[i] & 0xFFFF0000u));
        }
      }
    }
  }
  __syncwarp();  // the previous tokens' readers are done with y
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    float* t = y + kQuadStride * (2 * k + lane / 16);
    *reinterpret_cast<float4*>(t + Swz(8 * c)) =
        make_float4(x[k][0], x[k][1], x[k][2], x[k][3]);
    *reinterpret_cast<float4*>(t + Swz(8 * c + 4)) =
        make_float4(x[k][4], x[k][5], x[k][6], x[k][7]);
  }
  __syncwarp();
  if (p.rope != RopeStyle::kNone) {
    const int half = p.rope_dim / 2;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      if (base + q >= n) break;  // warp-uniform
      const int64_t pos = __shfl_sync(kFullMask, in.pos, 8 * q);
      const float* cs = p.cos_sin + pos * p.rope_dim;
      const float c0 = lane < half ? __ldg(cs + lane) : 0.0f;
      const float s0 = lane < half ? __ldg(cs + half + lane) : 0.0f;
      Rope(p, pos, c0, s0, lane, y + kQuadStride * q);
    }
  }
  const int64_t t = base + lane / 8;
  const bool active = t < n;
  uint16_t* cast_row =
      cast_back != nullptr && active ? cast_back + t * kQuadD : nullptr;
  using Q = typename FusedTraits<kId>::Q;
  if constexpr (kHad == kQuadD) {  // the whole token: stays in registers
    float v[16], x[16];
    HadamardQuad128(lane, y, v);
    RoundBf16Hw16(v, x);
    QuantizeLaneValues<Q>(layout, div, layer, x, in.slot, lane, active,
                          cast_row);
  } else {
    if constexpr (kHad > 0) HadamardQuad<kHad>(p.hadamard_begin, lane, y);
    QuantizeLane<Q>(layout, div, layer, y + kQuadStride * (lane / 8), in.slot,
                    lane, active, cast_row);
  }
}

// Seven CTAs per SM (registers <= 72, no spills) with one quad in flight
// ahead, where kMinCtas and two ahead left five (90 registers): on the
// H200, hadamard (MXFP8_INDEX, L = 128) 43.0 -> 44.5 % of copy at 64K
// tokens, 55.0 -> 56.7 % at 1M, graph replay at 1-1024 tokens within
// 0.02 us (docs/BENCHMARKS.md, 2026-12-03). Eight CTAs (64 registers)
// measured the same as seven; eight with two ahead spills and was slower.
constexpr int kQuadMinCtas = 7;

template <FormatId kId, int kHad>
__global__ void __launch_bounds__(kThreads, kQuadMinCtas)
    FusedStoreKernelQuad(PoolLayout layout, FastDiv div, uint8_t* layer,
                         const uint16_t* kv, FusedParams p,
                         const int32_t* slots, int64_t n, uint16_t* cast_back) {
  __shared__ __align__(16) float tokens[kWarpsPerCta][4 * kQuadStride];
  PdlWait();
  PdlLaunchDependents();
  const int lane = threadIdx.x % kWarp;
  float* y = tokens[threadIdx.x / kWarp];
  const int64_t step = 4 * static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  int64_t base = 4 * (static_cast<int64_t>(blockIdx.x) * kWarpsPerCta +
                      threadIdx.x / kWarp);
  if (base >= n) return;  // warp-uniform
  QuadIn cur, next;
  LoadQuad(kv, base, n, slots, p, lane, cur);
  const int c = lane % 16;
  const uint4 weight = p.norm() && c >= p.norm_begin / 8 && c < p.norm_end / 8
                           ? __ldg(reinterpret_cast<const uint4*>(
                                 p.norm_weight + (8 * c - p.norm_begin)))
                           : make_uint4(0, 0, 0, 0);
  for (; base < n; base += step) {
    if (base + step < n) LoadQuad(kv, base + step, n, slots, p, lane, next);
    ProcessQuad<kId, kHad>(layout, div, layer, p, cur, weight, base, n, lane, y,
                           cast_back);
    cur = next;
  }
}

template <FormatId kId, int kHad>
cudaError_t Go(const PoolLayout& layout, uint8_t* layer, const uint16_t* kv,
               const FusedParams& p, const int32_t* slots, int64_t n,
               uint16_t* cast_back, const Launch& launch) {
  const FastDiv div = FastDiv::Of(static_cast<int32_t>(layout.block_size));
  if constexpr (FusedTraits<kId>::kD == kQuadD) {
    constexpr auto kKernel = FusedStoreKernelQuad<kId, kHad>;
    const dim3 grid(
        PersistentGrid(n, 4 * kWarpsPerCta, ResidentCtas<kKernel, kThreads>()));
    return LaunchKernel(kKernel, grid, dim3(kThreads), launch, layout, div,
                        layer, kv, p, slots, n, cast_back);
  } else {
    constexpr auto kKernel = FusedStoreKernelCurrent<kId, kHad>;
    const dim3 grid(
        PersistentGrid(n, kWarpsPerCta, ResidentCtas<kKernel, kThreads>()));
    return LaunchKernel(kKernel, grid, dim3(kThreads), launch, layout, div,
                        layer, kv, p, slots, n, cast_back);
  }
}

template <FormatId kId>
cudaError_t ByHadamard(const PoolLayout& layout, uint8_t* layer,
                       const uint16_t* kv, const FusedParams& p,
                       const int32_t* slots, int64_t n, uint16_t* cast_back,
                       const Launch& launch) {
  switch (p.hadamard_len) {
    case 0:
      return Go<kId, 0>(layout, layer, kv, p, slots, n, cast_back, launch);
    case 64:
      return Go<kId, 64>(layout, layer, kv, p, slots, n, cast_back, launch);
    case 128:
      return Go<kId, 128>(layout, layer, kv, p, slots, n, cast_back, launch);
    case 256:
      if constexpr (MaxElems<kId>() >= 256) {
        return Go<kId, 256>(layout, layer, kv, p, slots, n, cast_back, launch);
      }
      break;
    case 512:
      if constexpr (MaxElems<kId>() >= 512) {
        return Go<kId, 512>(layout, layer, kv, p, slots, n, cast_back, launch);
      }
      break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchFusedStore(FormatId id, const PoolLayout& layout,
                             uint8_t* layer, const uint16_t* kv,
                             const FusedParams& p, const int32_t* slots,
                             int64_t n, uint16_t* cast_back,
                             const Launch& launch) {
  // The register-only kernel, fused_h512.cu.
  if (FusedH512Applies(id, layout.format.elements(), p)) {
    return LaunchFusedH512(id, layout, layer, kv, p, slots, n, cast_back,
                           launch);
  }
  // One or two lanes per token, fused_row.cu.
  if (FusedRowApplies(id, p, n)) {
    return LaunchFusedRow(id, layout, layer, kv, p, slots, n, cast_back,
                          launch);
  }
  switch (id) {
    case FormatId::kV41:
      return ByHadamard<FormatId::kV41>(layout, layer, kv, p, slots, n,
                                        cast_back, launch);
    case FormatId::kV41Fp4:
      return ByHadamard<FormatId::kV41Fp4>(layout, layer, kv, p, slots, n,
                                           cast_back, launch);
    case FormatId::kFp4Index:
      return ByHadamard<FormatId::kFp4Index>(layout, layer, kv, p, slots, n,
                                             cast_back, launch);
    case FormatId::kFp8Fp32SfIndex:
      return ByHadamard<FormatId::kFp8Fp32SfIndex>(layout, layer, kv, p, slots,
                                                   n, cast_back, launch);
    case FormatId::kMxfp8Index:
      return ByHadamard<FormatId::kMxfp8Index>(layout, layer, kv, p, slots, n,
                                               cast_back, launch);
    case FormatId::kBf16:
      return ByHadamard<FormatId::kBf16>(layout, layer, kv, p, slots, n,
                                         cast_back, launch);
    case FormatId::kDsMlaFp8:
      if (FusedMlaApplies(p)) {  // the register-only kernel, fused_mla.cu
        return LaunchFusedMla(layout, layer, kv, p, slots, n, cast_back,
                              launch);
      }
      return ByHadamard<FormatId::kDsMlaFp8>(layout, layer, kv, p, slots, n,
                                             cast_back, launch);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kvdepot::gpu::internal
