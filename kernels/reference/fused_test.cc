// The fused store's CPU reference (SPEC §8): hand-derived cases per stage,
// the rejections, every format over block sizes 1/7/64/133 with -1 slots and
// NaN/Inf inputs (cast_back equal to a later load), and a fixed-seed digest
// of every output bit, which this file checks in two builds (fused_test:
// default flags, fused_fma_test: -mfma), both with -ffp-contract=off.
#include "kernels/reference/fused.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/format_host.h"
#include "kernels/fused_host.h"
#include "kernels/quant.h"
#include "kernels/reference/reference.h"
#include "kernels/store_load_host.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

KVCacheFormat F(const char* name) { return *FormatFromName(name); }

TEST(FusedStagesTest, NormByHand) {
  // x = 1.0 everywhere, w = 2.0, eps = 0: sum 16, mean 1, r = 1, y = 2.
  // Outside the range [8, 16) stays 1.0 ... the norm is over [0, 16).
  const KVCacheFormat f = F("BF16(24)");
  std::vector<uint16_t> x(24, 0x3F80), w(16, 0x4000), y(24);
  FusedParams p;
  p.norm_begin = 0;
  p.norm_end = 16;
  p.norm_weight = w.data();
  p.eps = 0.0f;
  FusedTransformToken(f, p, 0, x.data(), y.data());
  for (int i = 0; i < 16; ++i) EXPECT_EQ(y[i], 0x4000) << i;
  for (int i = 16; i < 24; ++i) EXPECT_EQ(y[i], 0x3F80) << i;
}

TEST(FusedStagesTest, ReductionTreeOrder) {
  // 40 chunks of 8 elements: chunks 0..7 hold 2^-12 in their first element
  // (chunk sum 2^-24), chunk 32 holds 1.0. Slots: slot 0 = chunk 0 + chunk
  // 32 = 2^-24 + 1 = 1 (a tie in fp32, to even); slots 1..7 = 2^-24.
  // Tree: h = 16, 8 add zeros; h = 4: slot 0 += 2^-24 -> 1 (tie again),
  // slots 1..3 = 2^-23; h = 2: slot 0 += 2^-23 -> 1 + 2^-23, slot 1 =
  // 2^-22; h = 1: slot 0 = 1 + 2^-23 + 2^-22 = 1 + 3 * 2^-23. (A sequential
  // sum gives 1 + 2^-21, another tree other values.)
  std::vector<float> x(320, 0.0f);
  for (int c = 0; c < 8; ++c) x[8 * c] = std::ldexp(1.0f, -12);
  x[8 * 32] = 1.0f;
  EXPECT_EQ(FusedSumOfSquares(x.data(), 0, 320),
            1.0f + 3.0f * std::ldexp(1.0f, -23));
}

TEST(FusedStagesTest, RopeAndHadamardByHand) {
  const KVCacheFormat f = F("BF16(128)");
  // Interleaved RoPE on [64, 68) at position 1 with cos 0, sin 1: (a, b) ->
  // (-b, a). Position 0 has cos 1, sin 0 (identity).
  std::vector<float> cs = {1, 1, 0, 0, 0, 0, 1, 1};  // [2][4]: cos | sin
  std::vector<uint16_t> x(128, 0), y(128);
  x[64] = 0x3F80;  // 1
  x[65] = 0x4000;  // 2
  x[66] = 0x4040;  // 3
  x[67] = 0x4080;  // 4
  FusedParams p;
  p.rope = RopeStyle::kInterleaved;
  p.rope_offset = 64;
  p.rope_dim = 4;
  p.cos_sin = cs.data();
  p.max_position = 2;
  FusedTransformToken(f, p, 1, x.data(), y.data());
  EXPECT_EQ(y[64], 0xC000);   // -2
  EXPECT_EQ(y[65], 0x3F80);   // 1
  EXPECT_EQ(y[66], 0xC080);   // -4
  EXPECT_EQ(y[67], 0x4040);   // 3
  p.rope = RopeStyle::kNeox;  // pairs (64, 66), (65, 67)
  FusedTransformToken(f, p, 1, x.data(), y.data());
  EXPECT_EQ(y[64], 0xC040);  // -3
  EXPECT_EQ(y[66], 0x3F80);  // 1
  // Hadamard of e0 over [0, 64): every output 1 * 2^-3 = 0.125 (0x3E00);
  // of all ones: 64 * 0.125 = 8 (0x4100) in element 0, zeros elsewhere.
  FusedParams h;
  h.hadamard_begin = 0;
  h.hadamard_len = 64;
  std::vector<uint16_t> e0(128, 0);
  e0[0] = 0x3F80;
  FusedTransformToken(f, h, 0, e0.data(), y.data());
  for (int i = 0; i < 64; ++i) ASSERT_EQ(y[i], 0x3E00) << i;
  std::vector<uint16_t> ones(128, 0x3F80);
  FusedTransformToken(f, h, 0, ones.data(), y.data());
  EXPECT_EQ(y[0], 0x4100);
  for (int i = 1; i < 64; ++i) ASSERT_EQ(y[i], 0x0000) << i;
  EXPECT_EQ(y[64], 0x3F80);
  // Length 128: 2^-3.5 = fp32 0x3DB504F3 (the table).
  h.hadamard_len = 128;
  FusedTransformToken(f, h, 0, e0.data(), y.data());
  EXPECT_EQ(y[0], FloatToBf16(BitsToFloat(0x3DB504F3u)));
}

// a * c - b * s with a = b, c = s: rounded as written it is exactly 0; an
// FMA would leave the product's rounding error (about 1e-8), a nonzero BF16.
// This is the check that makes fused_fma_test (-mfma) meaningful.
TEST(FusedStagesTest, NoContractionInRope) {
  const KVCacheFormat f = F("BF16(8)");
  const float c = BitsToFloat(0x3F3504F3u);  // fp32(1/sqrt(2))
  std::vector<float> cs = {c, c};            // [1][2]: cos | sin
  std::vector<uint16_t> x = {0x3F81, 0x3F81, 0, 0, 0, 0, 0, 0}, y(8);
  FusedParams p;
  p.rope = RopeStyle::kInterleaved;
  p.rope_dim = 2;
  p.cos_sin = cs.data();
  p.max_position = 1;
  FusedTransformToken(f, p, 0, x.data(), y.data());
  EXPECT_EQ(y[0], 0x0000);  // a * c - b * s = 0
  // b * c + a * s = 2 * fp32(1.0078125 * c), rounded to BF16.
  EXPECT_EQ(y[1], FloatToBf16(1.0078125f * c + 1.0078125f * c));
}

TEST(FusedRejectTest, NamesTheField) {
  const PoolLayout l = *MakePoolLayout(F("V41"), 7, 2, 1);
  std::vector<uint16_t> kv(2 * 512, 0x3F80);
  std::vector<float> cs(16 * 64, 0.5f);
  std::vector<int64_t> pos = {3, 16};
  std::vector<uint8_t> pool(l.layer_bytes, 0x5A);
  const std::vector<int32_t> slots = {0, 1};
  FusedParams p;
  p.rope = RopeStyle::kNeox;
  p.rope_offset = 448;
  p.rope_dim = 64;
  p.positions = pos.data();
  p.cos_sin = cs.data();
  p.max_position = 16;
  absl::Status s = FusedStore(l, pool.data(), kv.data(), p, slots, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("positions[1] = 16 is outside [0, 16)"));
  pos[1] = 2;
  p.hadamard_len = 96;
  s = FusedStore(l, pool.data(), kv.data(), p, slots, nullptr);
  EXPECT_THAT(std::string(s.message()), HasSubstr("96 is not a power of two"));
  p.hadamard_len = 1024;
  s = FusedStore(l, pool.data(), kv.data(), p, slots, nullptr);
  EXPECT_THAT(std::string(s.message()), HasSubstr("does not support"));
  p.hadamard_len = 256;
  p.hadamard_begin = 300;
  s = FusedStore(l, pool.data(), kv.data(), p, slots, nullptr);
  EXPECT_THAT(std::string(s.message()), HasSubstr("hadamard range [300, 556)"));
  p.hadamard_len = 0;
  std::vector<uint16_t> w(512, 0x3F80);
  p.norm_weight = w.data();
  p.norm_begin = 4;
  p.norm_end = 64;
  s = FusedStore(l, pool.data(), kv.data(), p, slots, nullptr);
  EXPECT_THAT(std::string(s.message()), HasSubstr("multiples of 8"));
  p.norm_begin = 0;
  const std::vector<int32_t> bad = {0, 14};
  s = FusedStore(l, pool.data(), kv.data(), p, bad, nullptr);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("slot_mapping[1] = 14 is outside [-1, 14)"));
  for (uint8_t b : pool) ASSERT_EQ(b, 0x5A);  // nothing written
}

// Fixed-seed BF16 input: normal values at a per-token magnitude, with a NaN
// or an Inf in some tokens.
std::vector<uint16_t> RandomInput(int64_t n, int32_t d, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> x(n * d);
  for (int64_t t = 0; t < n; ++t) {
    const float mag = std::ldexp(1.0f, static_cast<int>(rng() % 12) - 6);
    for (int32_t i = 0; i < d; ++i) {
      x[t * d + i] = FloatToBf16(normal(rng) * mag);
    }
    if (t % 5 == 3) x[t * d + rng() % d] = 0x7FC0;
    if (t % 7 == 4) x[t * d + rng() % d] = (rng() & 1) ? 0x7F80 : 0xFF80;
  }
  return x;
}

struct Case {
  const char* format;
  FusedParams params;  // pointers filled in by Run
};

// The MLA ranges for DS_MLA_FP8; for the others norm over all, NeoX RoPE
// on the last 64, Hadamard over the first 64/128.
FusedParams ParamsFor(const KVCacheFormat& f) {
  FusedParams p;
  const int32_t d = f.elements();
  p.norm_begin = 0;
  p.norm_end = f.bf16_elements > 0 && f.quantized() ? f.quantized_elements : d;
  p.eps = 1e-6f;
  p.rope = f.bf16_elements > 0 && f.quantized() ? RopeStyle::kInterleaved
                                                : RopeStyle::kNeox;
  p.rope_offset = d - 64;
  p.rope_dim = 64;
  p.max_position = 4096;
  if (!(f.bf16_elements > 0 && f.quantized())) {
    p.hadamard_begin = 0;
    p.hadamard_len = d >= 128 ? 128 : 64;
  }
  return p;
}

uint64_t Fnv(uint64_t h, const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001B3ull;
  return h;
}

class FusedFormatTest : public ::testing::TestWithParam<const char*> {};

// FusedStore = Store of the transformed tokens at every block size; every
// cast_back row equals a later segment load of its slot (or, for -1 slots
// and index formats, the record's decode).
TEST_P(FusedFormatTest, StoreAndCastBackMatchALaterLoad) {
  const KVCacheFormat f = F(GetParam());
  const int32_t d = f.elements();
  std::mt19937 rng(301);
  std::vector<uint16_t> w(d);
  for (auto& v : w) v = FloatToBf16(1.0f + 0.25f * (rng() % 5));
  std::vector<float> cs(4096 * 64);
  for (int64_t p = 0; p < 4096; ++p) {
    for (int k = 0; k < 32; ++k) {
      const double a = p * std::pow(10000.0, -k / 32.0);
      cs[p * 64 + k] = static_cast<float>(std::cos(a));
      cs[p * 64 + 32 + k] = static_cast<float>(std::sin(a));
    }
  }
  for (int64_t bs : {1, 7, 64, 133}) {
    const PoolLayout l = *MakePoolLayout(f, bs, 3, 1);
    const int64_t n = l.num_slots() + 3;
    const std::vector<uint16_t> kv = RandomInput(n, d, rng);
    bool nonzero = false;
    for (uint16_t h : kv) nonzero |= (h & 0x7FFF) != 0;
    ASSERT_TRUE(nonzero);
    std::vector<int32_t> slots(n, -1);
    for (int64_t i = 3; i < n; ++i) slots[i] = (i * 5) % l.num_slots();
    if (l.num_slots() % 5 == 0) {
      for (int64_t i = 3; i < n; ++i) slots[i] = i - 3;
    }
    std::vector<int64_t> pos(n);
    for (auto& p : pos) p = rng() % 4096;
    FusedParams p = ParamsFor(f);
    p.norm_weight = w.data();
    p.positions = pos.data();
    p.cos_sin = cs.data();
    std::vector<uint8_t> pool(l.layer_bytes, 0x5A), want(l.layer_bytes, 0x5A);
    std::vector<uint16_t> cast(n * d, 0xAAAA);
    ASSERT_TRUE(
        FusedStore(l, pool.data(), kv.data(), p, slots, cast.data()).ok());
    std::vector<uint16_t> y(n * d);
    for (int64_t t = 0; t < n; ++t) {
      FusedTransformToken(f, p, pos[t], &kv[t * d], &y[t * d]);
    }
    ASSERT_TRUE(Store(l, want.data(), y.data(), InputDtype::kBF16, slots).ok());
    ASSERT_EQ(pool, want) << "bs " << bs;
    ASSERT_NE(pool, std::vector<uint8_t>(l.layer_bytes, 0x5A));
    if (!f.do_cast) continue;  // index formats load raw bytes
    std::vector<int32_t> segs;
    for (int32_t b = 0; b < 3; ++b) {
      segs.insert(segs.end(), {b, 0, static_cast<int32_t>(bs),
                               static_cast<int32_t>(b * bs)});
    }
    std::vector<uint16_t> loaded(3 * bs * d);
    ASSERT_TRUE(
        LoadSegments(l, pool.data(), segs, 3 * bs, loaded.data(), nullptr)
            .ok());
    for (int64_t t = 3; t < n; ++t) {
      ASSERT_EQ(0, memcmp(&cast[t * d], &loaded[slots[t] * d], 2 * d))
          << "token " << t << " bs " << bs;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, FusedFormatTest,
                         ::testing::Values("V41", "V41_FP4", "FP4_INDEX",
                                           "FP8_FP32SF_INDEX", "MXFP8_INDEX",
                                           "BF16(512)", "BF16(64)",
                                           "DS_MLA_FP8"),
                         [](const auto& info) {
                           std::string s;
                           for (char c : std::string(info.param)) {
                             if (isalnum(c)) s += c;
                           }
                           return s;
                         });

// Every output bit of a fixed-seed run, as one FNV-1a digest. The constant
// was taken from the default build; fused_fma_test (-mfma) must match it,
// which fails if a product and a sum were contracted into an FMA.
TEST(FusedDigestTest, SameBitsWithAndWithoutFma) {
  uint64_t h = 0xCBF29CE484222325ull;
  std::mt19937 rng(305);
  std::vector<float> cs(64 * 64);
  for (auto& v : cs)
    v = std::ldexp(static_cast<float>(rng() % 2001) - 1000.0f, -10);
  for (const char* name : {"DS_MLA_FP8", "BF16(512)", "V41"}) {
    const KVCacheFormat f = F(name);
    const int32_t d = f.elements();
    const int64_t n = 64;
    const std::vector<uint16_t> kv = RandomInput(n, d, rng);
    std::vector<uint16_t> w(d);
    for (auto& v : w) v = FloatToBf16(std::ldexp(1.0f + (rng() % 256), -7));
    std::vector<int64_t> pos(n);
    for (auto& p : pos) p = rng() % 64;
    FusedParams p = ParamsFor(f);
    p.max_position = 64;
    p.norm_weight = w.data();
    p.positions = pos.data();
    p.cos_sin = cs.data();
    const PoolLayout l = *MakePoolLayout(f, 64, 1, 1);
    std::vector<int32_t> slots(n);
    for (int i = 0; i < n; ++i) slots[i] = i;
    std::vector<uint8_t> pool(l.layer_bytes, 0);
    std::vector<uint16_t> cast(n * d);
    ASSERT_TRUE(
        FusedStore(l, pool.data(), kv.data(), p, slots, cast.data()).ok());
    h = Fnv(h, pool.data(), pool.size());
    h = Fnv(h, cast.data(), 2 * cast.size());
  }
  EXPECT_EQ(h, 0x4B2F80A815AB6719ull) << std::hex << h;
}

}  // namespace
}  // namespace kvdepot
