// Test helpers: random batches that own their arrays, and a checker that
// expands a plan into its per-row sources (verifying bounds, no overlap and
// full coverage), for comparison with brute-force per-token references.
#ifndef KVDEPOT_PLANNER_TEST_UTIL_H_
#define KVDEPOT_PLANNER_TEST_UTIL_H_

#include <cstdint>
#include <random>
#include <vector>

#include "absl/types/span.h"
#include "gtest/gtest.h"
#include "planner/plan.h"

namespace kvdepot {
namespace testing {

// A batch owning its arrays; view() is valid while the object lives and is
// not modified.
struct OwnedBatch {
  std::vector<int32_t> seqlen_k;
  std::vector<int32_t> seqlen_q;
  std::vector<int32_t> state_ids;
  std::vector<int32_t> valid_start;
  std::vector<int32_t> table;     // [num_seqs][stride], -7 in padding
  std::vector<int32_t> row_lens;  // [num_seqs]
  int32_t num_cols = 0;
  int64_t stride = 0;

  SequenceBatch view() const;
};

struct BatchShape {
  int64_t num_seqs = 1;
  int32_t max_seqlen = 1000;
  int32_t block_size = 64;  // logical tokens per table entry
  int32_t ratio = 1;        // compressed tokens: seqlen_k / ratio
  int32_t num_blocks = 1000;
  int32_t num_states = 16;
};

// Random lengths (including 0, seqlen_q = seqlen_k and short histories),
// random valid starts (0, inside, or past the history), random table rows
// just long enough for the compressed tokens plus 0-2 spare entries.
OwnedBatch RandomBatch(std::mt19937& rng, const BatchShape& shape);

// Source of one output row of a plan.
struct RowSource {
  int32_t block;   // -1 = zero row, -2 = not covered
  int32_t offset;  // token within the block
  bool operator==(const RowSource& o) const {
    return block == o.block && offset == o.offset;
  }
};

// Expands segments [S][4] into `rows` (resized to total_k). Fails when a
// segment is outside [0, block_size) or [0, total_k), two segments overlap,
// or a row stays uncovered.
::testing::AssertionResult ExpandPlan(absl::Span<const int32_t> segments,
                                      int32_t total_k, int32_t block_size,
                                      std::vector<RowSource>* rows);

}  // namespace testing
}  // namespace kvdepot

#endif  // KVDEPOT_PLANNER_TEST_UTIL_H_
