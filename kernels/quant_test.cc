// Element casts of quant.h (e4m3, e2m1, bf16) against slow, independent
// definitions written here: decode every code point with ldexp, pick the
// nearest code in double precision, ties to the even code, then saturation
// and the NaN rules of SPEC §3.
#include "kernels/quant.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvdepot {
namespace {

// e4m3 (fn) code -> value; NaN for S.1111.111.
double SlowDecodeE4M3(int code) {
  const int sign = code & 0x80;
  const int e = (code >> 3) & 0xF;
  const int m = code & 0x7;
  double v;
  if (e == 0xF && m == 0x7) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(m / 8.0, -6);
  } else {
    v = std::ldexp(1.0 + m / 8.0, e - 7);
  }
  return sign ? -v : v;
}

double SlowDecodeE2M1(int nibble) {
  static const double kValues[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  const double v = kValues[nibble & 7];
  return (nibble & 8) ? -v : v;
}

// Nearest of codes [0, max_code] to |x| (ties to the even code), sign bit
// `sign_bit` set for negative x (so -tiny becomes negative zero).
template <typename Decode>
int SlowNearest(float x, int max_code, int sign_bit, Decode decode) {
  const double mag = std::fabs(static_cast<double>(x));
  // Saturation: at or beyond the largest code (Inf included). Also keeps
  // huge inputs away from double's precision limit below.
  if (mag >= decode(max_code)) {
    return (std::signbit(x) ? sign_bit : 0) | max_code;
  }
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= max_code; ++c) {
    const double err = std::fabs(decode(c) - mag);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return (std::signbit(x) ? sign_bit : 0) | best;
}

int SlowEncodeE4M3(float x) {
  if (std::isnan(x)) return 0x7F;  // canonical NaN, sign dropped
  // Inf and everything beyond 448 saturate; the nearest search does too.
  return SlowNearest(x, 0x7E, 0x80, SlowDecodeE4M3);
}

int SlowEncodeE2M1(float x) {
  if (std::isnan(x)) return 0;  // e2m1 has no NaN
  return SlowNearest(x, 0x7, 0x8, SlowDecodeE2M1);
}

// Value of fp32 bits as a double, reading Inf's bits as 2^128 (the value
// the RNE overflow rule compares against).
double BitsAsDouble(uint32_t u) {
  const double sign = (u >> 31) ? -1.0 : 1.0;
  const int e = (u >> 23) & 0xFF;
  const uint32_t m = u & 0x7FFFFF;
  if (e == 0) return sign * std::ldexp(m, -149);
  return sign * std::ldexp(1.0 + m / 8388608.0, e - 127);
}

uint16_t SlowFloatToBf16(float f) {
  const uint32_t u = FloatBits(f);
  if (std::isnan(f)) return 0x7FC0;  // canonical NaN
  const uint32_t lo = u & 0xFFFF0000u;
  const uint32_t hi = lo + 0x10000u;  // next magnitude (may be Inf's bits)
  const double x = BitsAsDouble(u);
  const double dlo = std::fabs(x - BitsAsDouble(lo));
  const double dhi = std::fabs(BitsAsDouble(hi) - x);
  if (dlo < dhi || (dlo == dhi && ((lo >> 16) & 1) == 0)) return lo >> 16;
  return static_cast<uint16_t>(hi >> 16);
}

// Every bf16 bit pattern as a float (the values a BF16 store sees).
std::vector<float> AllBf16Values() {
  std::vector<float> v;
  for (uint32_t h = 0; h < 65536; ++h) {
    v.push_back(Bf16ToFloat(static_cast<uint16_t>(h)));
  }
  return v;
}

// Midpoints between adjacent codes and their fp32 neighbours: the inputs
// where ties-to-even and off-by-one-ulp errors show.
template <typename Decode>
std::vector<float> Midpoints(int max_code, Decode decode) {
  std::vector<float> v;
  for (int c = 0; c < max_code; ++c) {
    const float mid =
        static_cast<float>((decode(c) + decode(c + 1)) / 2);  // exact
    for (float m : {mid, -mid}) {
      v.push_back(m);
      v.push_back(std::nextafter(m, 0.0f));
      v.push_back(std::nextafter(m, 2 * m));
    }
  }
  return v;
}

TEST(QuantE4M3Test, DecodeEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const double want = SlowDecodeE4M3(c);
    const float got = DecodeE4M3(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << c;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << c;
    }
  }
}

TEST(QuantE4M3Test, EncodeEveryBf16Pattern) {
  int nonzero = 0;
  for (float x : AllBf16Values()) {
    const int got = EncodeE4M3(x);
    nonzero += (got & 0x7F) != 0;
    ASSERT_EQ(got, SlowEncodeE4M3(x))
        << "x = " << x << " bits " << std::hex << FloatBits(x);
  }
  EXPECT_GT(nonzero, 10000);
}

TEST(QuantE4M3Test, EncodeMidpointsAndRandomFloats) {
  std::vector<float> xs = Midpoints(0x7E, SlowDecodeE4M3);
  std::mt19937 rng(301);
  std::uniform_real_distribution<float> mag(-500.0f, 500.0f);
  std::uniform_int_distribution<int> small_exp(-14, 10);
  for (int i = 0; i < 200000; ++i) {
    xs.push_back(std::ldexp(mag(rng) / 500.0f, small_exp(rng)));
    xs.push_back(BitsToFloat(static_cast<uint32_t>(rng())));
  }
  for (float x : xs) {
    ASSERT_EQ(EncodeE4M3(x), SlowEncodeE4M3(x))
        << "x = " << x << " bits " << std::hex << FloatBits(x);
  }
}

TEST(QuantE4M3Test, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(EncodeE4M3(inf), 0x7E);
  EXPECT_EQ(EncodeE4M3(-inf), 0xFE);
  EXPECT_EQ(EncodeE4M3(1e30f), 0x7E);
  EXPECT_EQ(EncodeE4M3(464.0f), 0x7E);  // would be 480 without saturation
  EXPECT_EQ(EncodeE4M3(nan), 0x7F);
  EXPECT_EQ(EncodeE4M3(-nan), 0x7F);  // decision: canonical NaN (GPU parity)
  EXPECT_EQ(EncodeE4M3(0.0f), 0x00);
  EXPECT_EQ(EncodeE4M3(-0.0f), 0x80);
  EXPECT_EQ(EncodeE4M3(-1e-6f), 0x80);         // negative, rounds to zero
  EXPECT_EQ(EncodeE4M3(0.0009765625f), 0x00);  // 2^-10: tie -> even code 0
  EXPECT_EQ(EncodeE4M3(0.0029296875f), 0x02);  // 1.5 * 2^-9: tie -> 2
  EXPECT_EQ(EncodeE4M3(448.0f), 0x7E);
  EXPECT_EQ(EncodeE4M3(1.0f), 0x38);
}

TEST(QuantE2M1Test, DecodeEveryCode) {
  for (int c = 0; c < 16; ++c) {
    const float got = DecodeE2M1(static_cast<uint8_t>(c));
    EXPECT_EQ(static_cast<double>(got), SlowDecodeE2M1(c)) << c;
    EXPECT_EQ(std::signbit(got), (c & 8) != 0) << c;
  }
}

TEST(QuantE2M1Test, EncodeEveryBf16PatternAndMidpoints) {
  std::vector<float> xs = AllBf16Values();
  for (float m : Midpoints(0x7, SlowDecodeE2M1)) xs.push_back(m);
  int nonzero = 0;
  for (float x : xs) {
    const int got = EncodeE2M1(x);
    nonzero += (got & 7) != 0;
    ASSERT_EQ(got, SlowEncodeE2M1(x)) << "x = " << x;
  }
  EXPECT_GT(nonzero, 10000);
}

TEST(QuantE2M1Test, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(EncodeE2M1(inf), 0x7);
  EXPECT_EQ(EncodeE2M1(-inf), 0xF);
  EXPECT_EQ(EncodeE2M1(5.0f), 0x6);   // tie between 4 (code 6) and 6 (7)
  EXPECT_EQ(EncodeE2M1(2.5f), 0x4);   // tie between 2 (code 4) and 3 (5)
  EXPECT_EQ(EncodeE2M1(0.25f), 0x0);  // tie between 0 and 0.5
  EXPECT_EQ(EncodeE2M1(0.75f), 0x2);  // tie between 0.5 and 1
  EXPECT_EQ(EncodeE2M1(-0.1f), 0x8);  // negative zero
  EXPECT_EQ(EncodeE2M1(nan), 0x0);
  EXPECT_EQ(EncodeE2M1(-nan), 0x0);  // decision: NaN -> +0 whatever its sign
  EXPECT_EQ(EncodeE2M1(7.0f), 0x7);
}

TEST(QuantBf16Test, RoundToNearestEven) {
  std::mt19937 rng(301);
  std::vector<uint32_t> bits;
  for (int i = 0; i < 1000000; ++i) bits.push_back(rng());
  // Exact ties, both parities, and the overflow edge to Inf.
  for (uint32_t u : {0x3F808000u, 0x3F818000u, 0x7F7F8000u, 0x7F7F7FFFu,
                     0xFF7FFFFFu, 0x00008000u, 0x00018000u, 0x7F800000u,
                     0xFF800000u, 0x7F800001u, 0xFFC00001u}) {
    bits.push_back(u);
  }
  for (uint32_t u : bits) {
    ASSERT_EQ(FloatToBf16(BitsToFloat(u)), SlowFloatToBf16(BitsToFloat(u)))
        << std::hex << u;
  }
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x3F808000u)), 0x3F80);  // tie, even
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x3F818000u)), 0x3F82);  // tie, up
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x7F7F8000u)), 0x7F80);  // -> Inf
  EXPECT_EQ(FloatToBf16(BitsToFloat(0xFFC00001u)), 0x7FC0);  // canonical NaN
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x7F800001u)), 0x7FC0);  // quieted
}

TEST(QuantBf16Test, EveryPatternRoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBf16(f), h);
  }
}

}  // namespace
}  // namespace kvdepot
