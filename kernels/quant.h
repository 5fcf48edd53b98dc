// Quantization primitives of SPEC §3, shared bit for bit by the CPU reference
// and the CUDA kernels. All arithmetic is fp32; every cast rounds to nearest,
// ties to even; e4m3 and e2m1 casts saturate. Nothing here calls libm and
// nothing flushes subnormals (build without fast-math, nvcc with -ftz=false).
//
// Code points:
//   e4m3 (fn): S EEEE MMM, bias 7, max 448 = 0x7E, NaN = S.1111.111, no Inf.
//   e2m1:      S EE M,     bias 1, values 0 .5 1 1.5 2 3 4 6, no NaN/Inf.
//   ue8m0:     EEEEEEEE,   value 2^(byte - 127) (byte 255 is invalid).
//   bf16:      the top 16 bits of an fp32.
#ifndef KVDEPOT_KERNELS_QUANT_H_
#define KVDEPOT_KERNELS_QUANT_H_

#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"

namespace kvdepot {

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE2M1Max = 6.0f;
// Lower bound of amax for UE8M0 and fp32 scales, keeps all-zero groups finite.
inline constexpr float kAmaxFloor = 1e-4f;
// 2^-9 * 6: e4m3's smallest subnormal times e2m1's max (V41_FP4 floor).
inline constexpr float kFp4SfAmaxFloor = 0.001953125f * 6.0f;
// The fp32 value nearest 1/6 (bits 0x3E2AAAAB).
inline constexpr float kOneSixth = 0.16666667163372039794921875f;
inline constexpr uint8_t kE4M3NaN = 0x7F;  // canonical: NaN of either sign
inline constexpr uint16_t kBf16NaN = 0x7FC0;
inline constexpr uint8_t kE4M3MaxCode = 0x7E;
inline constexpr uint8_t kE2M1MaxCode = 0x7;

KV_HD inline uint32_t FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

KV_HD inline float BitsToFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

KV_HD inline bool IsNan(float f) {
  return (FloatBits(f) & 0x7FFFFFFFu) > 0x7F800000u;
}

KV_HD inline float Bf16ToFloat(uint16_t h) {
  return BitsToFloat(static_cast<uint32_t>(h) << 16);
}

// Round-to-nearest-even fp32 -> bf16; every NaN becomes the canonical
// kBf16NaN. NaNs are canonical everywhere in this file because a GPU's
// arithmetic returns a canonical NaN (sign and payload lost) where x86
// keeps them: sign-preserving NaNs would break CPU/GPU bit-exactness.
KV_HD inline uint16_t FloatToBf16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return kBf16NaN;
  const uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

// Rounds a non-negative y < 2^23 to the nearest integer, ties to even.
KV_HD inline uint32_t RoundHalfEvenSmall(float y) {
  const uint32_t i = static_cast<uint32_t>(y);   // truncation, exact here
  const float frac = y - static_cast<float>(i);  // exact
  if (frac > 0.5f || (frac == 0.5f && (i & 1u))) return i + 1;
  return i;
}

// Rounds the magnitude bits `a` (a normal fp32, sign cleared) to `mbits`
// mantissa bits, ties to even; the carry may bump the exponent.
KV_HD inline uint32_t RoundMantissa(uint32_t a, int mbits) {
  const int shift = 23 - mbits;
  const uint32_t lsb = (a >> shift) & 1u;
  return (a + ((1u << (shift - 1)) - 1u) + lsb) >> shift;
}

// fp32 -> e4m3 (fn), saturating at ±448; NaN of either sign -> 0x7F.
KV_HD inline uint8_t EncodeE4M3(float x) {
  const uint32_t u = FloatBits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kE4M3NaN;
  const float m = BitsToFloat(a);
  if (m >= kE4M3Max) return sign | kE4M3MaxCode;  // saturate (Inf included)
  if (m < 0.015625f) {  // below 2^-6: subnormal grid m = k * 2^-9, k <= 8
    // k == 8 is 2^-6, whose code 0x08 follows the subnormals seamlessly.
    return sign | static_cast<uint8_t>(RoundHalfEvenSmall(m * 512.0f));
  }
  // Normal: fp32 exponent E (bias 127) -> e4m3 exponent E - 120 (bias 7).
  const uint32_t r = RoundMantissa(a, 3);  // (E << 3) | mmm, carry included
  const uint32_t code = r - (120u << 3);
  return sign | static_cast<uint8_t>(code > kE4M3MaxCode ? kE4M3MaxCode : code);
}

KV_HD inline float DecodeE4M3(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t e = (c >> 3) & 0xFu;
  const uint32_t m = c & 0x7u;
  if (e == 0xF && m == 0x7) return BitsToFloat(sign | 0x7FC00000u);
  if (e == 0) {  // subnormal: m * 2^-9 (exact in fp32)
    return BitsToFloat(sign | FloatBits(static_cast<float>(m) * 0.001953125f));
  }
  return BitsToFloat(sign | ((e + 120u) << 23) | (m << 20));
}

// fp32 -> e2m1 nibble, saturating at ±6; NaN -> 0 (e2m1 has no NaN).
KV_HD inline uint8_t EncodeE2M1(float x) {
  const uint32_t u = FloatBits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 28) & 0x8u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0;
  const float m = BitsToFloat(a);
  if (m >= kE2M1Max) return sign | kE2M1MaxCode;
  if (m < 1.0f) {  // subnormal grid k * 0.5, k <= 2 (2 is code 0b010 = 1.0)
    return sign | static_cast<uint8_t>(RoundHalfEvenSmall(m * 2.0f));
  }
  const uint32_t r = RoundMantissa(a, 1);  // (E << 1) | m
  const uint32_t code = r - (126u << 1);   // bias 127 -> bias 1
  return sign | static_cast<uint8_t>(code > kE2M1MaxCode ? kE2M1MaxCode : code);
}

KV_HD inline float DecodeE2M1(uint8_t nibble) {
  const uint32_t sign = static_cast<uint32_t>(nibble & 0x8u) << 28;
  const uint32_t e = (nibble >> 1) & 0x3u;
  const uint32_t m = nibble & 0x1u;
  if (e == 0) return BitsToFloat(sign | (m ? 0x3F000000u : 0u));  // 0 or .5
  return BitsToFloat(sign | ((e + 126u) << 23) | (m << 22));
}

// 2^k as an exact fp32 for k in [-149, 127] (subnormal below -126).
KV_HD inline float Exp2i(int k) {
  if (k >= -126) return BitsToFloat(static_cast<uint32_t>(k + 127) << 23);
  return BitsToFloat(1u << (k + 149));
}

// ceil(log2(v)) for v > 0 read off the bits (Inf gives 128), clamped to
// [-127, 127]. Subnormal v cannot occur (amax is floored) but is handled.
KV_HD inline int CeilLog2Clamped(float v) {
  const uint32_t u = FloatBits(v);
  const int biased = static_cast<int>((u >> 23) & 0xFFu);
  const uint32_t mant = u & 0x7FFFFFu;
  int e;
  if (biased == 0) {  // subnormal: v = mant * 2^-149
    int msb = 31;
    while (msb > 0 && !((mant >> msb) & 1u)) --msb;
    e = msb - 149 + ((mant & ((1u << msb) - 1u)) != 0 ? 1 : 0);
  } else {
    e = biased - 127 + (mant != 0 ? 1 : 0);
  }
  return e < -127 ? -127 : (e > 127 ? 127 : e);
}

// UE8M0 byte -> fp32 by shifting it into the exponent field (byte 0 -> 0.0).
KV_HD inline float Ue8m0ToFloat(uint8_t b) {
  return BitsToFloat(static_cast<uint32_t>(b) << 23);
}

// Updates a running amax with |x|; NaN never wins (IEEE max ignoring NaN).
KV_HD inline float AmaxUpdate(float amax, float x) {
  const float a = BitsToFloat(FloatBits(x) & 0x7FFFFFFFu);
  return a > amax ? a : amax;  // false for NaN
}

// Scale of one group, in the two forms the store needs: the byte(s) stored
// and the fp32 multiplier applied before the cast.
struct GroupScale {
  uint32_t stored;   // ue8m0 byte, e4m3 byte, or fp32 bits
  float multiplier;  // x * multiplier is cast to the element type
};

// e4m3 or e2m1 data with a UE8M0 scale: e = ceil(log2(max(amax, 1e-4) /
// qmax)); stored = e + 127; multiplier = 2^-e.
KV_HD inline GroupScale Ue8m0Scale(float amax, float qmax) {
  const float a = amax > kAmaxFloor ? amax : kAmaxFloor;
  const int e = CeilLog2Clamped(a / qmax);
  return {static_cast<uint32_t>(e + 127), Exp2i(-e)};
}

// e2m1 data with an e4m3 scale (V41_FP4): sf = e4m3(min(max(amax, 2^-9*6) *
// (1/6), 448)); multiplier = 1 / float(sf).
KV_HD inline GroupScale E4m3Scale(float amax) {
  const float a = amax > kFp4SfAmaxFloor ? amax : kFp4SfAmaxFloor;
  const float s = a * kOneSixth;
  const uint8_t sf = EncodeE4M3(s < kE4M3Max ? s : kE4M3Max);
  return {sf, 1.0f / DecodeE4M3(sf)};
}

// e4m3 data with an fp32 scale: s = max(amax, 1e-4) / 448; multiplier = 1/s.
KV_HD inline GroupScale Fp32Scale(float amax) {
  const float a = amax > kAmaxFloor ? amax : kAmaxFloor;
  const float s = a / kE4M3Max;
  return {FloatBits(s), 1.0f / s};
}

// ---- DS_MLA_FP8 tiles (SPEC §2.1, FlashMLA tests/quant.py @ 9241ae3) ----
//
// Not §3's math: the floor applies to amax / 448 (not to amax), the fp32
// scale is stored rounded up to a power of two, and non-finite tiles have
// their own encodings.
inline constexpr uint32_t kDsMlaNanScaleBits = 0x7FFFFFFFu;  // tile has a NaN
inline constexpr uint32_t kDsMlaInfScaleBits = 0x7F800000u;  // ±Inf, no NaN

// Exponent e of the scale 2^e of a finite tile: e = ceil(log2(max(amax /
// 448, 1e-4))), read off the bits of the fp32 quotient (it is at least 1e-4,
// a normal number, so e is in [-13, 121]; all-zero tiles give -13).
KV_HD inline int DsMlaScaleExponent(float amax) {
  const float v = amax / kE4M3Max;
  const float a = v > kAmaxFloor ? v : kAmaxFloor;
  const uint32_t u = FloatBits(a);
  return static_cast<int>(u >> 23) - 127 + ((u & 0x7FFFFFu) != 0 ? 1 : 0);
}

// The code of a finite element of a tile with an Inf (scale +Inf): x / Inf
// is a signed zero; an infinite element gives NaN (Inf / Inf) = 0x7F.
KV_HD inline uint8_t DsMlaInfTileCode(float x) {
  const uint32_t u = FloatBits(x);
  if ((u & 0x7FFFFFFFu) == 0x7F800000u) return kE4M3NaN;
  return static_cast<uint8_t>((u >> 24) & 0x80u);
}

}  // namespace kvdepot

#endif  // KVDEPOT_KERNELS_QUANT_H_
