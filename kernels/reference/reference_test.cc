// Store -> segment load round trips of the CPU reference for every format
// (SPEC §4, §5): error within half a code step of the group scale, exact
// for BF16, -1 padding, slot 0, uncovered rows, zero rows, scale packing.
#include "kernels/reference/reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/format.h"
#include "kernels/format_host.h"
#include "kernels/quant.h"
#include "kernels/reference/reference_test_util.h"

namespace kvdepot {
namespace {

using ::kvdepot::testing::AllFormatNames;
using ::kvdepot::testing::ErrorBound;
using ::kvdepot::testing::GroupScaleValue;
using ::kvdepot::testing::ParamName;
using ::kvdepot::testing::RandomTokens;
using ::kvdepot::testing::ToBf16;

struct Case {
  std::string format;
  int64_t block_size;
  bool bf16_input;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.format << " block_size " << c.block_size
      << (c.bf16_input ? " bf16 input" : " fp32 input");
}

class RoundTripTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    absl::StatusOr<KVCacheFormat> f = FormatFromName(GetParam().format);
    ASSERT_TRUE(f.ok()) << f.status();
    format_ = *f;
    const int64_t bs = GetParam().block_size;
    absl::StatusOr<PoolLayout> l =
        MakePoolLayout(format_, bs, (2 * kTokens + bs - 1) / bs + 1, 1);
    ASSERT_TRUE(l.ok()) << l.status();
    layout_ = *l;
  }

  static constexpr int64_t kTokens = 41;
  KVCacheFormat format_;
  PoolLayout layout_;
};

// Bytes of the pool owned by slot s (data and scales), as [begin, end) pairs.
std::vector<std::pair<int64_t, int64_t>> SlotRanges(const PoolLayout& l,
                                                    int64_t s) {
  const KVCacheFormat& f = l.format;
  return {{l.slot_data_offset(s), l.slot_data_offset(s) + f.data_bytes()},
          {l.slot_scale_offset(s), l.slot_scale_offset(s) + f.sf_bytes()}};
}

TEST_P(RoundTripTest, StoreThenLoadEveryBlock) {
  const KVCacheFormat& f = format_;
  const int64_t elements = f.elements();
  std::mt19937 rng(301);
  std::vector<float> x = RandomTokens(f, kTokens, rng);
  std::vector<uint16_t> xb = ToBf16(x);
  if (GetParam().bf16_input) {
    for (size_t i = 0; i < x.size(); ++i) x[i] = Bf16ToFloat(xb[i]);
  }
  ASSERT_TRUE(std::any_of(x.begin(), x.end(), [](float v) { return v != 0; }));

  // Distinct random slots, slot 0 owned by token 5, every 7th token padding.
  std::vector<int32_t> perm(layout_.num_slots());
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin() + 1, perm.end(), rng);
  std::vector<int32_t> slots(kTokens);
  for (int64_t i = 0; i < kTokens; ++i) slots[i] = perm[i + 1];
  slots[5] = 0;
  for (int64_t i = 3; i < kTokens; i += 7) slots[i] = -1;

  std::vector<uint8_t> pool(layout_.layer_bytes);
  for (auto& b : pool) b = static_cast<uint8_t>(rng());
  const std::vector<uint8_t> before = pool;
  const void* kv = GetParam().bf16_input ? static_cast<const void*>(xb.data())
                                         : static_cast<const void*>(x.data());
  ASSERT_TRUE(
      Store(layout_, pool.data(), kv,
            GetParam().bf16_input ? InputDtype::kBF16 : InputDtype::kFP32,
            slots)
          .ok());

  // Only the bytes of mapped slots changed (-1 wrote nothing).
  std::vector<bool> owned(pool.size(), false);
  for (int32_t s : slots) {
    if (s < 0) continue;
    for (auto [b, e] : SlotRanges(layout_, s)) {
      for (int64_t i = b; i < e; ++i) owned[i] = true;
    }
  }
  for (size_t i = 0; i < pool.size(); ++i) {
    if (!owned[i]) {
      ASSERT_EQ(pool[i], before[i]) << "byte " << i;
    }
  }
  // Each slot holds exactly EncodeToken of its token (slot 0: token 5).
  std::vector<uint8_t> data(f.data_bytes()), scales(f.sf_bytes());
  for (int64_t i = 0; i < kTokens; ++i) {
    if (slots[i] < 0) continue;
    EncodeToken(f, x.data() + i * elements, data.data(), scales.data());
    ASSERT_EQ(0, memcmp(data.data(), &pool[layout_.slot_data_offset(slots[i])],
                        data.size()))
        << "token " << i;
    if (!scales.empty()) {  // BF16: no scales, and memcmp(nullptr, ...) is UB
      ASSERT_EQ(0, memcmp(scales.data(),
                          pool.data() + layout_.slot_scale_offset(slots[i]),
                          scales.size()))
          << "token " << i;
    }
  }

  // Load every block in one plan; row r is slot r.
  std::vector<int32_t> segments;
  for (int64_t b = 0; b < layout_.num_blocks; ++b) {
    segments.insert(
        segments.end(),
        {static_cast<int32_t>(b), 0, static_cast<int32_t>(layout_.block_size),
         static_cast<int32_t>(b * layout_.block_size)});
  }
  const int64_t total_k = layout_.num_slots();
  const int64_t drow = LoadDataRowBytes(f), srow = LoadScaleRowBytes(f);
  std::vector<uint8_t> out(total_k * drow), out_scales(total_k * srow);
  ASSERT_TRUE(LoadSegments(layout_, pool.data(), segments, total_k, out.data(),
                           out_scales.data())
                  .ok());

  int checked = 0;
  for (int64_t i = 0; i < kTokens; ++i) {
    if (slots[i] < 0) continue;
    const uint8_t* row = &out[slots[i] * drow];
    // data() + offset: do_cast formats have no scale rows (srow = 0) and
    // out_scales is empty; out_scales[0] would bind a reference to null.
    const uint8_t* srow_p = out_scales.data() + slots[i] * srow;
    const uint8_t* pscales = &pool[layout_.slot_scale_offset(slots[i])];
    for (int64_t e = 0; e < elements; ++e) {
      const float xi = x[i * elements + e];
      if (!f.quantized()) {  // BF16: exact (RNE of fp32 input)
        uint16_t h;
        memcpy(&h, row + 2 * e, 2);
        ASSERT_EQ(h, xb[i * elements + e]) << "token " << i << " elem " << e;
        ++checked;
        continue;
      }
      const int g = static_cast<int>(e / f.elements_per_sf);
      const double scale = GroupScaleValue(f, pscales, g);
      double got;
      double bound = ErrorBound(f.quantized_dtype, scale, xi);
      if (f.do_cast) {
        uint16_t h;
        memcpy(&h, row + 2 * e, 2);
        got = Bf16ToFloat(h);
        bound += std::fabs(got) / 256;  // the BF16 rounding of the load
      } else {
        const uint8_t code =
            f.quantized_dtype == QuantDtype::kE4M3
                ? row[e]
                : static_cast<uint8_t>((row[e / 2] >> (4 * (e % 2))) & 0xF);
        got = (f.quantized_dtype == QuantDtype::kE4M3 ? DecodeE4M3(code)
                                                      : DecodeE2M1(code)) *
              GroupScaleValue(f, srow_p, g);
      }
      ASSERT_LE(std::fabs(got - xi), bound)
          << "token " << i << " elem " << e << " x " << xi << " scale "
          << scale;
      ++checked;
    }
    if (!f.do_cast) {  // raw scales: the record's bytes, then zero padding
      ASSERT_EQ(0, memcmp(srow_p, pscales, f.sf_bytes()));
      for (int64_t b = f.sf_bytes(); b < srow; ++b) ASSERT_EQ(srow_p[b], 0);
    }
  }
  EXPECT_GT(checked, 0);
}

TEST_P(RoundTripTest, PartialPlanKeepsUncoveredRowsAndZeroFills) {
  const KVCacheFormat& f = format_;
  std::mt19937 rng(302);
  const int64_t bs = layout_.block_size;
  std::vector<float> x = RandomTokens(f, layout_.num_slots(), rng);
  std::vector<int32_t> slots(layout_.num_slots());
  std::iota(slots.begin(), slots.end(), 0);
  std::vector<uint8_t> pool(layout_.layer_bytes, 0x11);
  ASSERT_TRUE(
      Store(layout_, pool.data(), x.data(), InputDtype::kFP32, slots).ok());

  // Rows: [0, 2) untouched, [2, 2 + bs) block 1 tail-first pieces, then a
  // -1 segment of min(bs, 3) rows, then 2 untouched rows.
  const int32_t half = static_cast<int32_t>(bs / 2);
  const int32_t zeros = static_cast<int32_t>(std::min<int64_t>(bs, 3));
  std::vector<int32_t> segments = {1,
                                   half,
                                   static_cast<int32_t>(bs),
                                   2,
                                   1,
                                   0,
                                   half,
                                   static_cast<int32_t>(2 + bs - half),
                                   -1,
                                   0,
                                   zeros,
                                   static_cast<int32_t>(2 + bs)};
  const int64_t total_k = 2 + bs + zeros + 2;
  const int64_t drow = LoadDataRowBytes(f), srow = LoadScaleRowBytes(f);
  std::vector<uint8_t> out(total_k * drow, 0xA7), out_s(total_k * srow, 0xB9);
  ASSERT_TRUE(LoadSegments(layout_, pool.data(), segments, total_k, out.data(),
                           out_s.data())
                  .ok());
  auto row_is = [&](int64_t r, uint8_t d, uint8_t s) {
    for (int64_t b = 0; b < drow; ++b) {
      if (out[r * drow + b] != d) return false;
    }
    for (int64_t b = 0; b < srow; ++b) {
      if (out_s[r * srow + b] != s) return false;
    }
    return true;
  };
  for (int64_t r : {int64_t{0}, int64_t{1}, total_k - 2, total_k - 1}) {
    EXPECT_TRUE(row_is(r, 0xA7, 0xB9)) << "uncovered row " << r;
  }
  for (int64_t r = 2 + bs; r < 2 + bs + zeros; ++r) {
    EXPECT_TRUE(row_is(r, 0, 0)) << "-1 row " << r;
  }
  // Covered rows equal a single-token load of the same source slot.
  for (int64_t r = 2; r < 2 + bs; ++r) {
    const int32_t t = static_cast<int32_t>(
        r - 2 < bs - half ? half + (r - 2) : r - 2 - (bs - half));
    std::vector<int32_t> one = {1, t, t + 1, 0};
    std::vector<uint8_t> d1(drow), s1(srow);
    ASSERT_TRUE(
        LoadSegments(layout_, pool.data(), one, 1, d1.data(), s1.data()).ok());
    ASSERT_EQ(0, memcmp(d1.data(), &out[r * drow], drow)) << "row " << r;
    if (srow > 0) {  // memcmp of a null s1.data() is undefined even for 0
      ASSERT_EQ(0, memcmp(s1.data(), out_s.data() + r * srow, srow))
          << "row " << r;
    }
    ASSERT_FALSE(row_is(r, 0, 0)) << "row " << r;
  }
}

TEST_P(RoundTripTest, EmptyInputsAreNoOps) {
  std::vector<uint8_t> pool(layout_.layer_bytes, 0x3C);
  const std::vector<uint8_t> before = pool;
  EXPECT_TRUE(Store(layout_, pool.data(), nullptr, InputDtype::kBF16, {}).ok());
  EXPECT_EQ(pool, before);
  std::vector<uint8_t> out(LoadDataRowBytes(format_) * 4, 0x42);
  std::vector<uint8_t> out_s(LoadScaleRowBytes(format_) * 4 + 1, 0x43);
  const std::vector<uint8_t> out_before = out, out_s_before = out_s;
  EXPECT_TRUE(
      LoadSegments(layout_, pool.data(), {}, 4, out.data(), out_s.data()).ok());
  EXPECT_EQ(out, out_before);
  EXPECT_EQ(out_s, out_s_before);
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (const std::string& f : AllFormatNames()) {
    for (int64_t bs : {1, 7, 133}) {
      for (bool bf16 : {false, true}) cases.push_back({f, bs, bf16});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Formats, RoundTripTest,
                         ::testing::ValuesIn(AllCases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return ParamName(info.param.format) + "_bs" +
                                  std::to_string(info.param.block_size) +
                                  (info.param.bf16_input ? "_bf16" : "_fp32");
                         });

}  // namespace
}  // namespace kvdepot
