// The fused store (SPEC §8) for the 512-element formats (V41, V41_FP4,
// BF16(512)) when the Hadamard covers the whole token, [0, 512), or is off:
// registers only, no second pass. One warp per token; lane l holds chunks l
// and 32 + l, i.e. elements e = 256 j + 8 l + i (j = 0, 1; i = 0 ... 7),
// the layout the loads, the norm tree and the stores take (up to one wave
// of tokens, two warps per token instead, one chunk set each: see "Two
// warps per token" below):
//
//   norm:     SPEC §8's slot l is lane l's two chunks, so the xor steps
//             16 ... 1 give every lane the reference's sum (fused_mla.cu
//             says why); any chunk range [8 c0, 8 c1).
//   RoPE:     a range in the second half (rope_offset >= 256) starting on a
//             chunk (rope_dim a multiple of 8; of 16 for NeoX), held by
//             rope_dim / 8 lanes (8 for DeepSeek's 64). Without the
//             Hadamard, those lanes rotate it in registers: interleaved
//             pairs (2k, 2k + 1) lie in one lane; NeoX pairs
//             (k, k + rope_dim / 2) lie rope_dim / 16 lanes apart (one
//             shuffle per value). With it (kSpreadRope) they put it in the
//             warp's slice of shared memory, where lane k rotates pairs
//             k, k + 32, ...: the work spread over the whole warp, one
//             cos/sin pair per lane loaded with the row.
//   Hadamard: stages h = 1, 2, 4 inside each chunk (element bits 0-2),
//             h = 8 ... 128 across lanes (lane bit log2(h / 8), xor
//             shuffles), h = 256 between the lane's two chunks, in that
//             order (the reference's), then the fp32 constant. Across
//             lanes the lower element takes a + b and the upper a - b,
//             computed as one fma(v, ±1, o): v × ±1 is exact, so the fma
//             rounds o + v or o + (-v) once, and IEEE defines a - b as
//             a + (-b): the bits are the add's and the subtract's for every
//             number (zeros' signs included), and a NaN is a NaN either way
//             (step 4 makes it canonical, and no NaN payload is stored).
//   quantize: a group of G elements is G / 8 neighbouring lanes of one half
//             (amax by xor shuffles); each lane encodes its 8 values and
//             stores 8 (e4m3) or 4 (e2m1) bytes; lanes 0 ... words - 1
//             gather the scale bytes into 4-byte words. BF16(512): each
//             lane stores its two chunks' BF16 (16 bytes each), NaN
//             canonical as FloatToBf16 gives.
//
// The math is QuantizeLaneValues's (fused.cu, device_quant.cuh) on 8 values
// instead of 16, and every product and sum is a round-to-nearest intrinsic
// (no FMA contraction; -fmad=false too), so the bytes are the reference's
// (kernels/reference/fused.cc): fused_cuda_test compares every bit.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/device_quant.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/fused_internal.h"
#include "kernels/format.h"
#include "kernels/fused.h"
#include "kernels/named_formats.h"
#include "kernels/quant.h"

namespace kvdepot::gpu::internal {
namespace {

constexpr int kThreads = 128;
constexpr int kWarpsPerCta = kThreads / kWarp;
constexpr int kD = 512;
constexpr int kHalf = kD / 2;  // elements per chunk set j
// One token per warp in flight and 8 CTAs (32 warps) per SM at <= 64
// registers, as fused_mla.cu: the math needs warps to hide its latency.
constexpr int kMinCtas = 8;

// The output tag of BF16(512) records (the quantized formats pass their
// quant.h format class).
struct Bf16Record {};

// BF16(512) without the Hadamard: the one-warp kernel loads a token's row
// before it processes the one before (two tokens' inputs in registers, 5
// CTAs per SM at <= 102 registers), which took norm + rope from 85.0 to
// 87.1 % of copy at 64K tokens and 91.3 to 92.8 % at 1M on an H100
// (docs/BENCHMARKS.md, 2026-12-06). The same with the quantized formats'
// Hadamard (all stages) lost 0.4-1.6 points there: those kernels are bound
// by their instructions, and keep one token and 8 CTAs.
template <class Q, bool kHad>
constexpr bool kLoadAhead = std::is_same_v<Q, Bf16Record> && !kHad;
constexpr int kLoadAheadMinCtas = 5;

// The RoPE spread over the warp (shared memory) with the Hadamard, in
// registers on the RoPE lanes without it. The spread one issues fewer
// instructions (no shuffles; one pair per lane instead of 4-8 on a quarter
// of the lanes) but adds two shared-memory round trips to a token's chain.
// On an H100 (2026-12-08, docs/BENCHMARKS.md) it took all stages, which is
// bound by its instruction issue, from 62.9 to 65.8-65.9 % of copy at 64K
// tokens and from 67.2-67.3 to 70.2 % at 1M; on 70 % of the SMs (MPS: about
// an H200's bandwidth per SM) from 45.8-45.9 to 47.9 % and 48.0-48.1 to
// 50.1-50.2 %. The load-ahead BF16 kernel (norm + rope) spread measured
// the same on the whole H100 (86.7 against 87.0 % at 64K, at 7 CTAs per SM
// and 72 registers) but 77.8 against 82.2-82.3 % on 70 % of the SMs, where
// a token's latency counts.
template <bool kHad>
constexpr bool kSpreadRope = kHad;

// 8 BF16 (a uint4) -> 8 fp32.
__device__ __forceinline__ void Unpack8(uint4 v, float (&x)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = BitsToFloat(w[i] << 16);
    x[2 * i + 1] = BitsToFloat(w[i] & 0xFFFF0000u);
  }
}

__device__ __forceinline__ float SumSquares8(const float (&x)[8]) {
  float s = __fmul_rn(x[0], x[0]);
#pragma unroll
  for (int i = 1; i < 8; ++i) s = __fadd_rn(s, __fmul_rn(x[i], x[i]));
  return s;
}

// Where the RoPE range lies (host-computed per launch): lanes
// [first, first + lanes) hold its chunks of the second half; with
// kSpreadRope lanes [0, pairs) rotate its pairs.
struct RopeLanes {
  int32_t first = 0;  // (rope_offset - 256) / 8
  int32_t lanes = 0;  // rope_dim / 8
  int32_t pairs = 0;  // rope_dim / 2
};

// One token's input: its two chunks, slot and (RoPE) cos/sin.
struct In {
  uint4 a, b;
  // The cos/sin of the lane's pairs (kSpreadRope: pair `lane` in c0.x and
  // s0.x, its row `pos` for pairs lane + 32, ... when rope_dim > 64).
  float4 c0, c1, s0, s1;
  int64_t pos;
  int32_t slot;
};

// The cos/sin of the lane's RoPE pairs (zeros on the other lanes).
template <RopeStyle kRope, bool kSpread>
__device__ __forceinline__ void LoadCosSin(int64_t pos, const FusedParams& p,
                                           RopeLanes r, int lane, In& in) {
  in.c0 = in.c1 = in.s0 = in.s1 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  in.pos = pos;
  if constexpr (kRope != RopeStyle::kNone && kSpread) {
    if (lane < r.pairs) {
      const float* cs = p.cos_sin + pos * (2 * r.pairs);
      in.c0.x = __ldg(cs + lane);
      in.s0.x = __ldg(cs + r.pairs + lane);
    }
  } else if constexpr (kRope != RopeStyle::kNone) {
    const int m = lane - r.first;  // the lane's chunk within the range
    if (m >= 0 && m < r.lanes) {
      const int half = r.pairs;
      const float* cs = p.cos_sin + pos * (2 * half);
      if constexpr (kRope == RopeStyle::kInterleaved) {
        // Pairs (2k, 2k + 1), k in [4m, 4m + 4).
        in.c0 = __ldg(reinterpret_cast<const float4*>(cs + 4 * m));
        in.s0 = __ldg(reinterpret_cast<const float4*>(cs + half + 4 * m));
      } else {
        // Pairs (k, k + half), k in [8 m', 8 m' + 8), m' = m mod (half / 8)
        // (m < 2 (half / 8): a subtraction, not a division per token).
        const int apart = r.lanes / 2;
        const int k = 8 * (m >= apart ? m - apart : m);
        in.c0 = __ldg(reinterpret_cast<const float4*>(cs + k));
        in.c1 = __ldg(reinterpret_cast<const float4*>(cs + k + 4));
        in.s0 = __ldg(reinterpret_cast<const float4*>(cs + half + k));
        in.s1 = __ldg(reinterpret_cast<const float4*>(cs + half + k + 4));
      }
    }
  }
}

// Whether the lane reads the token's position.
template <RopeStyle kRope, bool kSpread>
__device__ __forceinline__ bool ReadsPosition(RopeLanes r, int lane) {
  if constexpr (kRope == RopeStyle::kNone) return false;
  if constexpr (kSpread) return lane < r.pairs;
  return lane - r.first >= 0 && lane - r.first < r.lanes;
}

template <RopeStyle kRope, bool kSpread>
__device__ __forceinline__ void LoadToken(const uint16_t* kv, int64_t token,
                                          int64_t pos, const int32_t* slots,
                                          const FusedParams& p, RopeLanes r,
                                          int lane, In& in) {
  const uint16_t* row = kv + token * kD;
  in.slot = __ldg(slots + token);
  in.a = LoadStream16(row + 8 * lane);
  in.b = LoadStream16(row + kHalf + 8 * lane);
  LoadCosSin<kRope, kSpread>(pos, p, r, lane, in);
}

// 1 / sqrt(mean + eps) of the sum over the range, from the lanes' slots
// (SPEC §8's tree: xor steps 16 ... 1).
__device__ __forceinline__ float InverseRms(const FusedParams& p, float slot) {
#pragma unroll
  for (int h = 16; h >= 1; h /= 2) {
    slot = __fadd_rn(slot, __shfl_xor_sync(kFullMask, slot, h));
  }
  // slot / count; by a power of two, the product with its exact reciprocal
  // is the same bits (scaling by 2^-k, no flush to zero here) without the
  // division's slow path.
  const int32_t count = p.norm_end - p.norm_begin;
  const float mean = (count & (count - 1)) == 0
                         ? __fmul_rn(slot, __frcp_rn(static_cast<float>(count)))
                         : __fdiv_rn(slot, static_cast<float>(count));
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, p.eps)));
}

// Step 1 on the lane's chunks l (x0) and 32 + l (x1), chunks [c0, c1).
__device__ __forceinline__ void Norm(const FusedParams& p, uint4 w0, uint4 w1,
                                     int lane, float (&x0)[8], float (&x1)[8]) {
  const int c0 = p.norm_begin / 8, c1 = p.norm_end / 8;
  const bool in0 = lane >= c0 && lane < c1;
  const bool in1 = lane + 32 >= c0 && lane + 32 < c1;
  float slot = 0.0f;
  if (in0) slot = __fadd_rn(slot, SumSquares8(x0));
  if (in1) slot = __fadd_rn(slot, SumSquares8(x1));
  const float r = InverseRms(p, slot);
  float w[8];
  if (in0) {
    Unpack8(w0, w);
#pragma unroll
    for (int i = 0; i < 8; ++i) x0[i] = __fmul_rn(__fmul_rn(x0[i], r), w[i]);
  }
  if (in1) {
    Unpack8(w1, w);
#pragma unroll
    for (int i = 0; i < 8; ++i) x1[i] = __fmul_rn(__fmul_rn(x1[i], r), w[i]);
  }
}

// Pair k of the range in buf (interleaved (2k, 2k + 1), NeoX
// (k, k + pairs)): a c - b s and b c + a s, the reference's operations.
template <RopeStyle kRope>
__device__ __forceinline__ void RotatePair(float* buf, int k, int pairs,
                                           float c, float s) {
  const int i = kRope == RopeStyle::kInterleaved ? 2 * k : k;
  const int j = kRope == RopeStyle::kInterleaved ? 2 * k + 1 : k + pairs;
  const float a = buf[i], b = buf[j];
  buf[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  buf[j] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

// Step 2 (kSpreadRope) on the second-half chunk x1 of the RoPE lanes,
// through the warp's buf (rope_dim floats; range element e at buf[e]).
// Every lane of the warp calls it. Each lane writes and reads back only
// its own chunk, so the two __syncwarp()s order every access: the next
// token's writes come after this token's rotations (second barrier), its
// rotations after this token's reads (the next call's first barrier).
template <RopeStyle kRope>
__device__ __forceinline__ void RopeSpread(const In& in, const FusedParams& p,
                                           RopeLanes r, int lane, float* buf,
                                           float (&x1)[8]) {
  if constexpr (kRope != RopeStyle::kNone) {
    const int m = lane - r.first;
    const bool mine = m >= 0 && m < r.lanes;
    float4* chunk = reinterpret_cast<float4*>(buf + 8 * (mine ? m : 0));
    if (mine) {
      chunk[0] = make_float4(x1[0], x1[1], x1[2], x1[3]);
      chunk[1] = make_float4(x1[4], x1[5], x1[6], x1[7]);
    }
    __syncwarp();
    if (lane < r.pairs) {
      RotatePair<kRope>(buf, lane, r.pairs, in.c0.x, in.s0.x);
    }
    // Wider than DeepSeek's 64: the further pairs' cos/sin loaded here.
    for (int k = lane + kWarp; k < r.pairs; k += kWarp) {
      const float* cs = p.cos_sin + in.pos * (2 * r.pairs);
      RotatePair<kRope>(buf, k, r.pairs, __ldg(cs + k),
                        __ldg(cs + r.pairs + k));
    }
    __syncwarp();
    if (mine) {
      const float4 u = chunk[0], v = chunk[1];
      x1[0] = u.x, x1[1] = u.y, x1[2] = u.z, x1[3] = u.w;
      x1[4] = v.x, x1[5] = v.y, x1[6] = v.z, x1[7] = v.w;
    }
  }
}

// Step 2 in registers on the second-half chunk x1 of the RoPE lanes.
template <RopeStyle kRope>
__device__ __forceinline__ void RopeInLanes(const In& in, RopeLanes r, int lane,
                                            float (&x1)[8]) {
  const int m = lane - r.first;
  const bool mine = m >= 0 && m < r.lanes;
  if constexpr (kRope == RopeStyle::kInterleaved) {
    if (!mine) return;
    const float c[4] = {in.c0.x, in.c0.y, in.c0.z, in.c0.w};
    const float s[4] = {in.s0.x, in.s0.y, in.s0.z, in.s0.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float a = x1[2 * i], b = x1[2 * i + 1];
      x1[2 * i] = __fsub_rn(__fmul_rn(a, c[i]), __fmul_rn(b, s[i]));
      x1[2 * i + 1] = __fadd_rn(__fmul_rn(b, c[i]), __fmul_rn(a, s[i]));
    }
  } else if constexpr (kRope == RopeStyle::kNeox) {
    // The first half's lanes hold a, the second's b, lanes / 2 apart, and
    // take a c - b s and b c + a s: both x c + o s' with the partner's o and
    // s' = -s on the first half. The bits are the reference's: o (-s) is
    // -(o s) exactly, and IEEE defines p - q as p + (-q). Every lane runs
    // the same instructions (no branch around the shuffles); the other lanes
    // keep x.
    const int apart = r.lanes / 2;
    const bool second = m >= apart;
    const int src = !mine ? lane : (second ? lane - apart : lane + apart);
    const float c[8] = {in.c0.x, in.c0.y, in.c0.z, in.c0.w,
                        in.c1.x, in.c1.y, in.c1.z, in.c1.w};
    const float s[8] = {in.s0.x, in.s0.y, in.s0.z, in.s0.w,
                        in.s1.x, in.s1.y, in.s1.z, in.s1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float o = __shfl_sync(kFullMask, x1[i], src);
      const float y = __fadd_rn(__fmul_rn(x1[i], c[i]),
                                __fmul_rn(o, second ? s[i] : -s[i]));
      x1[i] = mine ? y : x1[i];
    }
  }
}

// Step 2 either way (buf: the warp's shared range, kSpread only).
template <RopeStyle kRope, bool kSpread>
__device__ __forceinline__ void Rope(const In& in, const FusedParams& p,
                                     RopeLanes r, int lane, float* buf,
                                     float (&x1)[8]) {
  if constexpr (kSpread) {
    RopeSpread<kRope>(in, p, r, lane, buf, x1);
  } else {
    RopeInLanes<kRope>(in, r, lane, x1);
  }
}

// Stages h = 1, 2, 4 on one chunk: pairs (i, i + h) with bit h of i clear.
__device__ __forceinline__ void ChunkStages(float (&v)[8]) {
#pragma unroll
  for (int h = 1; h < 8; h *= 2) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int i = (q / h) * 2 * h + q % h;
      const float a = v[i], b = v[i + h];
      v[i] = __fadd_rn(a, b);
      v[i + h] = __fsub_rn(a, b);
    }
  }
}

// Stages h = 8 ... 128 on one chunk set: partner lane ^ m for h = 8 m.
__device__ __forceinline__ void CrossLaneStages(int lane, float (&v)[8]) {
#pragma unroll
  for (int m = 1; m < kWarp; m *= 2) {
    const float sign = (lane & m) != 0 ? -1.0f : 1.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float o = __shfl_xor_sync(kFullMask, v[i], m);
      v[i] = __fmaf_rn(v[i], sign, o);  // o + v or o - v, exactly
    }
  }
}

// Step 3 over the whole token (SPEC §8's stage order).
__device__ __forceinline__ void Hadamard512(int lane, float (&x0)[8],
                                            float (&x1)[8]) {
  ChunkStages(x0);
  ChunkStages(x1);
  // CrossLaneStages on both sets, interleaved: twice the independent
  // shuffles in flight per stage (this kernel is bound by its issue rate).
#pragma unroll
  for (int m = 1; m < kWarp; m *= 2) {
    const float sign = (lane & m) != 0 ? -1.0f : 1.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float o0 = __shfl_xor_sync(kFullMask, x0[i], m);
      const float o1 = __shfl_xor_sync(kFullMask, x1[i], m);
      x0[i] = __fmaf_rn(x0[i], sign, o0);
      x1[i] = __fmaf_rn(x1[i], sign, o1);
    }
  }
  const float scale = BitsToFloat(kHadamardScaleBits[9]);  // 512^-1/2
#pragma unroll
  for (int i = 0; i < 8; ++i) {  // h = 256: chunk l with chunk 32 + l
    const float a = x0[i], b = x1[i];
    x0[i] = __fmul_rn(__fadd_rn(a, b), scale);
    x1[i] = __fmul_rn(__fsub_rn(a, b), scale);
  }
}

// Step 4: round to BF16 by the hardware (RNE like FloatToBf16 for every
// number); a NaN stays a NaN, and the quantization maps every NaN alike.
__device__ __forceinline__ void RoundBf16(float (&x)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t w = HwBf16x2(x[2 * i], x[2 * i + 1]);
    x[2 * i] = BitsToFloat(w << 16);
    x[2 * i + 1] = BitsToFloat(w & 0xFFFF0000u);
  }
}

// The codes of 8 values x * mult: e4m3 in .x/.y (8 bytes), e2m1 in .x.
template <class Q>
__device__ __forceinline__ uint2 Encode8(const float (&x)[8], float mult) {
  if constexpr (Q::kDtype == QuantDtype::kE4M3) {
    uint32_t w[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t pair = E4M3x2<true>(x[2 * i] * mult, x[2 * i + 1] * mult);
      w[i / 2] |= pair << (16 * (i % 2));
    }
    return make_uint2(FixE4M3NaNs(w[0]), FixE4M3NaNs(w[1]));
  } else {
    float p[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) p[i] = x[i] * mult;
    return make_uint2(E2M1x8(p), 0);
  }
}

// Steps 5-6 of the one-warp kernel: quantize the lane's two chunks, store
// codes and scales at `slot` (skipped for -1), and the cast-back row when
// asked. QuantizeHalf below does the same per chunk set for the two-warp
// kernel; here one shuffle per scale byte gathers both sets' bytes, which
// the issue-bound one-warp kernel needs (4 % of its bandwidth at 64K tokens
// on the H200 with two QuantizeHalf calls instead).
template <class Q>
__device__ __forceinline__ void Quantize(const PoolLayout& layout,
                                         const FastDiv& div, uint8_t* layer,
                                         const float (&x0)[8],
                                         const float (&x1)[8], int32_t slot,
                                         int lane, uint16_t* cast_row) {
  constexpr int kG = Q::kGroup / 8;           // lanes per group
  constexpr int kGroupsPerHalf = kWarp / kG;  // groups of one chunk set
  static_assert(Q::kElems == kD && (kG == 2 || kG == 4));
  float amax0 = 0.0f, amax1 = 0.0f;  // fmaxf ignores a NaN
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    amax0 = fmaxf(amax0, fabsf(x0[i]));
    amax1 = fmaxf(amax1, fabsf(x1[i]));
  }
#pragma unroll
  for (int off = 1; off < kG; off *= 2) {
    amax0 = fmaxf(amax0, __shfl_xor_sync(kFullMask, amax0, off));
    amax1 = fmaxf(amax1, __shfl_xor_sync(kFullMask, amax1, off));
  }
  const GroupScale s0 = ScaleOf<Q>(amax0), s1 = ScaleOf<Q>(amax1);
  const uint2 q0 = Encode8<Q>(x0, s0.multiplier);
  const uint2 q1 = Encode8<Q>(x1, s1.multiplier);
  // Scale word w (lanes w < kScaleWords): groups 4w ... 4w + 3, group g
  // from lane (g mod kGroupsPerHalf) kG, byte g / kGroupsPerHalf of its
  // packed pair (half 0 in bits 0-7, half 1 in bits 8-15).
  const uint32_t packed = (s0.stored & 0xFFu) | ((s1.stored & 0xFFu) << 8);
  uint32_t word = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int g = 4 * (lane % Q::kScaleWords) + i;
    const uint32_t pair =
        __shfl_sync(kFullMask, packed, (g % kGroupsPerHalf) * kG);
    word |= ((pair >> (8 * (g / kGroupsPerHalf))) & 0xFFu) << (8 * i);
  }
  if (slot >= 0) {
    const int32_t block = div.Div(slot);
    const int32_t t = slot - block * div.d;
    uint8_t* data = layer + DataOffset<Q>(layout, block, t);
    if constexpr (Q::kDtype == QuantDtype::kE4M3) {
      StoreStream8(data + 8 * lane, q0);
      StoreStream8(data + kHalf + 8 * lane, q1);
    } else {
      StoreStream4(data + 4 * lane, q0.x);
      StoreStream4(data + kHalf / 2 + 4 * lane, q1.x);
    }
    if (lane < Q::kScaleWords) {
      StoreStream4(layer + ScaleOffset<Q>(layout, block, t) + 4 * lane, word);
    }
  }
  if (cast_row == nullptr) return;
  Store16(cast_row + 8 * lane, DequantBf16x8<Q>(q0, ScaleValue<Q>(s0.stored)));
  Store16(cast_row + kHalf + 8 * lane,
          DequantBf16x8<Q>(q1, ScaleValue<Q>(s1.stored)));
}

// Steps 5-6 for chunk set `half` (the lane's chunk 32 half + l, x):
// quantize, store codes and that half's scale words at `slot` (skipped for
// -1), and its part of the cast-back row when asked. Every lane of the warp
// calls it.
template <class Q>
__device__ __forceinline__ void QuantizeHalf(const PoolLayout& layout,
                                             const FastDiv& div, uint8_t* layer,
                                             const float (&x)[8], int half,
                                             int32_t slot, int lane,
                                             uint16_t* cast_row) {
  constexpr int kG = Q::kGroup / 8;           // lanes per group
  constexpr int kGroupsPerHalf = kWarp / kG;  // groups of one chunk set
  constexpr int kWordsPerHalf = Q::kScaleWords / 2;
  // Scale word w holds groups 4w ... 4w + 3 (one byte each), so each half's
  // groups fill whole words: half h's are words [h W/2, (h + 1) W/2).
  static_assert(Q::kElems == kD && (kG == 2 || kG == 4) &&
                kGroupsPerHalf % 4 == 0 &&
                Q::kScaleWords == kGroupsPerHalf / 2);
  float amax = 0.0f;  // fmaxf ignores a NaN
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(x[i]));
#pragma unroll
  for (int off = 1; off < kG; off *= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
  }
  const GroupScale sc = ScaleOf<Q>(amax);
  const uint2 q = Encode8<Q>(x, sc.multiplier);
  // Lane l < W/2 gathers the half's word l: groups 4l ... 4l + 3, group g
  // from lane g kG (other lanes gather what they never store).
  uint32_t word = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int g = (4 * lane + i) % kGroupsPerHalf;
    word |= (__shfl_sync(kFullMask, sc.stored, g * kG) & 0xFFu) << (8 * i);
  }
  if (slot >= 0) {
    const int32_t block = div.Div(slot);
    const int32_t t = slot - block * div.d;
    uint8_t* data = layer + DataOffset<Q>(layout, block, t);
    if constexpr (Q::kDtype == QuantDtype::kE4M3) {
      StoreStream8(data + kHalf * half + 8 * lane, q);
    } else {
      StoreStream4(data + kHalf / 2 * half + 4 * lane, q.x);
    }
    if (lane < kWordsPerHalf) {
      StoreStream4(layer + ScaleOffset<Q>(layout, block, t) +
                       4 * (kWordsPerHalf * half + lane),
                   word);
    }
  }
  if (cast_row == nullptr) return;
  Store16(cast_row + kHalf * half + 8 * lane,
          DequantBf16x8<Q>(q, ScaleValue<Q>(sc.stored)));
}

// Steps 4-6 for BF16(512) on chunk set `half` (x): rounded to BF16 (NaN
// canonical), stored at `slot` (skipped for -1) and in the cast-back row.
__device__ __forceinline__ void StoreBf16Half(
    const PoolLayout& layout, const FastDiv& div, uint8_t* layer,
    const float (&x)[8], int half, int32_t slot, int lane, uint16_t* cast_row) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = HwBf16x2Canonical(x[2 * i], x[2 * i + 1]);
  const uint4 v = make_uint4(w[0], w[1], w[2], w[3]);
  if (slot >= 0) {
    const int32_t block = div.Div(slot);
    uint8_t* row = layer + layout.data_offset(block, slot - block * div.d);
    StoreStream16(row + 2 * kHalf * half + 16 * lane, v);
  }
  if (cast_row != nullptr) Store16(cast_row + kHalf * half + 8 * lane, v);
}

// StoreBf16Half for both chunk sets (the one-warp kernel), the row's
// address computed once.
__device__ __forceinline__ void StoreBf16(const PoolLayout& layout,
                                          const FastDiv& div, uint8_t* layer,
                                          const float (&x0)[8],
                                          const float (&x1)[8], int32_t slot,
                                          int lane, uint16_t* cast_row) {
  uint32_t w[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = HwBf16x2Canonical(x0[2 * i], x0[2 * i + 1]);
    w[4 + i] = HwBf16x2Canonical(x1[2 * i], x1[2 * i + 1]);
  }
  const uint4 a = make_uint4(w[0], w[1], w[2], w[3]);
  const uint4 b = make_uint4(w[4], w[5], w[6], w[7]);
  if (slot >= 0) {
    const int32_t block = div.Div(slot);
    uint8_t* row = layer + layout.data_offset(block, slot - block * div.d);
    StoreStream16(row + 16 * lane, a);
    StoreStream16(row + 2 * kHalf + 16 * lane, b);
  }
  if (cast_row == nullptr) return;
  Store16(cast_row + 8 * lane, a);
  Store16(cast_row + kHalf + 8 * lane, b);
}

// Steps 4-6 of chunk set `half` (x) in format Q (Bf16Record: BF16(512)).
template <class Q>
__device__ __forceinline__ void Finish(const PoolLayout& layout,
                                       const FastDiv& div, uint8_t* layer,
                                       float (&x)[8], int half, int32_t slot,
                                       int lane, uint16_t* cast_row) {
  if constexpr (std::is_same_v<Q, Bf16Record>) {
    StoreBf16Half(layout, div, layer, x, half, slot, lane, cast_row);
  } else {
    RoundBf16(x);
    QuantizeHalf<Q>(layout, div, layer, x, half, slot, lane, cast_row);
  }
}

template <class Q, bool kNorm, RopeStyle kRope, bool kHad>
__global__ void __launch_bounds__(kThreads, kLoadAhead<Q, kHad>
                                                ? kLoadAheadMinCtas
                                                : kMinCtas)
    FusedH512Kernel(PoolLayout layout, FastDiv div, uint8_t* layer,
                    const uint16_t* kv,  // [n][512] BF16
                    FusedParams p, RopeLanes rope,
                    const int32_t* slots,  // [n]; -1 = skip (cast_back kept)
                    int64_t n,
                    uint16_t* cast_back) {  // [n][512] BF16 or null
  constexpr bool kSpread = kSpreadRope<kHad>;
  constexpr bool kBuf = kSpread && kRope != RopeStyle::kNone;
  // Each warp's RoPE range (RopeSpread).
  __shared__ float rope_buf[kBuf ? kWarpsPerCta : 1][kBuf ? kHalf : 1];
  PdlWait();
  PdlLaunchDependents();
  const int lane = threadIdx.x % kWarp;
  const int64_t warp =
      static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  uint4 w0 = make_uint4(0, 0, 0, 0), w1 = w0;
  if constexpr (kNorm) {  // the weights of the lane's chunks in the range
    const int c0 = p.norm_begin / 8, c1 = p.norm_end / 8;
    if (lane >= c0 && lane < c1) {
      w0 = __ldg(reinterpret_cast<const uint4*>(p.norm_weight +
                                                (8 * lane - p.norm_begin)));
    }
    if (lane + 32 >= c0 && lane + 32 < c1) {
      w1 = __ldg(reinterpret_cast<const uint4*>(
          p.norm_weight + (kHalf + 8 * lane - p.norm_begin)));
    }
  }
  // A token's position is read one round before its row, so its cos/sin
  // loads go out with the row instead of after a dependent load; with
  // kLoadAhead the row itself one token ahead of its processing.
  if (warp >= n) return;  // warp-uniform
  constexpr bool kAhead = kLoadAhead<Q, kHad>;
  const bool rope_lane = ReadsPosition<kRope, kSpread>(rope, lane);
  const auto position = [&](int64_t token) -> int64_t {
    return rope_lane && token < n ? __ldg(p.positions + token) : 0;
  };
  int64_t pos = position(warp);
  In ahead;  // kAhead: the next token's row
  if constexpr (kAhead) {
    LoadToken<kRope, kSpread>(kv, warp, pos, slots, p, rope, lane, ahead);
    pos = position(warp + warps);
  }
  for (int64_t token = warp; token < n; token += warps) {
    const int64_t next = token + warps;
    In in;
    if constexpr (kAhead) {
      in = ahead;
      if (next < n)
        LoadToken<kRope, kSpread>(kv, next, pos, slots, p, rope, lane, ahead);
      pos = position(next + warps);
    } else {
      LoadToken<kRope, kSpread>(kv, token, pos, slots, p, rope, lane, in);
      pos = position(next);
    }
    float x0[8], x1[8];
    Unpack8(in.a, x0);
    Unpack8(in.b, x1);
    if constexpr (kNorm) Norm(p, w0, w1, lane, x0, x1);
    Rope<kRope, kSpread>(in, p, rope, lane, rope_buf[threadIdx.x / kWarp], x1);
    if constexpr (kHad) Hadamard512(lane, x0, x1);
    uint16_t* cast_row =
        cast_back == nullptr ? nullptr : cast_back + token * kD;
    if constexpr (std::is_same_v<Q, Bf16Record>) {
      StoreBf16(layout, div, layer, x0, x1, in.slot, lane, cast_row);
    } else {
      RoundBf16(x0);
      RoundBf16(x1);
      Quantize<Q>(layout, div, layer, x0, x1, in.slot, lane, cast_row);
    }
  }
}

// ---- Two warps per token (up to one wave of tokens: latency) ----
//
// With few tokens a token's time is one warp's dependent chain of
// instructions (a warp alone issues about one instruction per 1.2 ns on the
// H200: fused_benchmark's "4096 fmas" rows). Here warp 2 p + j of a CTA
// holds chunk set j of pair p's token (lane l: chunk 32 j + l, elements
// 256 j + 8 l + i), so each warp runs about half of it. The two places
// where the chunk sets meet go through shared memory behind a barrier of
// the pair's 64 threads, with the one-warp kernel's operands and order:
// the norm's slot l = (0 + S_l) + S_(32 + l), and the Hadamard's h = 256
// stage (chunk l with chunk 32 + l). Every other stage stays within a chunk
// set: RoPE (second set only), h <= 128, groups and their scale words
// (QuantizeHalf). One token per pair, no loop: launched only when every
// token has its pair resident.

constexpr int kPairsPerCta = kWarpsPerCta / 2;

struct PairShared {
  float sums[2][kWarp];       // [half][lane]: 0 + S_l, S_(32 + l)
  float values[2][8][kWarp];  // [half][i][lane]: before h = 256; values[1]
                              // holds the RoPE range before (RopeSpread)
};
static_assert(sizeof(PairShared::values[1]) == kHalf * sizeof(float));

__device__ __forceinline__ void PairBarrier(int pair) {
  asm volatile("bar.sync %0, %1;" ::"r"(1 + pair), "r"(2 * kWarp) : "memory");
}

// Step 1 on the half's chunk 32 half + l (x), chunks [c0, c1): the two
// terms of slot l from the two warps, then Norm's tree and scaling.
__device__ __forceinline__ void NormPair(const FusedParams& p, uint4 w,
                                         int half, int lane, PairShared& sh,
                                         int pair, float (&x)[8]) {
  const int c0 = p.norm_begin / 8, c1 = p.norm_end / 8;
  const bool in0 = lane >= c0 && lane < c1;
  const bool in1 = lane + 32 >= c0 && lane + 32 < c1;
  const bool mine = half == 0 ? in0 : in1;
  float part = 0.0f;
  if (mine) {
    part = half == 0 ? __fadd_rn(0.0f, SumSquares8(x)) : SumSquares8(x);
  }
  sh.sums[half][lane] = part;
  PairBarrier(pair);
  float slot = sh.sums[0][lane];
  if (in1) slot = __fadd_rn(slot, sh.sums[1][lane]);
  const float r = InverseRms(p, slot);
  if (!mine) return;
  float wv[8];
  Unpack8(w, wv);
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = __fmul_rn(__fmul_rn(x[i], r), wv[i]);
}

// Step 3 on the half's chunk: stages h <= 128 in the warp, then h = 256
// with the other warp's values (chunk l: a + b; chunk 32 + l: a - b).
__device__ __forceinline__ void HadamardPair(int half, int lane, PairShared& sh,
                                             int pair, float (&x)[8]) {
  ChunkStages(x);
  CrossLaneStages(lane, x);
#pragma unroll
  for (int i = 0; i < 8; ++i) sh.values[half][i][lane] = x[i];
  PairBarrier(pair);
  const float scale = BitsToFloat(kHadamardScaleBits[9]);  // 512^-1/2
  // Chunk l: x + o; chunk 32 + l: o - x; both one fma(x, +-1, o), exact as
  // in CrossLaneStages.
  const float sign = half == 0 ? 1.0f : -1.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float o = sh.values[1 - half][i][lane];
    x[i] = __fmul_rn(__fmaf_rn(x[i], sign, o), scale);
  }
}

template <class Q, bool kNorm, RopeStyle kRope, bool kHad>
__global__ void __launch_bounds__(kThreads, kMinCtas)
    FusedH512PairKernel(PoolLayout layout, FastDiv div, uint8_t* layer,
                        const uint16_t* kv,  // [n][512] BF16
                        FusedParams p, RopeLanes rope,
                        const int32_t* slots,  // [n]; -1 = skip
                        int64_t n,
                        uint16_t* cast_back) {  // [n][512] BF16 or null
  __shared__ PairShared shared[kPairsPerCta];
  PdlWait();
  PdlLaunchDependents();
  const int lane = threadIdx.x % kWarp;
  const int pair = threadIdx.x / (2 * kWarp);
  const int half = threadIdx.x / kWarp % 2;
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kPairsPerCta + pair;
  if (token >= n) return;  // both warps of the pair
  In in;
  in.slot = __ldg(slots + token);
  in.a = LoadStream16(kv + token * kD + kHalf * half + 8 * lane);
  in.b = make_uint4(0, 0, 0, 0);
  constexpr bool kSpread = kSpreadRope<kHad>;
  const bool rope_lane = half == 1 && ReadsPosition<kRope, kSpread>(rope, lane);
  LoadCosSin<kRope, kSpread>(rope_lane ? __ldg(p.positions + token) : 0, p,
                             half == 1 ? rope : RopeLanes{}, lane, in);
  uint4 w = make_uint4(0, 0, 0, 0);
  if constexpr (kNorm) {
    const int c = kWarp * half + lane;
    if (c >= p.norm_begin / 8 && c < p.norm_end / 8) {
      w = __ldg(reinterpret_cast<const uint4*>(p.norm_weight +
                                               (8 * c - p.norm_begin)));
    }
  }
  float x[8];
  Unpack8(in.a, x);
  if constexpr (kNorm) NormPair(p, w, half, lane, shared[pair], pair, x);
  if (half == 1) {  // warp-uniform; kSpread: the range in values[1], free
                    // till HadamardPair
    Rope<kRope, kSpread>(in, p, rope, lane, &shared[pair].values[1][0][0], x);
    // HadamardPair overwrites values[1] where other lanes read back.
    if (kRope != RopeStyle::kNone && kSpread) __syncwarp();
  }
  if constexpr (kHad) HadamardPair(half, lane, shared[pair], pair, x);
  uint16_t* cast_row = cast_back == nullptr ? nullptr : cast_back + token * kD;
  Finish<Q>(layout, div, layer, x, half, in.slot, lane, cast_row);
}

template <class Q, bool kNorm, RopeStyle kRope, bool kHad>
cudaError_t Go(const PoolLayout& layout, uint8_t* layer, const uint16_t* kv,
               const FusedParams& p, const int32_t* slots, int64_t n,
               uint16_t* cast_back, const Launch& launch) {
  constexpr auto kKernel = FusedH512Kernel<Q, kNorm, kRope, kHad>;
  constexpr auto kPairKernel = FusedH512PairKernel<Q, kNorm, kRope, kHad>;
  const FastDiv div = FastDiv::Of(static_cast<int32_t>(layout.block_size));
  RopeLanes rope;
  if (kRope != RopeStyle::kNone) {
    rope.first = (p.rope_offset - kHalf) / 8;
    rope.lanes = p.rope_dim / 8;
    rope.pairs = p.rope_dim / 2;
  }
  // Up to one wave of pairs, two warps per token (half the dependent
  // chain); beyond it one warp per token, which issues fewer instructions
  // in all (the pairs' exchanges) and keeps the next token's loads in
  // flight.
  const int pair_ctas = ResidentCtas<kPairKernel, kThreads>();
  if (n <= int64_t{pair_ctas} * kPairsPerCta) {
    const dim3 pair_grid(
        static_cast<unsigned>((n + kPairsPerCta - 1) / kPairsPerCta));
    return LaunchKernel(kPairKernel, pair_grid, dim3(kThreads), launch, layout,
                        div, layer, kv, p, rope, slots, n, cast_back);
  }
  const dim3 grid(
      PersistentGrid(n, kWarpsPerCta, ResidentCtas<kKernel, kThreads>()));
  return LaunchKernel(kKernel, grid, dim3(kThreads), launch, layout, div, layer,
                      kv, p, rope, slots, n, cast_back);
}

template <class Q, bool kNorm, bool kHad>
cudaError_t ByRope(const PoolLayout& layout, uint8_t* layer, const uint16_t* kv,
                   const FusedParams& p, const int32_t* slots, int64_t n,
                   uint16_t* cast_back, const Launch& launch) {
  switch (p.rope) {
    case RopeStyle::kNone:
      return Go<Q, kNorm, RopeStyle::kNone, kHad>(layout, layer, kv, p, slots,
                                                  n, cast_back, launch);
    case RopeStyle::kInterleaved:
      return Go<Q, kNorm, RopeStyle::kInterleaved, kHad>(
          layout, layer, kv, p, slots, n, cast_back, launch);
    case RopeStyle::kNeox:
      return Go<Q, kNorm, RopeStyle::kNeox, kHad>(layout, layer, kv, p, slots,
                                                  n, cast_back, launch);
  }
  return cudaErrorInvalidValue;
}

template <class Q, bool kHad>
cudaError_t ByNorm(const PoolLayout& layout, uint8_t* layer, const uint16_t* kv,
                   const FusedParams& p, const int32_t* slots, int64_t n,
                   uint16_t* cast_back, const Launch& launch) {
  return p.norm() ? ByRope<Q, true, kHad>(layout, layer, kv, p, slots, n,
                                          cast_back, launch)
                  : ByRope<Q, false, kHad>(layout, layer, kv, p, slots, n,
                                           cast_back, launch);
}

template <class Q>
cudaError_t ByHadamard(const PoolLayout& layout, uint8_t* layer,
                       const uint16_t* kv, const FusedParams& p,
                       const int32_t* slots, int64_t n, uint16_t* cast_back,
                       const Launch& launch) {
  return p.hadamard() ? ByNorm<Q, true>(layout, layer, kv, p, slots, n,
                                        cast_back, launch)
                      : ByNorm<Q, false>(layout, layer, kv, p, slots, n,
                                         cast_back, launch);
}

}  // namespace

bool FusedH512Applies(FormatId id, int32_t elements, const FusedParams& p) {
  if (id != FormatId::kV41 && id != FormatId::kV41Fp4 &&
      !(id == FormatId::kBf16 && elements == kD)) {
    return false;
  }
  if (p.hadamard() && (p.hadamard_len != kD || p.hadamard_begin != 0)) {
    return false;
  }
  switch (p.rope) {
    case RopeStyle::kNone:
      return true;
    case RopeStyle::kInterleaved:
      return p.rope_offset >= kHalf && p.rope_offset % 8 == 0 &&
             p.rope_dim % 8 == 0;
    case RopeStyle::kNeox:
      return p.rope_offset >= kHalf && p.rope_offset % 8 == 0 &&
             p.rope_dim % 16 == 0;
  }
  return false;
}

cudaError_t LaunchFusedH512(FormatId id, const PoolLayout& layout,
                            uint8_t* layer, const uint16_t* kv,
                            const FusedParams& p, const int32_t* slots,
                            int64_t n, uint16_t* cast_back,
                            const Launch& launch) {
  if (!FusedH512Applies(id, layout.format.elements(), p)) {
    return cudaErrorInvalidValue;
  }
  switch (id) {
    case FormatId::kV41:
      return ByHadamard<V41Format>(layout, layer, kv, p, slots, n, cast_back,
                                   launch);
    case FormatId::kV41Fp4:
      return ByHadamard<V41Fp4Format>(layout, layer, kv, p, slots, n, cast_back,
                                      launch);
    default:
      return ByHadamard<Bf16Record>(layout, layer, kv, p, slots, n, cast_back,
                                    launch);
  }
}

}  // namespace kvdepot::gpu::internal
