// SPEC §6's worked example, number for number: seqlen_k 10000, seqlen_q
// 1024, block_size 64, ratio 4, window 4096, ring 4096, valid start 0.
#include <cstdint>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"
#include "planner/plan.h"

namespace kvdepot {
namespace {

constexpr int32_t kState = 5;

struct Example {
  std::vector<int32_t> seqlen_k{10000};
  std::vector<int32_t> seqlen_q{1024};
  std::vector<int32_t> state_ids{kState};
  std::vector<int32_t> valid_start{0};
  std::vector<int32_t> table;  // 157 blocks, physical id = 1000 + logical

  Example() {
    table.resize(157);
    std::iota(table.begin(), table.end(), 1000);
  }
  SequenceBatch view() const {
    SequenceBatch b;
    b.seqlen_k = seqlen_k;
    b.seqlen_q = seqlen_q;
    b.state_ids = state_ids;
    b.swa_valid_start = valid_start;
    b.block_table.data = table;
    b.block_table.num_rows = 1;
    b.block_table.num_cols = 157;
    b.block_table.row_stride = 157;
    return b;
  }
};

TEST(WorkedExampleTest, CompressedPlan) {
  Example ex;
  BlockLoadPlanBuilder builder(1, 1);
  std::vector<int32_t> cu(2, -9);
  ASSERT_TRUE(
      BuildCompressedPlan(
          ex.view(),
          CompressedParams{.block_size = 64, .ratio = 4, .num_blocks = 4096},
          &builder, absl::MakeSpan(cu))
          .ok());
  EXPECT_EQ(builder.source_block_size(), 16);
  EXPECT_EQ(builder.total_k(), 2500);
  ASSERT_EQ(builder.num_segments(), 157);
  absl::Span<const int32_t> seg = builder.Finish();
  for (int s = 0; s < 156; ++s) {
    EXPECT_EQ(seg[4 * s + 0], 1000 + s) << s;
    EXPECT_EQ(seg[4 * s + 1], 0) << s;
    EXPECT_EQ(seg[4 * s + 2], 16) << s;
    EXPECT_EQ(seg[4 * s + 3], 16 * s) << s;
  }
  EXPECT_EQ(seg[4 * 156 + 0], 1156);
  EXPECT_EQ(seg[4 * 156 + 1], 0);
  EXPECT_EQ(seg[4 * 156 + 2], 4);
  EXPECT_EQ(seg[4 * 156 + 3], 2496);
  EXPECT_EQ(cu, (std::vector<int32_t>{0, 2500}));
}

TEST(WorkedExampleTest, SwaPlan) {
  Example ex;
  BlockLoadPlanBuilder builder(1, 1);
  ASSERT_TRUE(BuildSwaPlan(
                  ex.view(),
                  SwaParams{.window = 4096, .ring_size = 4096, .num_states = 8},
                  &builder)
                  .ok());
  // History 4880..8976, no padding: ring[784, 4096) -> 0, ring[0, 784) ->
  // 3312.
  EXPECT_EQ(builder.total_k(), 4096);
  EXPECT_EQ(
      std::vector<int32_t>(builder.Finish().begin(), builder.Finish().end()),
      (std::vector<int32_t>{kState, 784, 4096, 0,  //
                            kState, 0, 784, 3312}));
}

TEST(WorkedExampleTest, PrefillLayoutAndIndices) {
  Example ex;
  absl::StatusOr<PrefillLayout> layout =
      ComputePrefillLayout(ex.view(), 4096, 4);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->swa_history_rows, 4096);
  EXPECT_EQ(layout->chunk_rows, 1024);
  EXPECT_EQ(layout->compressed_rows, 2500);
  EXPECT_EQ(layout->main_kv_offset, 5120);
  EXPECT_EQ(layout->total_rows, 7620);

  // Query 0 (position 8976) sees 4881..8976: history rows 1..4095, then
  // chunk row 4096. The last query (9999) sees 5904..9999: history from row
  // 1024, then the whole chunk.
  std::vector<int32_t> pivots(4 * 1024);
  ASSERT_TRUE(
      ComputeSwaPivots(ex.view(), *layout, absl::MakeSpan(pivots)).ok());
  EXPECT_EQ(std::vector<int32_t>(pivots.begin(), pivots.begin() + 4),
            (std::vector<int32_t>{1, 4095, 4096, 1}));
  EXPECT_EQ(std::vector<int32_t>(pivots.end() - 4, pivots.end()),
            (std::vector<int32_t>{1024, 3072, 4096, 1024}));

  // The compressed index [0, 2500) moves to [5120, 7620).
  const std::vector<int32_t> swa = {0, 4095};
  const std::vector<int32_t> compressed = {0, -1, 2499};
  std::vector<int32_t> cat(5);
  ASSERT_TRUE(KvIndexCat(swa, 2, compressed, 3, 1, layout->main_kv_offset,
                         layout->compressed_rows, absl::MakeSpan(cat))
                  .ok());
  EXPECT_EQ(cat, (std::vector<int32_t>{0, 4095, 5120, -1, 7619}));
}

TEST(WorkedExampleTest, StoreSlots) {
  Example ex;
  std::vector<int32_t> slots(1024);
  ASSERT_TRUE(BuildSwaStoreSlots(
                  ex.view(),
                  SwaParams{.window = 4096, .ring_size = 4096, .num_states = 8},
                  absl::MakeSpan(slots))
                  .ok());
  // Positions 8976..9999 land at ring offsets 784..1807 of state 5.
  EXPECT_EQ(slots.front(), kState * 4096 + 784);
  EXPECT_EQ(slots.back(), kState * 4096 + 1807);
}

}  // namespace
}  // namespace kvdepot
