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
//               Hadamard butterflies cross lanes)
//   Hadamard L: lane l holds [begin + l L/32, +L/32): in-register stages
//               h < L/32, then xor shuffles for h = L/32 ... L/2
//   quantize:   lane l holds elements [16l, 16l + 16) as the store kernels
//               (index formats: lanes 0-7; DS_MLA_FP8 tail: lanes 0-7 with
//               8 elements each; BF16(N): 8 elements per chunk, lane-strided)
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

// One token's input as loaded (raw BF16), its slot and position.
template <int kChunks>
struct TokenIn {
  uint4 v[kChunks];
  int32_t slot = -1;
  int64_t pos = 0;
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
      const uint4 wv = __ldg(reinterpret_cast<const uint4*>(
          p.norm_weight + (8 * c - p.norm_begin)));
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
    float4* o = reinterpret_cast<float4*>(y + 8 * c);
    o[0] = make_float4(x[k][0], x[k][1], x[k][2], x[k][3]);
    o[1] = make_float4(x[k][4], x[k][5], x[k][6], x[k][7]);
  }
  __syncwarp();
}

// Step 2 on shared memory.
__device__ __forceinline__ void Rope(const FusedParams& p, int64_t pos,
                                     int lane, float* y) {
  const int half = p.rope_dim / 2;
  const bool neox = p.rope == RopeStyle::kNeox;
  const float* cs = p.cos_sin + pos * p.rope_dim;
  float* r = y + p.rope_offset;
  for (int k = lane; k < half; k += kWarp) {
    const int ia = neox ? k : 2 * k;
    const int ib = neox ? k + half : 2 * k + 1;
    const float a = r[ia], b = r[ib];
    const float c = __ldg(cs + k), s = __ldg(cs + half + k);
    r[ia] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    r[ib] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  }
  __syncwarp();
}

// Step 3 on shared memory: stages h = 1, 2, 4, ... in order.
template <int kLen>
__device__ __forceinline__ void Hadamard(int32_t begin, int lane, float* y) {
  constexpr int kPer = kLen / kWarp;  // contiguous elements per lane
  static_assert(kPer >= 2 && kLen % kWarp == 0);
  float* h = y + begin + lane * kPer;
  float v[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) v[i] = h[i];
#pragma unroll
  for (int s = 1; s < kPer; s *= 2) {
#pragma unroll
    for (int i = 0; i < kPer; i += 2 * s) {
#pragma unroll
      for (int j = i; j < i + s; ++j) {
        const float a = v[j], b = v[j + s];
        v[j] = __fadd_rn(a, b);
        v[j + s] = __fsub_rn(a, b);
      }
    }
  }
#pragma unroll
  for (int m = 1; m < kWarp; m *= 2) {  // h = kPer * m: partner lane ^ m
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const float o = __shfl_xor_sync(kFullMask, v[i], m);
      v[i] = upper ? __fsub_rn(o, v[i]) : __fadd_rn(v[i], o);
    }
  }
  const float scale = BitsToFloat(kHadamardScaleBits[Log2(kLen)]);
#pragma unroll
  for (int i = 0; i < kPer; ++i) h[i] = __fmul_rn(v[i], scale);
  __syncwarp();
}

// Step 4: 16 (or 8) values of shared memory rounded to BF16, as fp32 and as
// packed BF16 words.
template <int kN>
__device__ __forceinline__ void RoundBf16(const float* y, float (&x)[kN],
                                          uint32_t (&w)[kN / 2]) {
#pragma unroll
  for (int i = 0; i < kN / 4; ++i) {
    const float4 f = reinterpret_cast<const float4*>(y)[i];
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

template <class Q>
__device__ __forceinline__ float ScaleValue(uint32_t stored) {
  if constexpr (Q::kSf == ScaleFormat::kUE8M0) {
    return Ue8m0ToFloat(static_cast<uint8_t>(stored));
  } else if constexpr (Q::kSf == ScaleFormat::kE4M3) {
    return DecodeE4M3(static_cast<uint8_t>(stored));
  } else {
    return BitsToFloat(stored);
  }
}

// Steps 5-6 for the §3 formats: the store kernels' lane math (store.cu) on
// the rounded values, then the decode of the lane's codes.
template <class Q>
__device__ __forceinline__ void QuantizeLane(const PoolLayout& layout,
                                             const FastDiv& div, uint8_t* layer,
                                             const float* y, int32_t slot,
                                             int lane, uint16_t* cast_row) {
  constexpr int kLpt = Q::kLanesPerToken;
  static_assert(kLpt == kWarp || kLpt == 8);
  const bool active = lane < kLpt;  // lanes past the token compute nothing
  const int sub = lane % kLpt;
  float x[16];
  uint32_t bf[8];
  RoundBf16<16>(y + 16 * sub, x, bf);
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
  if (cast_row == nullptr) return;
  const float sc = ScaleValue<Q>(scale.stored);
  const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
  uint32_t out[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float v0, v1;
    if constexpr (Q::kDtype == QuantDtype::kE4M3) {
      const uint32_t pair = qw[i / 2] >> (16 * (i % 2));
      v0 = DecodeE4M3(static_cast<uint8_t>(pair & 0xFFu));
      v1 = DecodeE4M3(static_cast<uint8_t>((pair >> 8) & 0xFFu));
    } else {  // element 2i: low nibble of byte i
      const uint32_t byte = (qw[i / 4] >> (8 * (i % 4))) & 0xFFu;
      v0 = DecodeE2M1(static_cast<uint8_t>(byte & 0xFu));
      v1 = DecodeE2M1(static_cast<uint8_t>(byte >> 4));
    }
    out[i] = FloatToBf16(__fmul_rn(v0, sc)) |
             (static_cast<uint32_t>(FloatToBf16(__fmul_rn(v1, sc))) << 16);
  }
  StoreStream16(cast_row + 16 * sub,
                make_uint4(out[0], out[1], out[2], out[3]));
  StoreStream16(cast_row + 16 * sub + 8,
                make_uint4(out[4], out[5], out[6], out[7]));
}

// Steps 5-6 for DS_MLA_FP8 (SPEC §2.1): the 656-byte record of ds_mla.cu.
__device__ __forceinline__ void QuantizeDsMla(const PoolLayout& layout,
                                              const FastDiv& div,
                                              uint8_t* layer, const float* y,
                                              int32_t slot, int lane,
                                              uint16_t* cast_row) {
  float x[16];
  uint32_t bf[8];
  RoundBf16<16>(y + 16 * lane, x, bf);
  float xt[8];
  uint32_t tail[4] = {0, 0, 0, 0};
  if (lane < 8) RoundBf16<8>(y + 512 + 8 * lane, xt, tail);
  uint32_t sb;
  const uint4 q = DsMlaEncode16<true>(x, &sb);
  const uint32_t s0 = __shfl_sync(kFullMask, sb, 0);
  const uint32_t s1 = __shfl_sync(kFullMask, sb, 8);
  const uint32_t s2 = __shfl_sync(kFullMask, sb, 16);
  const uint32_t s3 = __shfl_sync(kFullMask, sb, 24);
  const uint4 t4 = make_uint4(tail[0], tail[1], tail[2], tail[3]);
  if (slot >= 0) {
    const int32_t block = div.Div(slot);
    uint8_t* rec = layer + block * layout.block_stride +
                   static_cast<int64_t>(slot - block * div.d) * kDsMlaRecord;
    StoreStream16(rec + 16 * lane, q);
    if (lane == 0) StoreStream16(rec + 512, make_uint4(s0, s1, s2, s3));
    if (lane < 8) StoreStream16(rec + kDsMlaTailOffset + 16 * lane, t4);
  }
  if (cast_row == nullptr) return;
  uint32_t w[8];
  DsMlaDecode16(q, sb, w);
  StoreStream16(cast_row + 16 * lane, make_uint4(w[0], w[1], w[2], w[3]));
  StoreStream16(cast_row + 16 * lane + 8, make_uint4(w[4], w[5], w[6], w[7]));
  if (lane < 8) StoreStream16(cast_row + 512 + 8 * lane, t4);
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
    RoundBf16<8>(y + 8 * c, x, w);
    const uint4 v = make_uint4(w[0], w[1], w[2], w[3]);
    if (row != nullptr) StoreStream16(row + 16 * c, v);
    if (cast_row != nullptr) StoreStream16(cast_row + 8 * c, v);
  }
}

template <FormatId kId, int kHad>
__global__ void __launch_bounds__(kThreads)
    FusedStoreKernel(PoolLayout layout, FastDiv div,  // by block_size
                     uint8_t* layer,
                     const uint16_t* kv,    // [n][D] BF16
                     FusedParams p,         // arrays in device memory
                     const int32_t* slots,  // [n]; -1 = skip (cast_back kept)
                     int64_t n,
                     uint16_t* cast_back) {  // [n][D] BF16 or null
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
  TokenIn<kChunks> cur;
  if (token < n) LoadToken(kv, token, d, slots, p, lane, cur);
  for (; token < n; token += warps) {
    TokenIn<kChunks> next;
    if (token + warps < n) {
      LoadToken(kv, token + warps, d, slots, p, lane, next);
    }
    NormToShared(cur, d, p, lane, y);
    if (p.rope != RopeStyle::kNone) Rope(p, cur.pos, lane, y);
    if constexpr (kHad > 0) Hadamard<kHad>(p.hadamard_begin, lane, y);
    uint16_t* cast_row = cast_back == nullptr ? nullptr : cast_back + token * d;
    if constexpr (kId == FormatId::kDsMlaFp8) {
      QuantizeDsMla(layout, div, layer, y, cur.slot, lane, cast_row);
    } else if constexpr (kId == FormatId::kBf16) {
      StoreBf16Row(layout, div, layer, y, d, cur.slot, lane, cast_row);
    } else {
      QuantizeLane<typename FusedTraits<kId>::Q>(layout, div, layer, y,
                                                 cur.slot, lane, cast_row);
    }
    cur = next;
  }
}

template <FormatId kId, int kHad>
cudaError_t Go(const PoolLayout& layout, uint8_t* layer, const uint16_t* kv,
               const FusedParams& p, const int32_t* slots, int64_t n,
               uint16_t* cast_back, const Launch& launch) {
  constexpr auto kKernel = FusedStoreKernel<kId, kHad>;
  const FastDiv div = FastDiv::Of(static_cast<int32_t>(layout.block_size));
  const dim3 grid(
      PersistentGrid(n, kWarpsPerCta, ResidentCtas<kKernel, kThreads>()));
  return LaunchKernel(kKernel, grid, dim3(kThreads), launch, layout, div, layer,
                      kv, p, slots, n, cast_back);
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
      return ByHadamard<FormatId::kDsMlaFp8>(layout, layer, kv, p, slots, n,
                                             cast_back, launch);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kvdepot::gpu::internal
