// quant_fast.h against quant.h. Both are monotone step functions of |x|
// whose steps sit on values with few mantissa bits, so checking every bf16
// pattern with the low 16 bits set to each of {0, 1, 2, 0x7FFF, 0x8000,
// 0x8001, 0xFFFE, 0xFFFF} hits every threshold and both fp32 neighbours;
// random patterns are added on top. The full 2^32 sweep is a disabled test
// (a few minutes): bazel test -c opt //kernels/reference:quant_fast_test
// --test_arg=--gtest_also_run_disabled_tests --test_timeout=900
#include "kernels/reference/quant_fast.h"

#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/quant.h"

namespace kvdepot {
namespace {

// Calls check(x) for every input the structured sweep covers.
template <typename Check>
void ForEachInput(Check check) {
  for (uint32_t hi = 0; hi < 65536; ++hi) {
    for (uint32_t lo :
         {0x0u, 0x1u, 0x2u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFEu, 0xFFFFu}) {
      check(hi << 16 | lo);
    }
  }
  std::mt19937 rng(301);
  for (int i = 0; i < 4000000; ++i) check(static_cast<uint32_t>(rng()));
}

TEST(QuantFastTest, E2M1MatchesQuantHAroundEveryThreshold) {
  int nonzero = 0, mismatches = 0;
  uint32_t first = 0;
  ForEachInput([&](uint32_t bits) {
    const float x = BitsToFloat(bits);
    const uint8_t want = EncodeE2M1(x);
    nonzero += (want & 7) != 0;
    if (EncodeE2M1Fast(x) != want && mismatches++ == 0) first = bits;
  });
  EXPECT_EQ(mismatches, 0) << std::hex << "first at bits 0x" << first;
  EXPECT_GT(nonzero, 1000);
}

TEST(QuantFastTest, E4M3MatchesQuantHAroundEveryThreshold) {
  int nonzero = 0, mismatches = 0;
  uint32_t first = 0;
  ForEachInput([&](uint32_t bits) {
    const float x = BitsToFloat(bits);
    const uint8_t want = EncodeE4M3(x);
    nonzero += (want & 0x7F) != 0;
    if (EncodeE4M3Fast(x) != want && mismatches++ == 0) first = bits;
  });
  EXPECT_EQ(mismatches, 0) << std::hex << "first at bits 0x" << first;
  EXPECT_GT(nonzero, 1000);
}

TEST(QuantFastTest, GroupAmaxMatchesAmaxUpdateChain) {
  std::mt19937 rng(301);
  const float specials[] = {0.0f,
                            -0.0f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN(),
                            BitsToFloat(0x7F800001u),
                            BitsToFloat(0x00000001u),
                            std::numeric_limits<float>::max()};
  std::uniform_int_distribution<int> pick(0, 12);
  std::vector<float> x;
  int nonzero = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const int n = 1 + trial % 133;
    x.clear();
    for (int i = 0; i < n; ++i) {
      const int p = pick(rng);
      x.push_back(p < 9 ? specials[p] : BitsToFloat(rng()));
    }
    float want = 0.0f;
    for (float v : x) want = AmaxUpdate(want, v);
    nonzero += want != 0.0f;
    ASSERT_EQ(FloatBits(GroupAmaxFast(x.data(), n)), FloatBits(want))
        << "trial " << trial;
  }
  EXPECT_GT(nonzero, 10000);
  const float nans[] = {std::numeric_limits<float>::quiet_NaN(), -0.0f};
  EXPECT_EQ(FloatBits(GroupAmaxFast(nans, 2)), 0u);
}

class QuantFastSweep : public ::testing::TestWithParam<uint32_t> {};

TEST_P(QuantFastSweep, DISABLED_MatchesQuantHOnEveryPattern) {
  const uint64_t begin = static_cast<uint64_t>(GetParam()) << 28;
  const uint64_t end = begin + (uint64_t{1} << 28);
  uint64_t mismatches = 0, first = 0;
  for (uint64_t b = begin; b < end; ++b) {
    const float x = BitsToFloat(static_cast<uint32_t>(b));
    if ((EncodeE2M1Fast(x) != EncodeE2M1(x) ||
         EncodeE4M3Fast(x) != EncodeE4M3(x)) &&
        mismatches++ == 0) {
      first = b;
    }
  }
  EXPECT_EQ(mismatches, 0u) << "first mismatch at bits 0x" << std::hex << first;
}

INSTANTIATE_TEST_SUITE_P(Slices, QuantFastSweep, ::testing::Range(0u, 16u));

}  // namespace
}  // namespace kvdepot
