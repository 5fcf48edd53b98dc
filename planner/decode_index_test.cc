// convert_topk and the SWA decode index against brute force.
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/plan.h"
#include "planner/test_util.h"

namespace kvdepot {
namespace {

using testing::BatchShape;
using ::testing::HasSubstr;
using testing::OwnedBatch;
using testing::RandomBatch;

class ConvertTopkTest : public ::testing::TestWithParam<int32_t> {};

TEST_P(ConvertTopkTest, MatchesBruteForceAndCountsBadIndices) {
  const int32_t bs = GetParam();  // compressed tokens per pool block
  const int32_t num_blocks = 500;
  std::mt19937 rng(301);
  auto uniform = [&rng](int64_t lo, int64_t hi) {
    return static_cast<int32_t>(
        std::uniform_int_distribution<int64_t>(lo, hi)(rng));
  };
  const int64_t n = 79;
  const int32_t k = 67, cols = 9, stride = 11;
  std::vector<int32_t> table(n * stride, -7), row_lens(n), num_tokens(n),
      valid(n), topk(n * k);
  for (int64_t b = 0; b < n; ++b) {
    row_lens[b] = uniform(0, cols);
    for (int32_t i = 0; i < row_lens[b]; ++i) {
      // Mostly good ids, a few outside the pool.
      const int32_t pick = uniform(0, 19);
      table[b * stride + i] = pick == 0   ? -1
                              : pick == 1 ? num_blocks
                                          : uniform(0, num_blocks - 1);
    }
    // Sometimes more tokens than the row covers.
    num_tokens[b] = uniform(0, (row_lens[b] + 1) * bs);
    valid[b] = uniform(0, k);
    for (int32_t c = 0; c < k; ++c) {
      topk[b * k + c] = uniform(-3, num_tokens[b] + 2 * bs);
    }
  }
  BlockTableView view{.data = table,
                      .num_rows = n,
                      .num_cols = cols,
                      .row_stride = stride,
                      .row_lens = row_lens};

  std::vector<int32_t> want(topk.size());
  int64_t want_bad = 0, good = 0;
  for (int64_t b = 0; b < n; ++b) {
    for (int32_t c = 0; c < k; ++c) {
      const int32_t x = topk[b * k + c];
      int32_t& w = want[b * k + c];
      w = -1;
      if (c >= valid[b]) continue;
      if (x < 0 || x >= num_tokens[b] || x / bs >= row_lens[b]) {
        ++want_bad;
        continue;
      }
      const int32_t id = table[b * stride + x / bs];
      if (id < 0 || id >= num_blocks) {
        ++want_bad;
        continue;
      }
      w = id * bs + x % bs;
      ++good;
    }
  }
  ASSERT_GT(good, 0);
  ASSERT_GT(want_bad, 0);

  absl::StatusOr<int64_t> bad = ConvertTopk(absl::MakeSpan(topk), k, valid,
                                            num_tokens, view, bs, num_blocks);
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_EQ(*bad, want_bad);
  EXPECT_EQ(topk, want);
}

INSTANTIATE_TEST_SUITE_P(BlockSizes, ConvertTopkTest,
                         ::testing::Values(1, 3, 7, 17, 64, 133));

TEST(ConvertTopkTest, RejectsBadShapesWithoutWriting) {
  const std::vector<int32_t> table = {0, 1, 2, 3};
  const BlockTableView view{
      .data = table, .num_rows = 2, .num_cols = 2, .row_stride = 2};
  struct Case {
    std::vector<int32_t> valid, tokens;
    int32_t k, bs, blocks;
    const char* message;
  };
  const Case cases[] = {
      {{1, 4}, {5, 5}, 3, 4, 8, "valid_count[1] = 4 is outside [0, 3]"},
      {{1, -1}, {5, 5}, 3, 4, 8, "valid_count[1] = -1 is outside [0, 3]"},
      {{1, 1}, {5, -2}, 3, 4, 8, "num_tokens[1] = -2 is negative"},
      {{1, 1}, {5}, 3, 4, 8, "num_tokens has 1 entries, expected 2"},
      {{1, 1}, {5, 5}, 2, 4, 8, "topk has 6 entries, expected 4"},
      {{1, 1}, {5, 5}, 3, 0, 8, "block_size = 0 must be positive"},
      {{1, 1}, {5, 5}, 3, 65536, 65536, "fit the int32 slot range"},
      {{1, 1, 1},
       {5, 5, 5},
       2,
       4,
       8,
       "block_table has 2 rows, fewer than the 3 sequences"},
  };
  for (const Case& c : cases) {
    std::vector<int32_t> topk(6, 1);
    absl::StatusOr<int64_t> r = ConvertTopk(absl::MakeSpan(topk), c.k, c.valid,
                                            c.tokens, view, c.bs, c.blocks);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << c.message;
    EXPECT_THAT(r.status().message(), HasSubstr(c.message));
    EXPECT_EQ(topk, std::vector<int32_t>(6, 1)) << c.message;
  }
}

// Issue #12: k = 0 with batch >= 1 is valid (every sequence selects
// nothing) and used to abort on an absl span bounds assertion.
TEST(ConvertTopkTest, KZeroWithBatchOne) {
  const std::vector<int32_t> table = {0, 1, 2};
  const BlockTableView view{
      .data = table, .num_rows = 3, .num_cols = 1, .row_stride = 1};
  for (int64_t n : {1, 3}) {
    std::vector<int32_t> topk;
    const std::vector<int32_t> valid(n, 0), tokens(n, 5);
    absl::StatusOr<int64_t> r =
        ConvertTopk(absl::MakeSpan(topk), 0, valid, tokens, view, 4, 8);
    ASSERT_TRUE(r.ok()) << "batch " << n << ": " << r.status();
    EXPECT_EQ(*r, 0);
    EXPECT_TRUE(topk.empty());
  }
}

TEST(SwaDecodeIndexTest, ExplicitWindowsWrapAroundTheRing) {
  const std::vector<int32_t> states = {2, 0, 1};
  const std::vector<int32_t> starts = {5, 0, 100};
  const std::vector<int32_t> lens = {4, 0, 3};
  std::vector<int32_t> out(12, -9);
  ASSERT_TRUE(ExpandSwaDecodeIndex(
                  states, starts, lens,
                  SwaParams{.window = 4, .ring_size = 7, .num_states = 3},
                  absl::MakeSpan(out))
                  .ok());
  EXPECT_EQ(out, (std::vector<int32_t>{19, 20, 14, 15,  //
                                       -1, -1, -1, -1,  //
                                       9, 10, 11, -1}));
}

TEST(SwaDecodeIndexTest, ExplicitWindowsRejectBadInput) {
  const SwaParams params{.window = 4, .ring_size = 7, .num_states = 3};
  std::vector<int32_t> out(4, -9);
  absl::Status s =
      ExpandSwaDecodeIndex({3}, {0}, {1}, params, absl::MakeSpan(out));
  EXPECT_THAT(s.message(), HasSubstr("state_ids[0] = 3 is outside [0, 3)"));
  s = ExpandSwaDecodeIndex({0}, {-1}, {1}, params, absl::MakeSpan(out));
  EXPECT_THAT(s.message(), HasSubstr("starts[0] = -1 is negative"));
  s = ExpandSwaDecodeIndex({0}, {0}, {5}, params, absl::MakeSpan(out));
  EXPECT_THAT(s.message(),
              HasSubstr("valid_lens[0] = 5 is outside [0, window = 4]"));
  s = ExpandSwaDecodeIndex({0}, {0, 1}, {1}, params, absl::MakeSpan(out));
  EXPECT_THAT(s.message(), HasSubstr("starts has 2 entries, expected 1"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out, std::vector<int32_t>(4, -9));
}

class SwaDecodeBatchTest : public ::testing::TestWithParam<int32_t> {};

TEST_P(SwaDecodeBatchTest, EveryQuerySeesItsWindowInTheRing) {
  const int32_t window = GetParam();
  std::mt19937 rng(301);
  int64_t keys = 0, masked = 0;
  for (const int64_t num_seqs : {1, 7, 79, 512}) {
    BatchShape shape;
    shape.num_seqs = num_seqs;
    shape.max_seqlen = 3 * window + 10;
    shape.num_states = 29;
    OwnedBatch batch = RandomBatch(rng, shape);
    for (int64_t b = 0; b < num_seqs; ++b) {  // decode: 1-3 queries
      batch.seqlen_q[b] = std::min(batch.seqlen_k[b], 1 + int32_t(b % 3));
    }
    const int32_t ring =
        window + 2 + std::uniform_int_distribution<int32_t>(0, 5)(rng);
    const SwaParams params{
        .window = window, .ring_size = ring, .num_states = 29};
    int64_t total_q = 0;
    for (const int32_t q : batch.seqlen_q) total_q += q;
    std::vector<int32_t> out(total_q * window, -9);
    ASSERT_TRUE(
        BuildSwaDecodeIndex(batch.view(), params, absl::MakeSpan(out)).ok());
    // The compact windows expand to the same rows.
    std::vector<int32_t> states(total_q), starts(total_q), lens(total_q);
    ASSERT_TRUE(
        ComputeSwaDecodeWindows(batch.view(), params, absl::MakeSpan(states),
                                absl::MakeSpan(starts), absl::MakeSpan(lens))
            .ok());
    std::vector<int32_t> expanded(out.size(), -9);
    ASSERT_TRUE(ExpandSwaDecodeIndex(states, starts, lens, params,
                                     absl::MakeSpan(expanded))
                    .ok());
    EXPECT_EQ(expanded, out);
    int64_t row = 0;
    for (int64_t b = 0; b < num_seqs; ++b) {
      const int64_t p0 = batch.seqlen_k[b] - batch.seqlen_q[b];
      for (int32_t j = 0; j < batch.seqlen_q[b]; ++j, ++row) {
        std::vector<int32_t> want;
        for (int64_t x = 0; x <= p0 + j; ++x) {
          if (x > p0 + j - window && x >= batch.valid_start[b]) {
            want.push_back(batch.state_ids[b] * ring + x % ring);
          }
        }
        keys += want.size();
        masked += window - want.size();
        want.resize(window, -1);
        ASSERT_EQ(std::vector<int32_t>(out.begin() + row * window,
                                       out.begin() + (row + 1) * window),
                  want)
            << "sequence " << b << " query " << j;
      }
    }
  }
  EXPECT_GT(keys, 0);
  EXPECT_GT(masked, 0);
}

INSTANTIATE_TEST_SUITE_P(Windows, SwaDecodeBatchTest,
                         ::testing::Values(1, 3, 7, 17, 64, 133));

TEST(SwaDecodeBatchTest, RejectsWindowsTheRingNoLongerHolds) {
  // Three queries at positions 7, 8, 9 with a window of 4: query 0 needs
  // position 4, but a ring of 5 slots holds only 5..9 once all three are
  // stored.
  const std::vector<int32_t> k = {10}, q = {3}, states = {0};
  SequenceBatch batch;
  batch.seqlen_k = k;
  batch.seqlen_q = q;
  batch.state_ids = states;
  std::vector<int32_t> out(12, -9);
  absl::Status s = BuildSwaDecodeIndex(
      batch, SwaParams{.window = 4, .ring_size = 5, .num_states = 1},
      absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr("seqlen_q[0] = 3 with window 4: query 0 sees position "
                        "4 but a ring of 5 slots holds only positions >= 5"));
  EXPECT_EQ(out, std::vector<int32_t>(12, -9));
  std::vector<int32_t> win_states(3, -9), starts(3, -9), lens(3, -9);
  s = ComputeSwaDecodeWindows(
      batch, SwaParams{.window = 4, .ring_size = 5, .num_states = 1},
      absl::MakeSpan(win_states), absl::MakeSpan(starts), absl::MakeSpan(lens));
  EXPECT_THAT(s.message(), HasSubstr("query 0 sees position 4"));
  EXPECT_EQ(starts, std::vector<int32_t>(3, -9));
  // A valid start past position 4 makes the same batch fine.
  const std::vector<int32_t> vs = {5};
  batch.swa_valid_start = vs;
  EXPECT_TRUE(BuildSwaDecodeIndex(
                  batch,
                  SwaParams{.window = 4, .ring_size = 5, .num_states = 1},
                  absl::MakeSpan(out))
                  .ok());
  EXPECT_EQ(out, (std::vector<int32_t>{0, 1, 2, -1, 0, 1, 2, 3, 1, 2, 3, 4}));
  ASSERT_TRUE(ComputeSwaDecodeWindows(
                  batch,
                  SwaParams{.window = 4, .ring_size = 5, .num_states = 1},
                  absl::MakeSpan(win_states), absl::MakeSpan(starts),
                  absl::MakeSpan(lens))
                  .ok());
  EXPECT_EQ(starts, (std::vector<int32_t>{5, 5, 6}));
  EXPECT_EQ(lens, (std::vector<int32_t>{3, 4, 4}));
  std::vector<int32_t> short_lens(2);
  EXPECT_THAT(
      ComputeSwaDecodeWindows(
          batch, SwaParams{.window = 4, .ring_size = 5, .num_states = 1},
          absl::MakeSpan(win_states), absl::MakeSpan(starts),
          absl::MakeSpan(short_lens))
          .message(),
      HasSubstr("valid_lens has 2 entries, expected 3"));
}

}  // namespace
}  // namespace kvdepot
