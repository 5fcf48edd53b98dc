#include "planner/plan_builder.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

std::vector<int32_t> Plan(BlockLoadPlanBuilder& b) {
  absl::Span<const int32_t> s = b.Finish();
  return std::vector<int32_t>(s.begin(), s.end());
}

TEST(BlockLoadPlanBuilderTest, SegmentsAreBackToBack) {
  BlockLoadPlanBuilder b(7, 10);
  ASSERT_TRUE(b.AppendSegment(3, 2, 7).ok());
  ASSERT_TRUE(b.AppendSegment(-1, 0, 4).ok());
  ASSERT_TRUE(b.AppendSegment(9, 0, 1).ok());
  EXPECT_EQ(b.total_k(), 10);
  EXPECT_EQ(Plan(b),
            (std::vector<int32_t>{3, 2, 7, 0, -1, 0, 4, 5, 9, 0, 1, 9}));
}

TEST(BlockLoadPlanBuilderTest, ZeroFillCutsAtBlockSize) {
  BlockLoadPlanBuilder b(3, 1);
  ASSERT_TRUE(b.AppendZeroFill(7).ok());
  ASSERT_TRUE(b.AppendZeroFill(0).ok());
  EXPECT_EQ(Plan(b),
            (std::vector<int32_t>{-1, 0, 3, 0, -1, 0, 3, 3, -1, 0, 1, 6}));
}

TEST(BlockLoadPlanBuilderTest, PagedRangeCutsAtBlockBoundaries) {
  BlockLoadPlanBuilder b(3, 100);
  const std::vector<int32_t> table = {40, 41, 42, 43};
  ASSERT_TRUE(b.AppendPagedRange(table, 2, 10).ok());
  // Tokens 2 | 3 4 5 | 6 7 8 | 9.
  EXPECT_EQ(Plan(b), (std::vector<int32_t>{40, 2, 3, 0, 41, 0, 3, 1, 42, 0, 3,
                                           4, 43, 0, 1, 7}));
  EXPECT_EQ(b.total_k(), 8);
}

TEST(BlockLoadPlanBuilderTest, PagedRangeWithBlockSizeOne) {
  BlockLoadPlanBuilder b(1, 100);
  const std::vector<int32_t> table = {5, 6, 7};
  ASSERT_TRUE(b.AppendPagedRange(table, 0, 3).ok());
  EXPECT_EQ(Plan(b),
            (std::vector<int32_t>{5, 0, 1, 0, 6, 0, 1, 1, 7, 0, 1, 2}));
}

TEST(BlockLoadPlanBuilderTest, RingRangeWrapsOnce) {
  BlockLoadPlanBuilder b(17, 4);
  ASSERT_TRUE(b.AppendRingRange(2, 30, 47).ok());  // 13..16 then 0..12
  EXPECT_EQ(Plan(b), (std::vector<int32_t>{2, 13, 17, 0, 2, 0, 13, 4}));
  b.Reset();
  ASSERT_TRUE(b.AppendRingRange(3, 34, 40).ok());  // 0..5, no wrap
  ASSERT_TRUE(b.AppendRingRange(3, 40, 40).ok());  // empty
  EXPECT_EQ(Plan(b), (std::vector<int32_t>{3, 0, 6, 0}));
}

TEST(BlockLoadPlanBuilderTest, ResetKeepsCapacity) {
  BlockLoadPlanBuilder b(64, 8);
  b.Reserve(100);
  ASSERT_TRUE(b.AppendZeroFill(64 * 100).ok());
  const int32_t* before = b.segments().data();
  b.Reset();
  EXPECT_EQ(b.total_k(), 0);
  EXPECT_EQ(b.num_segments(), 0);
  ASSERT_TRUE(b.AppendZeroFill(64 * 100).ok());
  EXPECT_EQ(b.segments().data(), before);  // no reallocation
  b.Reset(7, 3);
  EXPECT_EQ(b.source_block_size(), 7);
  EXPECT_EQ(b.num_blocks(), 3);
  EXPECT_EQ(b.segments().data(), before);
}

TEST(BlockLoadPlanBuilderTest, AppendAfterFinishFails) {
  BlockLoadPlanBuilder b(4, 4);
  b.Finish();
  absl::Status s = b.AppendZeroFill(1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("after Finish()"));
  b.Reset();
  EXPECT_TRUE(b.AppendZeroFill(1).ok());
}

// Each rule, with the builder left exactly as it was.
struct BadCase {
  const char* name;
  absl::Status (*append)(BlockLoadPlanBuilder&);
  const char* message;
};

const std::vector<int32_t>& Table() {
  static const std::vector<int32_t> t = {1, 2, 9000, 3};
  return t;
}

TEST(BlockLoadPlanBuilderTest, InvalidAppendsChangeNothing) {
  const BadCase cases[] = {
      {"block too big",
       [](BlockLoadPlanBuilder& b) { return b.AppendSegment(8, 0, 1); },
       "src_block_id = 8 is outside [-1, 8)"},
      {"block below -1",
       [](BlockLoadPlanBuilder& b) { return b.AppendSegment(-2, 0, 1); },
       "src_block_id = -2 is outside [-1, 8)"},
      {"end past block",
       [](BlockLoadPlanBuilder& b) { return b.AppendSegment(1, 2, 8); },
       "segment [2, 8) is not inside a block of 7 tokens"},
      {"begin after end",
       [](BlockLoadPlanBuilder& b) { return b.AppendSegment(1, 3, 2); },
       "segment [3, 2)"},
      {"negative zero fill",
       [](BlockLoadPlanBuilder& b) { return b.AppendZeroFill(-1); },
       "zero fill of -1 tokens is negative"},
      {"table too short",
       [](BlockLoadPlanBuilder& b) {
         return b.AppendPagedRange(Table(), 0, 29);
       },
       "paged range ends at token 29 but the block table holds 4 blocks of 7"},
      {"entry outside pool",
       [](BlockLoadPlanBuilder& b) {
         return b.AppendPagedRange(Table(), 3, 15);
       },
       "block_table[2] = 9000 is outside [0, 8)"},
      {"negative paged start",
       [](BlockLoadPlanBuilder& b) {
         return b.AppendPagedRange(Table(), -1, 3);
       },
       "paged range [-1, 3)"},
      {"ring longer than ring",
       [](BlockLoadPlanBuilder& b) { return b.AppendRingRange(1, 3, 11); },
       "ring range [3, 11) holds 8 positions, more than the ring size 7"},
      {"ring state outside",
       [](BlockLoadPlanBuilder& b) { return b.AppendRingRange(8, 0, 1); },
       "state_id = 8 is outside [0, 8)"},
      {"ring reversed",
       [](BlockLoadPlanBuilder& b) { return b.AppendRingRange(1, 5, 4); },
       "ring range [5, 4)"},
      {"int32 overflow",
       [](BlockLoadPlanBuilder& b) { return b.AppendZeroFill(2147483647); },
       "more than the int32 limit"},
  };
  for (const BadCase& c : cases) {
    BlockLoadPlanBuilder b(7, 8);
    ASSERT_TRUE(b.AppendSegment(1, 0, 5).ok());
    const std::vector<int32_t> before(b.segments().begin(), b.segments().end());
    absl::Status s = c.append(b);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.name;
    EXPECT_EQ(b.total_k(), 5) << c.name;
    EXPECT_EQ(std::vector<int32_t>(b.segments().begin(), b.segments().end()),
              before)
        << c.name;
  }
}

}  // namespace
}  // namespace kvdepot
