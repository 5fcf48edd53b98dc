// Every rejection rule of the CPU reference (SPEC §4, §5): the status code,
// a message naming the field and index, and pool / outputs byte-identical
// afterwards.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "kernels/format_host.h"
#include "kernels/reference/reference.h"
#include "kernels/reference/reference_test_util.h"

namespace kvdepot {
namespace {

using ::kvdepot::testing::AllFormatNames;
using ::kvdepot::testing::ParamName;
using ::testing::HasSubstr;

constexpr int64_t kBlockSize = 7;
constexpr int64_t kNumBlocks = 5;  // 35 slots

class RejectTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::StatusOr<KVCacheFormat> f = FormatFromName(GetParam());
    ASSERT_TRUE(f.ok()) << f.status();
    absl::StatusOr<PoolLayout> l =
        MakePoolLayout(*f, kBlockSize, kNumBlocks, 1);
    ASSERT_TRUE(l.ok()) << l.status();
    layout_ = *l;
    pool_.assign(layout_.layer_bytes, 0x5D);
    for (size_t i = 0; i < pool_.size(); i += 3) pool_[i] = 0x17;
    kv_.assign(kTokens * f->elements(), 1.5f);
    out_.assign(kRows * LoadDataRowBytes(*f), 0x6E);
    out_scales_.assign(kRows * LoadScaleRowBytes(*f) + 4, 0x7F);
  }

  // Store must fail with `code` and a message containing `what`, leaving
  // the pool as it was.
  void ExpectStoreRejected(
      const std::vector<int32_t>& slots, const std::string& what,
      absl::StatusCode code = absl::StatusCode::kInvalidArgument,
      InputDtype dtype = InputDtype::kFP32) {
    ASSERT_LE(slots.size(), static_cast<size_t>(kTokens));
    const std::vector<uint8_t> before = pool_;
    const absl::Status s =
        Store(layout_, pool_.data(), kv_.data(), dtype, slots);
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(what));
    EXPECT_TRUE(pool_ == before) << "pool changed by a rejected store";
  }

  void ExpectLoadRejected(const std::vector<int32_t>& segments, int64_t total_k,
                          const std::string& what, bool null_scales = false) {
    const std::vector<uint8_t> before = out_, before_s = out_scales_;
    const absl::Status s =
        LoadSegments(layout_, pool_.data(), segments, total_k, out_.data(),
                     null_scales ? nullptr : out_scales_.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(what));
    EXPECT_TRUE(out_ == before) << "data changed by a rejected load";
    EXPECT_TRUE(out_scales_ == before_s) << "scales changed";
  }

  static constexpr int64_t kTokens = 40;
  static constexpr int64_t kRows = 20;
  PoolLayout layout_;
  std::vector<uint8_t> pool_;
  std::vector<float> kv_;
  std::vector<uint8_t> out_, out_scales_;
};

TEST_P(RejectTest, SlotOutsideRange) {
  // Valid slots first, so a partial write would show in the pool.
  ExpectStoreRejected({0, 1, 2, -2},
                      "slot_mapping[3] = -2 is outside [-1, 35)");
  ExpectStoreRejected({0, 1, 35}, "slot_mapping[2] = 35 is outside [-1, 35)");
  ExpectStoreRejected({4, -1, 2147483647},
                      "slot_mapping[2] = 2147483647 is outside [-1, 35)");
}

TEST_P(RejectTest, DuplicateSlot) {
  ExpectStoreRejected({3, -1, 9, -1, 10, 9, 3},
                      "slot_mapping[5] = 9 duplicates slot_mapping[2]");
  ExpectStoreRejected({0, 0}, "slot_mapping[1] = 0 duplicates slot_mapping[0]");
  // -1 may repeat.
  std::vector<int32_t> pads(kTokens, -1);
  const std::vector<uint8_t> before = pool_;
  EXPECT_TRUE(
      Store(layout_, pool_.data(), kv_.data(), InputDtype::kFP32, pads).ok());
  EXPECT_TRUE(pool_ == before);
}

TEST_P(RejectTest, DuplicateSlotInLargePoolUsesSortPath) {
  // 2^24 slots, far more than 64 per token: validated by sorting. Only the
  // validation runs, so no pool memory is needed.
  absl::StatusOr<PoolLayout> big =
      MakePoolLayout(layout_.format, 1024, 16384, 1);
  ASSERT_TRUE(big.ok());
  std::vector<int32_t> slots(1000);
  std::iota(slots.begin(), slots.end(), 16000000);
  EXPECT_TRUE(ValidateSlotMapping(*big, slots).ok());
  slots[700] = 16000300;
  slots[900] = 16000300;
  const absl::Status s = ValidateSlotMapping(*big, slots);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("slot_mapping[700] = 16000300 duplicates "
                        "slot_mapping[300]"));
}

TEST_P(RejectTest, BadDtypeLayoutAndNullPointers) {
  ExpectStoreRejected({1}, "dtype = 7", absl::StatusCode::kInvalidArgument,
                      static_cast<InputDtype>(7));
  const PoolLayout good = layout_;
  layout_.block_stride += 32;
  ExpectStoreRejected({1}, "block_stride");
  ExpectLoadRejected({0, 0, 1, 0}, 1, "block_stride");
  layout_ = good;
  layout_.num_blocks = 0;
  ExpectStoreRejected({1}, "num_blocks");
  layout_ = good;
  const absl::Status s =
      Store(layout_, pool_.data(), nullptr, InputDtype::kFP32, {{1}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("kv is null"));
  if (LoadScaleRowBytes(layout_.format) > 0) {
    ExpectLoadRejected({0, 0, 1, 0}, 1, "scales is null", true);
  }
}

TEST_P(RejectTest, SegmentsShape) {
  ExpectLoadRejected({0, 0, 1}, 1,
                     "segments.size() = 3 is not a multiple of 4");
  ExpectLoadRejected({0, 0, 1, 0}, -1, "total_k = -1 is negative");
}

TEST_P(RejectTest, SegmentFieldsOutOfRange) {
  // Segment 0 is valid, so a partial write would show in the outputs.
  const std::vector<int32_t> ok = {0, 0, 2, 0};
  auto with = [&](std::vector<int32_t> bad) {
    std::vector<int32_t> v = ok;
    v.insert(v.end(), bad.begin(), bad.end());
    return v;
  };
  ExpectLoadRejected(with({-2, 0, 1, 2}), kRows,
                     "segments[1].src_block_id = -2 is outside [-1, 5)");
  ExpectLoadRejected(with({5, 0, 1, 2}), kRows,
                     "segments[1].src_block_id = 5 is outside [-1, 5)");
  ExpectLoadRejected(with({1, -1, 1, 2}), kRows,
                     "segments[1].src_begin = -1 is outside [0, 7]");
  ExpectLoadRejected(with({1, 8, 8, 2}), kRows,
                     "segments[1].src_begin = 8 is outside [0, 7]");
  ExpectLoadRejected(with({1, 4, 3, 2}), kRows,
                     "segments[1].src_end = 3 is outside [src_begin = 4, 7]");
  ExpectLoadRejected(with({1, 0, 8, 2}), kRows,
                     "segments[1].src_end = 8 is outside [src_begin = 0, 7]");
  ExpectLoadRejected(with({1, 0, 1, -3}), kRows,
                     "segments[1].dst_offset = -3 is negative");
  ExpectLoadRejected(with({1, 0, 7, 14}), kRows,
                     "segments[1] writes rows [14, 21) beyond total_k = 20");
  ExpectLoadRejected(with({-1, 0, 2, 19}), kRows,
                     "segments[1] writes rows [19, 21) beyond total_k = 20");
}

TEST_P(RejectTest, OverlappingDestinations) {
  ExpectLoadRejected({0, 0, 5, 0, 1, 0, 3, 10, 2, 0, 2, 4}, kRows,
                     "segments[2] writes rows [4, 6) that overlap rows [0, 5) "
                     "of segments[0]");
  ExpectLoadRejected({1, 0, 3, 10, 0, 0, 7, 5}, kRows,
                     "segments[0] writes rows [10, 13) that overlap rows "
                     "[5, 12) of segments[1]");
  ExpectLoadRejected({-1, 0, 1, 3, 2, 3, 4, 3}, kRows,
                     "that overlap rows [3, 4)");
  // Touching ranges and empty segments do not overlap.
  EXPECT_TRUE(
      ValidateSegments(layout_, {0, 0, 5, 0, 1, 0, 5, 5, 2, 3, 3, 2}, kRows)
          .ok());
  EXPECT_TRUE(ValidateSegments(layout_, {2, 3, 3, 20}, kRows).ok());
}

// Destinations in ascending order take a one-pass check, others a sort:
// both must name the same overlaps (here in ascending order; ties in index
// order) and agree with a pairwise check on random plans, in any order.
TEST_P(RejectTest, OverlapCheckInOrderAndShuffled) {
  ExpectLoadRejected({0, 0, 5, 0, 1, 0, 3, 4}, kRows,
                     "segments[1] writes rows [4, 7) that overlap rows [0, 5) "
                     "of segments[0]");
  ExpectLoadRejected({0, 0, 2, 3, 1, 0, 1, 3}, kRows,
                     "segments[1] writes rows [3, 4) that overlap rows [3, 5) "
                     "of segments[0]");
  // Ranges [0, 2) [2, 3) [3, 5) [5, 8), an empty segment at dst 1 between
  // them, then [6, 7) (ascending) or [4, 6) (out of order: the sort).
  const std::vector<int32_t> head = {0, 0, 2, 0, 1, 4, 4, 1, 1, 0,
                                     1, 2, 2, 0, 2, 3, 3, 0, 3, 5};
  std::vector<int32_t> plan = head;
  plan.insert(plan.end(), {4, 0, 1, 6});
  ExpectLoadRejected(plan, kRows,
                     "segments[5] writes rows [6, 7) that overlap rows [5, 8) "
                     "of segments[4]");
  plan = head;
  plan.insert(plan.end(), {4, 0, 2, 4});
  ExpectLoadRejected(plan, kRows,
                     "segments[5] writes rows [4, 6) that overlap rows [3, 5) "
                     "of segments[3]");
  std::mt19937 rng(301);
  int overlapping = 0;
  for (int plan = 0; plan < 2000; ++plan) {
    const int n = 1 + static_cast<int>(rng() % 8);
    std::vector<int32_t> segs;
    for (int s = 0; s < n; ++s) {
      const int32_t begin = static_cast<int32_t>(rng() % (kBlockSize + 1));
      const int32_t len =
          static_cast<int32_t>(rng() % (kBlockSize - begin + 1));
      const int32_t dst = static_cast<int32_t>(rng() % (kRows - len + 1));
      segs.insert(segs.end(), {static_cast<int32_t>(rng() % kNumBlocks), begin,
                               begin + len, dst});
    }
    bool overlap = false;
    for (int i = 0; i < n; ++i) {
      for (int j = i + 1; j < n; ++j) {
        const int32_t* a = &segs[4 * i];
        const int32_t* b = &segs[4 * j];
        overlap = overlap ||
                  (a[2] > a[1] && b[2] > b[1] && a[3] < b[3] + (b[2] - b[1]) &&
                   b[3] < a[3] + (a[2] - a[1]));
      }
    }
    overlapping += overlap ? 1 : 0;
    std::vector<int32_t> sorted = segs;  // the same plan, dst ascending
    std::vector<int> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return segs[4 * a + 3] < segs[4 * b + 3];
    });
    for (int s = 0; s < n; ++s) {
      std::copy_n(&segs[4 * order[s]], 4, &sorted[4 * s]);
    }
    for (const std::vector<int32_t>* p : {&segs, &sorted}) {
      const absl::Status st = ValidateSegments(layout_, *p, kRows);
      EXPECT_EQ(st.ok(), !overlap) << "plan " << plan << ": " << st;
      if (!st.ok()) {
        EXPECT_THAT(std::string(st.message()), HasSubstr("that overlap rows"));
      }
    }
  }
  EXPECT_GT(overlapping, 100);
  EXPECT_LT(overlapping, 1900);
}

TEST_P(RejectTest, UnsupportedQuantization) {
  // e4m3 data with e4m3 scales: valid per SPEC §2, but §3 has no math for it.
  absl::StatusOr<KVCacheFormat> f =
      MakeFormat(QuantDtype::kE4M3, 64, 32, 0, true, ScaleFormat::kE4M3, true);
  ASSERT_TRUE(f.ok());
  absl::StatusOr<PoolLayout> l = MakePoolLayout(*f, 3, 2, 1);
  ASSERT_TRUE(l.ok());
  std::vector<uint8_t> pool(l->layer_bytes, 0x44);
  const absl::Status s =
      Store(*l, pool.data(), kv_.data(), InputDtype::kFP32, {{0}});
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(s.message()), HasSubstr("e4m3 data with e4m3"));
  EXPECT_EQ(pool, std::vector<uint8_t>(l->layer_bytes, 0x44));
}

INSTANTIATE_TEST_SUITE_P(Formats, RejectTest,
                         ::testing::ValuesIn(AllFormatNames()),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           return ParamName(i.param);
                         });

}  // namespace
}  // namespace kvdepot
