#include "planner/test_util.h"

#include <algorithm>

namespace kvdepot {
namespace testing {

SequenceBatch OwnedBatch::view() const {
  SequenceBatch b;
  b.seqlen_k = seqlen_k;
  b.seqlen_q = seqlen_q;
  b.state_ids = state_ids;
  b.swa_valid_start = valid_start;
  b.block_table.data = table;
  b.block_table.num_rows = static_cast<int64_t>(seqlen_k.size());
  b.block_table.num_cols = num_cols;
  b.block_table.row_stride = stride;
  b.block_table.row_lens = row_lens;
  return b;
}

OwnedBatch RandomBatch(std::mt19937& rng, const BatchShape& shape) {
  OwnedBatch out;
  const int64_t n = shape.num_seqs;
  const int32_t tokens_per_block = shape.block_size / shape.ratio;
  auto uniform = [&rng](int64_t lo, int64_t hi) {  // [lo, hi]
    return static_cast<int32_t>(
        std::uniform_int_distribution<int64_t>(lo, hi)(rng));
  };
  for (int64_t b = 0; b < n; ++b) {
    int32_t k = uniform(0, shape.max_seqlen);
    if (uniform(0, 9) == 0) k = uniform(0, 3);  // tiny sequences
    int32_t q;
    switch (uniform(0, 4)) {
      case 0:
        q = k;
        break;  // first chunk: no history
      case 1:
        q = std::min(k, 1);
        break;  // decode
      case 2:
        q = 0;
        break;
      default:
        q = uniform(0, k);
    }
    int32_t vs;
    switch (uniform(0, 3)) {
      case 0:
        vs = 0;
        break;
      case 1:
        vs = uniform(0, k + 5);
        break;  // possibly past the end
      default:
        vs = uniform(std::max(0, k - q - 50), k - q + 3);
    }
    out.seqlen_k.push_back(k);
    out.seqlen_q.push_back(q);
    out.valid_start.push_back(vs);
    out.state_ids.push_back(uniform(0, shape.num_states - 1));
    const int32_t tokens = k / shape.ratio;
    const int32_t blocks = (tokens + tokens_per_block - 1) / tokens_per_block;
    out.row_lens.push_back(blocks + uniform(0, 2));
  }
  out.num_cols =
      n == 0 ? 0 : *std::max_element(out.row_lens.begin(), out.row_lens.end());
  out.stride = out.num_cols + uniform(0, 3);
  out.table.assign(n * out.stride, -7);
  for (int64_t b = 0; b < n; ++b) {
    for (int32_t i = 0; i < out.row_lens[b]; ++i) {
      out.table[b * out.stride + i] = uniform(0, shape.num_blocks - 1);
    }
  }
  return out;
}

::testing::AssertionResult ExpandPlan(absl::Span<const int32_t> segments,
                                      int32_t total_k, int32_t block_size,
                                      std::vector<RowSource>* rows) {
  if (segments.size() % kSegmentFields != 0) {
    return ::testing::AssertionFailure()
           << "segments size " << segments.size() << " is not a multiple of 4";
  }
  rows->assign(total_k, RowSource{-2, 0});
  for (size_t s = 0; s < segments.size() / kSegmentFields; ++s) {
    const int32_t* g = &segments[s * kSegmentFields];
    if (g[0] < -1 || g[1] < 0 || g[1] > g[2] || g[2] > block_size || g[3] < 0 ||
        static_cast<int64_t>(g[3]) + g[2] - g[1] > total_k) {
      return ::testing::AssertionFailure()
             << "segment " << s << " {" << g[0] << ", " << g[1] << ", " << g[2]
             << ", " << g[3] << "} is out of bounds";
    }
    if (g[1] == g[2]) {
      return ::testing::AssertionFailure() << "segment " << s << " is empty";
    }
    for (int32_t t = g[1]; t < g[2]; ++t) {
      RowSource& r = (*rows)[g[3] + t - g[1]];
      if (r.block != -2) {
        return ::testing::AssertionFailure()
               << "segment " << s << " overlaps row " << g[3] + t - g[1];
      }
      r = RowSource{g[0], g[0] == -1 ? 0 : t};
    }
  }
  for (int32_t i = 0; i < total_k; ++i) {
    if ((*rows)[i].block == -2) {
      return ::testing::AssertionFailure() << "row " << i << " is not covered";
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace testing
}  // namespace kvdepot
