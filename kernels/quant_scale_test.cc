// Group scales of quant.h (SPEC §3): the UE8M0 exponent against a brute-force
// ceil(log2), Exp2i / Ue8m0ToFloat against ldexp, and the edge cases of the
// three scale kinds (all-zero group, Inf amax, NaN ignored by amax).
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/quant.h"

namespace kvdepot {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Smallest integer e with 2^e >= v (v > 0 finite), by search in double.
int BruteCeilLog2(float v) {
  int e = -160;
  while (std::ldexp(1.0, e) < static_cast<double>(v)) ++e;
  return e;
}

int Clamp127(int e) { return e < -127 ? -127 : (e > 127 ? 127 : e); }

TEST(QuantScaleTest, CeilLog2OnPowersOfTwoAndNeighbours) {
  for (int k = -149; k <= 127; ++k) {
    const float p = std::ldexp(1.0f, k);
    ASSERT_EQ(static_cast<double>(p), std::ldexp(1.0, k));
    for (float v :
         {p, std::nextafter(p, 0.0f), std::nextafter(p, kInf), p * 1.5f}) {
      if (v == 0.0f || std::isinf(v)) continue;
      ASSERT_EQ(CeilLog2Clamped(v), Clamp127(BruteCeilLog2(v)))
          << "k = " << k << " v = " << v;
    }
  }
}

TEST(QuantScaleTest, CeilLog2RandomAndEdges) {
  std::mt19937 rng(301);
  for (int i = 0; i < 200000; ++i) {
    const float v = BitsToFloat(rng() & 0x7F7FFFFFu);  // positive, finite
    if (v == 0.0f) continue;
    ASSERT_EQ(CeilLog2Clamped(v), Clamp127(BruteCeilLog2(v))) << v;
  }
  EXPECT_EQ(CeilLog2Clamped(1.0f), 0);
  EXPECT_EQ(CeilLog2Clamped(std::nextafter(1.0f, 2.0f)), 1);
  EXPECT_EQ(CeilLog2Clamped(std::ldexp(1.0f, -127)), -127);
  EXPECT_EQ(CeilLog2Clamped(std::ldexp(1.0f, -130)), -127);  // clamped
  EXPECT_EQ(CeilLog2Clamped(std::ldexp(1.0f, -149)), -127);
  EXPECT_EQ(CeilLog2Clamped(std::ldexp(1.0f, 127)), 127);
  EXPECT_EQ(CeilLog2Clamped(std::numeric_limits<float>::max()), 127);
  EXPECT_EQ(CeilLog2Clamped(kInf), 127);
}

TEST(QuantScaleTest, Exp2iAndUe8m0ToFloatAreExact) {
  for (int k = -149; k <= 127; ++k) {
    ASSERT_EQ(static_cast<double>(Exp2i(k)), std::ldexp(1.0, k)) << k;
  }
  for (int b = 1; b <= 254; ++b) {
    ASSERT_EQ(static_cast<double>(Ue8m0ToFloat(static_cast<uint8_t>(b))),
              std::ldexp(1.0, b - 127))
        << b;
  }
  EXPECT_EQ(Ue8m0ToFloat(0), 0.0f);  // never stored: e >= -22 (amax floor)
}

TEST(QuantScaleTest, AmaxIgnoresNaNAndTakesInf) {
  float amax = 0.0f;
  for (float x : {1.0f, kNaN, -3.0f, -kNaN, 2.0f}) amax = AmaxUpdate(amax, x);
  EXPECT_EQ(amax, 3.0f);
  amax = 0.0f;
  for (float x : {kNaN, -kNaN}) amax = AmaxUpdate(amax, x);
  EXPECT_EQ(amax, 0.0f);
  amax = AmaxUpdate(amax, -kInf);
  EXPECT_EQ(amax, kInf);
  EXPECT_EQ(AmaxUpdate(0.0f, -0.0f), 0.0f);
}

TEST(QuantScaleTest, Ue8m0ScaleE4m3) {
  // Zero group: a = 1e-4, v = 1e-4 / 448 ~ 2.23e-7 -> e = -22 (2^-22
  // ~ 2.38e-7).
  GroupScale s = Ue8m0Scale(0.0f, kE4M3Max);
  EXPECT_EQ(s.stored, 127u - 22u);
  EXPECT_EQ(s.multiplier, std::ldexp(1.0f, 22));
  EXPECT_EQ(static_cast<int>(s.stored) - 127,
            BruteCeilLog2(kAmaxFloor / kE4M3Max));
  s = Ue8m0Scale(448.0f, kE4M3Max);  // v = 1 exactly -> e = 0
  EXPECT_EQ(s.stored, 127u);
  EXPECT_EQ(s.multiplier, 1.0f);
  s = Ue8m0Scale(449.0f, kE4M3Max);  // v just above 1 -> e = 1
  EXPECT_EQ(s.stored, 128u);
  EXPECT_EQ(s.multiplier, 0.5f);
  s = Ue8m0Scale(2.0f, kE4M3Max);  // v = 2/448 ~ 0.00446 -> e = -7
  EXPECT_EQ(s.stored, 120u);
  EXPECT_EQ(s.multiplier, 128.0f);
  s = Ue8m0Scale(kInf, kE4M3Max);  // v = Inf -> e = 128, clamped to 127
  EXPECT_EQ(s.stored, 254u);
  EXPECT_EQ(s.multiplier, std::ldexp(1.0f, -127));  // subnormal, not flushed
  EXPECT_GT(s.multiplier, 0.0f);
  EXPECT_EQ(EncodeE4M3(kInf * s.multiplier), 0x7E);  // Inf element saturates
}

TEST(QuantScaleTest, Ue8m0ScaleE2m1) {
  GroupScale s = Ue8m0Scale(6.0f, kE2M1Max);
  EXPECT_EQ(s.stored, 127u);
  s = Ue8m0Scale(12.5f, kE2M1Max);  // v = 2.083 -> e = 2
  EXPECT_EQ(s.stored, 129u);
  EXPECT_EQ(s.multiplier, 0.25f);
  s = Ue8m0Scale(0.0f, kE2M1Max);  // v = 1e-4 / 6 ~ 1.67e-5 -> e = -15
  EXPECT_EQ(s.stored, 112u);
}

TEST(QuantScaleTest, E4m3ScaleForFp4) {
  // Zero group: floor 2^-9 * 6, times c ~ 2^-9 (slightly above) -> code 1.
  GroupScale s = E4m3Scale(0.0f);
  EXPECT_EQ(s.stored, 0x01u);
  EXPECT_EQ(s.multiplier, 512.0f);
  s = E4m3Scale(3.0f);  // 3 * c = 0.50000001 -> e4m3 0.5 = 0x30
  EXPECT_EQ(s.stored, 0x30u);
  EXPECT_EQ(s.multiplier, 2.0f);
  s = E4m3Scale(6.0f * 448.0f);  // 448.00002 -> min(., 448) -> 0x7E
  EXPECT_EQ(s.stored, 0x7Eu);
  s = E4m3Scale(kInf);
  EXPECT_EQ(s.stored, 0x7Eu);
  EXPECT_EQ(s.multiplier, 1.0f / 448.0f);
  // c is a multiply by the fp32 nearest 1/6, not a division by 6.
  EXPECT_EQ(FloatBits(kOneSixth), 0x3E2AAAABu);
  // 0.16666667 = 2^-3 * 1.333: mantissa 2.67/8 rounds to 3/8 -> 2^-3 * 1.375
  // = 0.171875, code S.0100.011 = 0x23.
  s = E4m3Scale(1.0f);
  EXPECT_EQ(s.stored, 0x23u);
  EXPECT_EQ(s.multiplier, 1.0f / 0.171875f);
}

TEST(QuantScaleTest, Fp32Scale) {
  GroupScale s = Fp32Scale(0.0f);
  EXPECT_EQ(s.stored, FloatBits(kAmaxFloor / 448.0f));
  EXPECT_EQ(s.multiplier, 1.0f / (kAmaxFloor / 448.0f));
  s = Fp32Scale(448.0f);
  EXPECT_EQ(BitsToFloat(s.stored), 1.0f);
  EXPECT_EQ(s.multiplier, 1.0f);
  s = Fp32Scale(3.0f);  // 3/448 correctly rounded, multiplier 1/s rounded
  EXPECT_EQ(BitsToFloat(s.stored), 3.0f / 448.0f);
  EXPECT_EQ(s.multiplier, 1.0f / (3.0f / 448.0f));
  // Inf amax: s = Inf, r = 0 (documented in docs/FORMATS.md): finite
  // elements become zeros of their sign, Inf elements NaN (0 * Inf).
  s = Fp32Scale(kInf);
  EXPECT_EQ(BitsToFloat(s.stored), kInf);
  EXPECT_EQ(s.multiplier, 0.0f);
  EXPECT_EQ(EncodeE4M3(-5.0f * s.multiplier), 0x80);
}

}  // namespace
}  // namespace kvdepot
