// Property tests of the compressed plan, the SWA plan and the SWA store
// slots on random batches, against brute-force per-token references.
#include <cstdint>
#include <random>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "planner/plan.h"
#include "planner/test_util.h"

namespace kvdepot {
namespace {

using testing::BatchShape;
using testing::ExpandPlan;
using testing::OwnedBatch;
using testing::RandomBatch;
using testing::RowSource;

constexpr int64_t kBatchSizes[] = {1, 7, 79, 512};

// (pool block size B, ratio): logical block_size = ratio * B.
class CompressedPlanTest
    : public ::testing::TestWithParam<std::tuple<int32_t, int32_t>> {};

TEST_P(CompressedPlanTest, EveryRowIsItsCompressedToken) {
  const auto [pool_block, ratio] = GetParam();
  std::mt19937 rng(301);
  BlockLoadPlanBuilder builder(1, 1);  // reused across batches
  for (const int64_t num_seqs : kBatchSizes) {
    BatchShape shape;
    shape.num_seqs = num_seqs;
    shape.block_size = pool_block * ratio;
    shape.ratio = ratio;
    shape.max_seqlen = ratio * std::min(3 * pool_block + 5, 400);
    shape.num_blocks = 777;
    const OwnedBatch batch = RandomBatch(rng, shape);
    std::vector<int32_t> cu(num_seqs + 1, -9);
    const CompressedParams params{.block_size = shape.block_size,
                                  .ratio = ratio,
                                  .num_blocks = shape.num_blocks};
    ASSERT_TRUE(
        BuildCompressedPlan(batch.view(), params, &builder, absl::MakeSpan(cu))
            .ok());
    std::vector<RowSource> rows;
    ASSERT_TRUE(
        ExpandPlan(builder.Finish(), builder.total_k(), pool_block, &rows));
    ASSERT_EQ(cu[0], 0);
    ASSERT_EQ(cu[num_seqs], builder.total_k());
    int64_t real_rows = 0;
    for (int64_t b = 0; b < num_seqs; ++b) {
      const int32_t n = batch.seqlen_k[b] / ratio;
      ASSERT_EQ(cu[b + 1] - cu[b], n == 0 ? 1 : n) << b;
      if (n == 0) {
        EXPECT_EQ(rows[cu[b]], (RowSource{-1, 0})) << b;
        continue;
      }
      for (int32_t t = 0; t < n; ++t) {
        const RowSource want{batch.table[b * batch.stride + t / pool_block],
                             t % pool_block};
        ASSERT_EQ(rows[cu[b] + t], want) << "sequence " << b << " token " << t;
      }
      real_rows += n;
    }
    EXPECT_GT(real_rows, 0);  // not a batch of empty sequences
  }
}

INSTANTIATE_TEST_SUITE_P(BlockSizesAndRatios, CompressedPlanTest,
                         ::testing::Combine(::testing::Values(1, 7, 64, 133),
                                            ::testing::Values(1, 4, 128)));

// Ring sizes; the window is drawn in [1, ring] for every batch.
class SwaPlanTest : public ::testing::TestWithParam<int32_t> {};

TEST_P(SwaPlanTest, EveryRowIsItsWindowPositionOrZero) {
  const int32_t ring = GetParam();
  std::mt19937 rng(301);
  BlockLoadPlanBuilder builder(1, 1);
  int64_t ring_rows = 0, zero_rows = 0, wrapped = 0;
  for (const int64_t num_seqs : kBatchSizes) {
    for (int rep = 0; rep < 4; ++rep) {
      const int32_t window =
          rep == 0 ? ring
                   : std::uniform_int_distribution<int32_t>(1, ring)(rng);
      BatchShape shape;
      shape.num_seqs = num_seqs;
      shape.max_seqlen = 3 * ring + 10;
      shape.num_states = 37;
      const OwnedBatch batch = RandomBatch(rng, shape);
      const SwaParams params{
          .window = window, .ring_size = ring, .num_states = 37};
      ASSERT_TRUE(BuildSwaPlan(batch.view(), params, &builder).ok());
      ASSERT_EQ(builder.total_k(), num_seqs * window);
      const absl::Span<const int32_t> seg = builder.Finish();
      std::vector<RowSource> rows;
      ASSERT_TRUE(ExpandPlan(seg, builder.total_k(), ring, &rows));
      std::vector<int> per_seq(num_seqs, 0), ring_segs(num_seqs, 0);
      for (size_t s = 0; s < seg.size(); s += 4) {
        ++per_seq[seg[s + 3] / window];
        if (seg[s] != -1) ++ring_segs[seg[s + 3] / window];
      }
      for (int64_t b = 0; b < num_seqs; ++b) {
        EXPECT_LE(per_seq[b], 3) << b;
        const int64_t history_end =
            static_cast<int64_t>(batch.seqlen_k[b]) - batch.seqlen_q[b];
        for (int32_t i = 0; i < window; ++i) {
          const int64_t x = history_end - window + i;
          const RowSource want =
              x < batch.valid_start[b]
                  ? RowSource{-1, 0}
                  : RowSource{batch.state_ids[b],
                              static_cast<int32_t>(x % ring)};
          ASSERT_EQ(rows[b * window + i], want)
              << "sequence " << b << " row " << i << " position " << x;
          (want.block == -1 ? zero_rows : ring_rows) += 1;
        }
        EXPECT_LE(ring_segs[b], 2) << b;
        if (ring_segs[b] == 2) ++wrapped;
      }
    }
  }
  EXPECT_GT(ring_rows, 0);
  EXPECT_GT(zero_rows, 0);
  if (ring > 1) {
    EXPECT_GT(wrapped, 0);  // the wrap was exercised
  }
}

TEST_P(SwaPlanTest, StoreSlotsMatchBruteForce) {
  const int32_t ring = GetParam();
  std::mt19937 rng(302);
  int64_t stored = 0, skipped = 0;
  for (const int64_t num_seqs : kBatchSizes) {
    BatchShape shape;
    shape.num_seqs = num_seqs;
    shape.max_seqlen = 3 * ring + 10;
    shape.num_states = 37;
    const OwnedBatch batch = RandomBatch(rng, shape);
    int64_t total_q = 0;
    for (const int32_t q : batch.seqlen_q) total_q += q;
    std::vector<int32_t> slots(total_q, -9);
    const SwaParams params{.window = ring, .ring_size = ring, .num_states = 37};
    ASSERT_TRUE(
        BuildSwaStoreSlots(batch.view(), params, absl::MakeSpan(slots)).ok());
    int64_t row = 0;
    for (int64_t b = 0; b < num_seqs; ++b) {
      const int32_t k = batch.seqlen_k[b], q = batch.seqlen_q[b];
      for (int32_t j = 0; j < q; ++j, ++row) {
        const int32_t want =
            q - j > ring ? -1 : batch.state_ids[b] * ring + (k - q + j) % ring;
        ASSERT_EQ(slots[row], want) << "sequence " << b << " query " << j;
        (want == -1 ? skipped : stored) += 1;
      }
    }
  }
  EXPECT_GT(stored, 0);
  EXPECT_GT(skipped, 0);
}

INSTANTIATE_TEST_SUITE_P(RingSizes, SwaPlanTest,
                         ::testing::Values(1, 3, 7, 17, 64, 133));

}  // namespace
}  // namespace kvdepot
