#include "tests/index_cases.h"

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "planner/plan.h"

namespace kvdepot::testing {

TopkCase RandomTopk(int32_t block_size, int32_t num_blocks, int64_t batch,
                    int32_t k, int32_t cols, std::mt19937& rng) {
  TopkCase c;
  c.block_size = block_size;
  c.num_blocks = num_blocks;
  c.batch = batch;
  c.k = k;
  c.cols = cols;
  std::uniform_int_distribution<int32_t> block(0, num_blocks - 1);
  std::uniform_int_distribution<int32_t> tokens(0, cols * block_size);
  std::uniform_int_distribution<int32_t> valid(0, k);
  std::uniform_int_distribution<int32_t> bad(0, 19);
  std::uniform_int_distribution<int32_t> x(-3, cols * block_size + 5);
  for (int64_t b = 0; b < batch; ++b) {
    c.tokens.push_back(tokens(rng));
    c.valid.push_back(b == 0 ? k : valid(rng));
    for (int32_t col = 0; col < cols; ++col) {
      const int32_t r = bad(rng);
      c.table.push_back(r == 0 ? -7 : r == 1 ? num_blocks + 3 : block(rng));
    }
    for (int32_t j = 0; j < k; ++j) {
      c.topk.push_back(j % 11 == 5 ? -1 : x(rng));
    }
  }
  return c;
}

std::vector<int32_t> ExpectedSlots(const TopkCase& c, int64_t* invalid) {
  std::vector<int32_t> out = c.topk;
  BlockTableView view;
  view.data = c.table;
  view.num_rows = c.batch;
  view.num_cols = c.cols;
  view.row_stride = c.cols;
  absl::StatusOr<int64_t> n =
      ConvertTopk(absl::MakeSpan(out), c.k, c.valid, c.tokens, view,
                  c.block_size, c.num_blocks);
  EXPECT_TRUE(n.ok()) << n.status();
  *invalid = n.ok() ? *n : -1;
  return out;
}

std::vector<int32_t> RandomCompressed(int64_t n, int32_t compressed_rows,
                                      std::mt19937& rng,
                                      std::vector<int32_t>* clean,
                                      int64_t* invalid) {
  std::uniform_int_distribution<int32_t> pick(-3, compressed_rows + 2);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int32_t& x : v) x = pick(rng);
  *clean = v;
  *invalid = 0;
  for (int32_t& x : *clean) {
    if (x < -1 || x >= compressed_rows) {
      x = -1;
      ++*invalid;
    }
  }
  return v;
}

}  // namespace kvdepot::testing
