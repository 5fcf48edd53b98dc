// Host-side fast paths of quant.h casts for the CPU reference: branch-free
// forms that produce exactly quant.h's bits (quant_fast_test.cc checks every
// rounding threshold and its neighbours; a disabled test sweeps all 2^32
// fp32 inputs). Random data makes quant.h's branches unpredictable;
// these compile to compares and conditional moves, and vectorize.
#ifndef KVDEPOT_KERNELS_REFERENCE_QUANT_FAST_H_
#define KVDEPOT_KERNELS_REFERENCE_QUANT_FAST_H_

#include <cstdint>

#include "kernels/quant.h"

namespace kvdepot {

// EncodeE2M1 as a count of rounding thresholds passed. The thresholds are
// the midpoints between codes; at a midpoint ties go to the even code, so
// the compare is strict where the lower code is even (0.25: 0|1, 1.25: 2|3,
// 2.5: 4|5, 5: 6|7) and inclusive where the upper code is even (0.75: 1|2,
// 1.75: 3|4, 3.5: 5|6). NaN passes no threshold and drops its sign (+0);
// Inf passes all seven (saturates to 6).
inline uint8_t EncodeE2M1Fast(float x) {
  const uint32_t u = FloatBits(x);
  const float m = BitsToFloat(u & 0x7FFFFFFFu);
  const int code = (m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) +
                   (m > 2.5f) + (m >= 3.5f) + (m > 5.0f);
  const int sign = static_cast<int>((u >> 28) & 0x8u);
  return static_cast<uint8_t>((m == m ? sign : 0) | code);
}

// EncodeE4M3 with both paths computed and the result selected: normal
// values round their fp32 mantissa to 3 bits (ties to even, the carry may
// bump the exponent) and rebias; below 2^-6 the subnormal code k = m * 2^9
// is rounded to an integer by adding 2^23 (fp32 addition rounds to nearest
// even, and 2^23 has an ulp of 1). Saturation (>= 448, Inf) and NaN
// (the canonical 0x7F, sign dropped) override.
inline uint8_t EncodeE4M3Fast(float x) {
  const uint32_t u = FloatBits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  const float m = BitsToFloat(a);
  const uint32_t normal =
      ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  const uint32_t subnormal = FloatBits(m * 512.0f + 8388608.0f) - 0x4B000000u;
  // Integer compares of the magnitude bits (monotone for |x|, NaN above
  // Inf): 0x3C800000 is 2^-6, 0x43E00000 is 448.
  // Selections as masks, so that loops of this vectorize.
  const uint32_t is_sub = 0u - static_cast<uint32_t>(a < 0x3C800000u);
  const uint32_t is_sat = 0u - static_cast<uint32_t>(a >= 0x43E00000u);
  const uint32_t is_nan = 0u - static_cast<uint32_t>(a > 0x7F800000u);
  uint32_t code = (subnormal & is_sub) | (normal & ~is_sub);
  code = sign | (kE4M3MaxCode & is_sat) | (code & ~is_sat);
  return static_cast<uint8_t>((kE4M3NaN & is_nan) | (code & ~is_nan));
}

// The amax of x[0, n) exactly as a chain of AmaxUpdate from 0 computes it:
// for non-negative floats the order of the bit patterns is the order of the
// values, so a signed integer max over the magnitude bits (NaN mapped to 0)
// gives the same bits, and, unlike a float compare chain, vectorizes.
inline float GroupAmaxFast(const float* x, int n) {
  int32_t best = 0;
  for (int i = 0; i < n; ++i) {
    const int32_t a = static_cast<int32_t>(FloatBits(x[i]) & 0x7FFFFFFFu);
    const int32_t v = a > 0x7F800000 ? 0 : a;
    best = v > best ? v : best;
  }
  return BitsToFloat(static_cast<uint32_t>(best));
}

}  // namespace kvdepot

#endif  // KVDEPOT_KERNELS_REFERENCE_QUANT_FAST_H_
