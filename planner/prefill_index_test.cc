// SWA pivots of prefill query rows, expand_swa_index and kv_index_cat,
// against brute force over the window semantics of SPEC §7.
#include <cstdint>
#include <random>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
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

// Buffer rows that query j of sequence b must see, in position order,
// written straight from the window definition and the buffer layout.
std::vector<int32_t> BruteForceRow(const OwnedBatch& batch, int64_t b,
                                   int32_t j, int32_t window,
                                   int64_t chunk_row0, int32_t width) {
  const int64_t he =
      static_cast<int64_t>(batch.seqlen_k[b]) - batch.seqlen_q[b];
  const int64_t p = he + j;
  std::vector<int32_t> row;
  for (int64_t x = 0; x <= p; ++x) {
    if (x < p - window + 1 || x < batch.valid_start[b]) continue;
    row.push_back(static_cast<int32_t>(x < he ? b * window + (x - (he - window))
                                              : chunk_row0 + (x - he)));
  }
  row.resize(width, -1);
  return row;
}

class SwaPivotTest : public ::testing::TestWithParam<int32_t> {};

TEST_P(SwaPivotTest, ExpandedRowsSeeExactlyTheWindow) {
  const int32_t window = GetParam();
  std::mt19937 rng(301);
  int64_t history_keys = 0, chunk_keys = 0, masked = 0;
  for (const int64_t num_seqs : {1, 7, 79}) {
    BatchShape shape;
    shape.num_seqs = num_seqs;
    shape.max_seqlen = 3 * window + 20;
    const OwnedBatch batch = RandomBatch(rng, shape);
    absl::StatusOr<PrefillLayout> layout =
        ComputePrefillLayout(batch.view(), window, 0);
    ASSERT_TRUE(layout.ok()) << layout.status();
    std::vector<int32_t> pivots(4 * layout->chunk_rows, -9);
    ASSERT_TRUE(
        ComputeSwaPivots(batch.view(), *layout, absl::MakeSpan(pivots)).ok());
    std::vector<int32_t> index(static_cast<size_t>(layout->chunk_rows) * window,
                               -9);
    ASSERT_TRUE(ExpandSwaIndex(pivots, window, layout->main_kv_offset,
                               absl::MakeSpan(index))
                    .ok());
    int64_t row = 0;
    int64_t chunk_row0 = layout->swa_history_rows;
    for (int64_t b = 0; b < num_seqs; ++b) {
      for (int32_t j = 0; j < batch.seqlen_q[b]; ++j, ++row) {
        const std::vector<int32_t> want =
            BruteForceRow(batch, b, j, window, chunk_row0, window);
        const std::vector<int32_t> got(index.begin() + row * window,
                                       index.begin() + (row + 1) * window);
        ASSERT_EQ(got, want) << "sequence " << b << " query " << j;
        for (const int32_t r : want) {
          if (r == -1)
            ++masked;
          else
            (r < layout->swa_history_rows ? history_keys : chunk_keys)++;
        }
      }
      chunk_row0 += batch.seqlen_q[b];
    }
  }
  EXPECT_GT(chunk_keys, 0);
  if (window > 1) {  // a window of one sees only the query's own key
    EXPECT_GT(history_keys, 0);
    EXPECT_GT(masked, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Windows, SwaPivotTest,
                         ::testing::Values(1, 3, 7, 17, 64, 133));

TEST(ExpandSwaIndexTest, TwoRangesThenMinusOne) {
  const std::vector<int32_t> pivots = {10, 2, 50, 3,  //
                                       7,  0, 0,  0,  //
                                       0,  0, 4,  6};
  std::vector<int32_t> out(18, -9);
  ASSERT_TRUE(ExpandSwaIndex(pivots, 6, 60, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, (std::vector<int32_t>{10, 11, 50, 51, 52, -1,  //
                                       -1, -1, -1, -1, -1, -1,  //
                                       4, 5, 6, 7, 8, 9}));
}

TEST(ExpandSwaIndexTest, RejectsBadPivotsWithoutWriting) {
  struct Case {
    std::vector<int32_t> pivots;
    const char* message;
  };
  const Case cases[] = {
      {{0, 2, 0, 0, 0, -1, 0, 0}, "pivots[1].len1 = -1 is negative"},
      {{0, 2, 0, 0, 0, 0, 0, -3}, "pivots[1].len2 = -3 is negative"},
      {{0, 3, 4, 2, 0, 0, 0, 0}, "pivots[0] lengths 3 + 2 exceed the width 4"},
      {{8, 3, 0, 0, 0, 0, 0, 0},
       "pivots[0] range 1 [8, 11) is outside [0, 10)"},
      {{0, 0, 0, 0, 0, 1, -1, 1},
       "pivots[1] range 2 [-1, 0) is outside [0, 10)"},
      {{0, 0, 0}, "pivots has 3 entries, not a multiple of 4"},
  };
  for (const Case& c : cases) {
    std::vector<int32_t> out(8, -9);
    absl::Status s = ExpandSwaIndex(c.pivots, 4, 10, absl::MakeSpan(out));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(s.message(), HasSubstr(c.message));
    EXPECT_EQ(out, std::vector<int32_t>(8, -9)) << c.message;
  }
  std::vector<int32_t> out(7);
  absl::Status s =
      ExpandSwaIndex({0, 1, 0, 0, 0, 1, 0, 0}, 4, 10, absl::MakeSpan(out));
  EXPECT_THAT(s.message(), HasSubstr("out has 7 entries, expected 8"));
  s = ExpandSwaIndex({}, 0, 10, {});
  EXPECT_THAT(s.message(), HasSubstr("width = 0 must be positive"));
}

TEST(KvIndexCatTest, ShiftsCompressedEntriesOnly) {
  std::mt19937 rng(301);
  const int64_t rows = 79;
  const int32_t sw = 17, cw = 133, offset = 5120, comp_rows = 2500;
  std::vector<int32_t> swa(rows * sw), comp(rows * cw);
  std::uniform_int_distribution<int32_t> swa_dist(-1, offset - 1);
  std::uniform_int_distribution<int32_t> comp_dist(-1, comp_rows - 1);
  for (int32_t& x : swa) x = swa_dist(rng);
  for (int32_t& x : comp) x = comp_dist(rng);
  std::vector<int32_t> out(rows * (sw + cw), -9);
  ASSERT_TRUE(KvIndexCat(swa, sw, comp, cw, rows, offset, comp_rows,
                         absl::MakeSpan(out))
                  .ok());
  int64_t minus = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int32_t c = 0; c < sw; ++c) {
      ASSERT_EQ(out[r * (sw + cw) + c], swa[r * sw + c]) << r << " " << c;
    }
    for (int32_t c = 0; c < cw; ++c) {
      const int32_t x = comp[r * cw + c];
      minus += x == -1;
      ASSERT_EQ(out[r * (sw + cw) + sw + c], x == -1 ? -1 : x + offset)
          << r << " " << c;
    }
  }
  EXPECT_GT(minus, 0);
}

// Found by //tests/fuzz:index_fuzz: rows > 0 with both widths 0 (an empty
// output) aborted on an absl span bounds assertion.
TEST(KvIndexCatTest, ZeroWidthRows) {
  std::vector<int32_t> out;
  const absl::Status s =
      KvIndexCat({}, 0, {}, 0, 3, 10, 20, absl::MakeSpan(out));
  EXPECT_TRUE(s.ok()) << s;
  // And in O(1): 2^31 - 1 empty rows used to take seconds.
  const absl::Time start = absl::Now();
  EXPECT_TRUE(
      KvIndexCat({}, 0, {}, 0, INT32_MAX, 10, 20, absl::MakeSpan(out)).ok());
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(100));
}

// Found by //tests/fuzz:index_fuzz (UBSan): rows = 2^62 overflowed
// rows * swa_width in the size checks.
TEST(KvIndexCatTest, HugeRowsAreRejectedBeforeArithmetic) {
  std::vector<int32_t> out(4, -9);
  const absl::Status s = KvIndexCat({0, 1}, 2, {0, 1}, 2, int64_t{1} << 62, 10,
                                    20, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("rows = 4611686018427387904 exceeds"));
  EXPECT_EQ(out, std::vector<int32_t>(4, -9));
}

TEST(KvIndexCatTest, RejectsBadEntriesWithoutWriting) {
  std::vector<int32_t> out(6, -9);
  absl::Status s =
      KvIndexCat({0, 1, 2, 3}, 2, {0, 9000}, 1, 2, 10, 20, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr("compressed_index[1][0] = 9000 is outside [-1, 20)"));
  s = KvIndexCat({0, 1, 2, -2}, 2, {0, 0}, 1, 2, 10, 20, absl::MakeSpan(out));
  EXPECT_THAT(s.message(), HasSubstr("swa_index[1][1] = -2 is outside [-1, "
                                     "10)"));
  s = KvIndexCat({0, 1, 2, 10}, 2, {0, 0}, 1, 2, 10, 20, absl::MakeSpan(out));
  EXPECT_THAT(s.message(), HasSubstr("swa_index[1][1] = 10 is outside"));
  s = KvIndexCat({0, 1, 2}, 2, {0, 0}, 1, 2, 10, 20, absl::MakeSpan(out));
  EXPECT_THAT(s.message(), HasSubstr("swa_index has 3 entries, expected 4"));
  s = KvIndexCat({0, 1, 2, 3}, 2, {0, 0}, 1, 2, 2147483647, 20,
                 absl::MakeSpan(out));
  EXPECT_THAT(s.message(), HasSubstr("outside the int32 row range"));
  EXPECT_EQ(out, std::vector<int32_t>(6, -9));
}

}  // namespace
}  // namespace kvdepot
