// Per-lane quantization of 16 consecutive elements, built on quant.h so the
// math is written once (NaNs are canonical there, so GPU arithmetic, which
// loses NaN signs and payloads, stays bit-exact with the x86 reference).
// For speed, e4m3 encoding may use Hopper's cvt.rn.satfinite.e4m3x2.f32 and
// e2m1 encoding rounds by fma onto three grids and takes the minimum
// (Hopper has no e2m1 cast); the test suite checks both against quant.h over
// all 2^32 fp32 inputs.
#ifndef KVDEPOT_KERNELS_CUDA_DEVICE_QUANT_CUH_
#define KVDEPOT_KERNELS_CUDA_DEVICE_QUANT_CUH_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_util.cuh"
#include "kernels/format.h"
#include "kernels/named_formats.h"
#include "kernels/quant.h"

namespace kvdepot::gpu::internal {

// Compile-time description of a quantized format, read from one of the
// named format constants (named_formats.h): QFormat<kFormatV41>. The
// KVCacheFormat itself is the template argument (a C++20 class-type
// non-type template parameter: a structural literal type whose accessors
// are KV_HD constexpr), so a format's fields are written once.
template <KVCacheFormat F>
struct QFormat {
  static_assert(F.quantized(), "QFormat is for the quantized formats");
  static constexpr bool kInterleaved = F.token_interleaved;  // [data|scales]
  static constexpr QuantDtype kDtype = F.quantized_dtype;
  static constexpr int kElems = F.quantized_elements;  // elements per token
  static constexpr int kGroup = F.elements_per_sf;     // elements per scale
  static constexpr ScaleFormat kSf = F.sf_format;
  static constexpr int kLanesPerToken = kElems / 16;  // 16 elements per lane
  static constexpr int kLanesPerGroup = kGroup / 16;
  static constexpr int kDataBytesPerLane = kDtype == QuantDtype::kE2M1 ? 8 : 16;
  static constexpr int kScaleBytes = F.sf_bytes();
  static constexpr int kScaleWords = kScaleBytes / 4;  // 4-byte scale words
  static constexpr int kDataBytes = F.quantized_bytes();
  static_assert(kElems % 16 == 0 && kGroup % 16 == 0 && kScaleBytes % 4 == 0);
};

// PoolLayout::data_offset / scale_offset with the format's sizes known at
// compile time (the layout's own accessors divide at run time).
template <class F>
__device__ __forceinline__ int64_t DataOffset(const PoolLayout& layout,
                                              int32_t block, int32_t t) {
  constexpr int kRow =
      F::kInterleaved ? F::kDataBytes + F::kScaleBytes : F::kDataBytes;
  return block * layout.block_stride + static_cast<int64_t>(t) * kRow;
}

template <class F>
__device__ __forceinline__ int64_t ScaleOffset(const PoolLayout& layout,
                                               int32_t block, int32_t t) {
  if constexpr (F::kInterleaved) {
    return DataOffset<F>(layout, block, t) + F::kDataBytes;
  } else {
    return block * layout.block_stride + layout.block_size * F::kDataBytes +
           static_cast<int64_t>(t) * F::kScaleBytes;
  }
}

using V41Format = QFormat<kFormatV41>;
using V41Fp4Format = QFormat<kFormatV41Fp4>;
using Fp4IndexFormat = QFormat<kFormatFp4Index>;
using Fp8Fp32SfFormat = QFormat<kFormatFp8Fp32SfIndex>;
using Mxfp8IndexFormat = QFormat<kFormatMxfp8Index>;

// The sizes the kernels were written for (data / scale bytes per token).
static_assert(V41Format::kDataBytes == 512 && V41Format::kScaleBytes == 16);
static_assert(V41Fp4Format::kDataBytes == 256 &&
              V41Fp4Format::kScaleBytes == 32);
static_assert(Fp4IndexFormat::kDataBytes == 64 &&
              Fp4IndexFormat::kScaleBytes == 4);
static_assert(Fp8Fp32SfFormat::kDataBytes == 128 &&
              Fp8Fp32SfFormat::kScaleBytes == 4);
static_assert(Mxfp8IndexFormat::kDataBytes == 128 &&
              Mxfp8IndexFormat::kScaleBytes == 4);

// Two fp32 -> two e4m3 codes (lo in bits 0-7) by the hardware. satfinite
// never yields 0x7F/0xFF for a number, so a NaN result of either sign is
// made quant.h's canonical 0x7F by clearing the sign of such bytes.
__device__ __forceinline__ uint32_t FixE4M3NaNs(uint32_t w) {
  const uint32_t nan = ((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
  return w & ~nan;
}

__device__ __forceinline__ uint32_t HwE4M3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return FixE4M3NaNs(r);
}

template <bool kHw>
__device__ __forceinline__ uint32_t E4M3x2(float lo, float hi) {
  if constexpr (kHw) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;  // NaN bytes are fixed per word by the caller
  } else {
    return EncodeE4M3(lo) | (static_cast<uint32_t>(EncodeE4M3(hi)) << 8);
  }
}

// Eight products p[i] = x * multiplier (GPU arithmetic: NaN canonical and
// positive) -> eight e2m1 codes, element i in nibble i, equal to EncodeE2M1
// of each. No compares and no conversions, so it is cheap: with m = |p|
// clamped to [0, 8] (mul.sat on |p| / 8; NaN gives 0), the code is
//   min(RNE(2m), RNE(m) + 2, RNE(m / 2) + 4, 7),
// each term the e2m1 code counted on one of the grids of spacing 1/2, 1, 2
// (each is exact on its own range and larger elsewhere; the three give at
// most 8, and the 7 is applied per nibble at the end). Each RNE is one
// fma into the binade [2^23, 2^24), whose ulp is 1, so the float's bits are
// 0x4B000000 + the term (the added 2 and 4 are even: ties stay even). The
// test suite checks this against quant.h over all 2^32 fp32 inputs.
__device__ __forceinline__ uint32_t E2M1x8(const float (&p)[8]) {
  uint32_t acc = 0;  // sum of (0x4B000000 + code_i) << 4i, mod 2^32
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float m;
    asm("mul.sat.f32 %0, %1, 0f3E000000;" : "=f"(m) : "f"(fabsf(p[i])));
    const uint32_t a = FloatBits(__fmaf_rn(m, 16.0f, 8388608.0f));
    const uint32_t b = FloatBits(__fmaf_rn(m, 8.0f, 8388610.0f));
    const uint32_t c = FloatBits(__fmaf_rn(m, 4.0f, 8388612.0f));
    acc += min(min(a, b), c) << (4 * i);  // 0x4B000000 + 0..8
  }
  // The constant parts: 0x4B000000 << 0 and << 4; higher shifts wrap to 0.
  // A nibble of 8 (m >= 7) is the saturated code 7.
  uint32_t codes = acc - 0xFB000000u;
  codes -= (codes & 0x88888888u) >> 3;
  // Sign bits (bit 3 of each nibble) from byte 3 of each p: even elements'
  // into W_even's bytes, odd into W_odd's.
  const uint32_t e = __byte_perm(
      __byte_perm(FloatBits(p[0]), FloatBits(p[2]), 0x0073),
      __byte_perm(FloatBits(p[4]), FloatBits(p[6]), 0x0073), 0x5410);
  const uint32_t o = __byte_perm(
      __byte_perm(FloatBits(p[1]), FloatBits(p[3]), 0x0073),
      __byte_perm(FloatBits(p[5]), FloatBits(p[7]), 0x0073), 0x5410);
  return codes | ((e >> 4) & 0x08080808u) | (o & 0x80808080u);
}

// Single-value form (tests): the code of p alone in the low nibble.
__device__ __forceinline__ uint32_t MagicE2M1(float p) {
  const float v[8] = {p, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  return E2M1x8(v) & 0xFu;
}

// The 16 input elements of one lane as loaded (BF16: 32 bytes, fp32: 64),
// kept raw so that several tokens' loads are in flight before any math.
template <typename In>
struct LaneInput {
  uint4 v[sizeof(In) == 2 ? 2 : 4];
};

template <typename In>
__device__ __forceinline__ void LoadLane(const In* p, LaneInput<In>& r) {
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(r.v) / 16); ++k) {
    r.v[k] = LoadStream16(reinterpret_cast<const uint8_t*>(p) + 16 * k);
  }
}

template <typename In>
__device__ __forceinline__ void ZeroLane(LaneInput<In>& r) {
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(r.v) / 16); ++k) {
    r.v[k] = make_uint4(0, 0, 0, 0);
  }
}

// 16 input elements of one lane -> fp32.
__device__ __forceinline__ void ToFloat16(const LaneInput<uint16_t>& r,
                                          float (&x)[16]) {
  const uint32_t w[8] = {r.v[0].x, r.v[0].y, r.v[0].z, r.v[0].w,
                         r.v[1].x, r.v[1].y, r.v[1].z, r.v[1].w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    x[2 * i] = BitsToFloat(w[i] << 16);
    x[2 * i + 1] = BitsToFloat(w[i] & 0xFFFF0000u);
  }
}

__device__ __forceinline__ void ToFloat16(const LaneInput<float>& r,
                                          float (&x)[16]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[4 * i] = BitsToFloat(r.v[i].x);
    x[4 * i + 1] = BitsToFloat(r.v[i].y);
    x[4 * i + 2] = BitsToFloat(r.v[i].z);
    x[4 * i + 3] = BitsToFloat(r.v[i].w);
  }
}

// BF16 pair (lo in bits 0-15) of two fp32 by the hardware (RNE, like
// FloatToBf16 for every number; the caller handles NaN).
__device__ __forceinline__ uint32_t HwBf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// HwBf16x2 with NaN halves canonical (0x7FC0), as FloatToBf16 gives: the
// bits a BF16 record or row stores.
__device__ __forceinline__ uint32_t HwBf16x2Canonical(float lo, float hi) {
  uint32_t v = HwBf16x2(lo, hi);
  if ((v & 0x7FFFu) > 0x7F80u) v = (v & 0xFFFF0000u) | 0x7FC0u;
  if ((v & 0x7FFF0000u) > 0x7F800000u) v = (v & 0xFFFFu) | 0x7FC00000u;
  return v;
}

// Two e4m3 codes (lo in bits 0-7) -> two exact fp32 by the hardware.
__device__ __forceinline__ float2 HwE4M3x2ToFloat2(uint32_t codes) {
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;"
      : "=r"(h)
      : "h"(static_cast<uint16_t>(codes)));
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// Ue8m0Scale's exponent ceil(log2(a / qmax)) (clamped to 127) without the
// division, from the bits of a = max(amax, 1e-4): a normal number or +Inf
// (amax ignores NaN). With qmax = q 2^k (448 = 1.75 2^8, 6 = 1.5 2^2) and
// a = m 2^E (m in [1, 2)), a / qmax = (m / q) 2^(E - k) lies in
// (2^(E-k-1), 2^(E-k)] for m <= q and in (2^(E-k), 2^(E-k+1)) above, and
// its rounding stays on that side of 2^(E-k): m > q means m >= q + 2^-23,
// so the quotient exceeds 2^(E-k) by more than 2^-24 2^(E-k), its half-ulp
// there. So e = E - k, plus one when m's fraction exceeds q's; every
// quotient here is normal (>= 1e-4 / 448), and +Inf gives 127.
// CheckEncoders compares it with quant.h's for every finite amax >= 0 and
// +Inf on the device.
template <QuantDtype kDtype>
__device__ __forceinline__ int Ue8m0Exponent(uint32_t a_bits) {
  static_assert(kE4M3Max == 448.0f && kE2M1Max == 6.0f);
  constexpr int kK = kDtype == QuantDtype::kE4M3 ? 8 : 2;
  constexpr uint32_t kQFraction =
      kDtype == QuantDtype::kE4M3 ? 0x600000u : 0x400000u;
  if (a_bits >= 0x7F800000u) return 127;
  return static_cast<int>(a_bits >> 23) - 127 - kK +
         ((a_bits & 0x7FFFFFu) > kQFraction ? 1 : 0);
}

// How ScaleOf finds a UE8M0 exponent: from the bits of a (Ue8m0Exponent,
// fewer instructions) or by quant.h's division; the bytes are the same.
enum class Ue8m0By { kBits, kDivision };

// The group scale of format F from the group's amax (quant.h).
template <class F, Ue8m0By kBy = Ue8m0By::kBits>
__device__ __forceinline__ GroupScale ScaleOf(float amax) {
  if constexpr (F::kSf == ScaleFormat::kUE8M0) {
    constexpr float kQmax =
        F::kDtype == QuantDtype::kE4M3 ? kE4M3Max : kE2M1Max;
    const float a = amax > kAmaxFloor ? amax : kAmaxFloor;
    int e;
    if constexpr (kBy == Ue8m0By::kBits) {
      e = Ue8m0Exponent<F::kDtype>(FloatBits(a));
    } else {  // a / qmax is normal (>= 1e-4 / 448) or Inf (128 -> 127)
      const uint32_t u = FloatBits(__fdiv_rn(a, kQmax));
      e = min(static_cast<int>(u >> 23) - 127 + ((u & 0x7FFFFFu) != 0 ? 1 : 0),
              127);
    }
    // Exp2i(-e): normal for e <= 126, 2^-127 (subnormal) for e = 127.
    const uint32_t m =
        e <= 126 ? static_cast<uint32_t>(127 - e) << 23 : 0x00400000u;
    return {static_cast<uint32_t>(e + 127), BitsToFloat(m)};
  } else if constexpr (F::kSf == ScaleFormat::kE4M3) {
    // E4m3Scale with the hardware cast (s is finite: amax ignores NaN; the
    // cast saturates at 448 like the min) and the correctly rounded
    // reciprocal, which is IEEE 1.0f / sf.
    const float a = amax > kFp4SfAmaxFloor ? amax : kFp4SfAmaxFloor;
    uint16_t pair;  // s is never NaN: no fix-up needed
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;"
        : "=h"(pair)
        : "f"(0.0f), "f"(a * kOneSixth));
    const uint32_t sf = pair & 0xFFu;
    // sf is a positive number (code 1..0x7E): exact by the hardware.
    return {sf, __frcp_rn(HwE4M3x2ToFloat2(sf).x)};
  } else {
    return Fp32Scale(amax);
  }
}

// The value a stored group scale decodes to (what a load multiplies by).
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

// The dequantized BF16 of 8 codes with their group's scale value sc (what
// a load returns), 4 words: e4m3 in codes.x / .y, e2m1 in codes.x (element
// 2i the low nibble of byte i). e4m3 codes decode exactly by the hardware
// (a NaN code to a NaN), and the rounding of the products is FloatToBf16's
// (RNE, NaN canonical): the reference's bits, branch-free.
template <class Q>
__device__ __forceinline__ uint4 DequantBf16x8(uint2 codes, float sc) {
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float v0, v1;
    if constexpr (Q::kDtype == QuantDtype::kE4M3) {
      const float2 f =
          HwE4M3x2ToFloat2((i < 2 ? codes.x : codes.y) >> (16 * (i % 2)));
      v0 = f.x;
      v1 = f.y;
    } else {
      const uint32_t byte = (codes.x >> (8 * i)) & 0xFFu;
      v0 = DecodeE2M1(static_cast<uint8_t>(byte & 0xFu));
      v1 = DecodeE2M1(static_cast<uint8_t>(byte >> 4));
    }
    out[i] = HwBf16x2Canonical(__fmul_rn(v0, sc), __fmul_rn(v1, sc));
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Writes the cast-back of 16 elements that Encode16 encoded as q with the
// group's stored scale: their dequantized BF16 (what a load returns) into
// out[0, 16). e4m3 codes of elements [0, 8) are in q.x, q.y and of [8, 16)
// in q.z, q.w; e2m1 nibbles in q.x and q.y.
template <class Q>
__device__ __forceinline__ void CastBack16(uint4 q, uint32_t stored,
                                           uint16_t* out) {
  const float sc = ScaleValue<Q>(stored);
  const bool e4m3 = Q::kDtype == QuantDtype::kE4M3;
  const uint2 lo = e4m3 ? make_uint2(q.x, q.y) : make_uint2(q.x, 0);
  const uint2 hi = e4m3 ? make_uint2(q.z, q.w) : make_uint2(q.y, 0);
  Store16(out, DequantBf16x8<Q>(lo, sc));
  Store16(out + 8, DequantBf16x8<Q>(hi, sc));
}

// Quantizes x * multiplier: e4m3 -> 16 bytes, e2m1 -> 8 bytes (low nibble =
// even element), returned in a uint4 (e2m1 uses .x and .y).
template <class F, bool kHw>
__device__ __forceinline__ uint4 Encode16(const float (&x)[16], float mult) {
  uint32_t w[4] = {0, 0, 0, 0};
  if constexpr (F::kDtype == QuantDtype::kE4M3) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t pair = E4M3x2<kHw>(x[2 * i] * mult, x[2 * i + 1] * mult);
      w[i / 2] |= pair << (16 * (i % 2));
    }
    if constexpr (kHw) {
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = FixE4M3NaNs(w[i]);
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float p[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) p[i] = x[8 * h + i] * mult;
      w[h] = E2M1x8(p);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

}  // namespace kvdepot::gpu::internal

#endif  // KVDEPOT_KERNELS_CUDA_DEVICE_QUANT_CUH_
