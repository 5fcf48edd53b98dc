// Random cases of the index RPCs (SPEC §7) and their expected results from
// the planner, shared by the CPU end-to-end test of the buffer forms and
// its GPU twin: indices with -1s, negatives, entries past the sequence and
// past the row, table entries outside [0, num_blocks), compressed rows out
// of range.
#ifndef KVDEPOT_TESTS_INDEX_CASES_H_
#define KVDEPOT_TESTS_INDEX_CASES_H_

#include <cstdint>
#include <random>
#include <vector>

namespace kvdepot::testing {

// A decode batch against a compressed pool of block size B.
struct TopkCase {
  int32_t block_size = 0;
  int32_t num_blocks = 0;
  int64_t batch = 0;
  int32_t k = 0;
  int32_t cols = 0;
  std::vector<int32_t> topk;    // [batch][k]
  std::vector<int32_t> valid;   // [batch] in [0, k]
  std::vector<int32_t> tokens;  // [batch] >= 0
  std::vector<int32_t> table;   // [batch][cols], some entries out of range
};

TopkCase RandomTopk(int32_t block_size, int32_t num_blocks, int64_t batch,
                    int32_t k, int32_t cols, std::mt19937& rng);

// The planner's slots and invalid count (the semantics of every form).
std::vector<int32_t> ExpectedSlots(const TopkCase& c, int64_t* invalid);

// n entries in [-3, compressed_rows + 2]; `clean` gets them with every
// entry outside [-1, compressed_rows) replaced by -1, `invalid` their count.
std::vector<int32_t> RandomCompressed(int64_t n, int32_t compressed_rows,
                                      std::mt19937& rng,
                                      std::vector<int32_t>* clean,
                                      int64_t* invalid);

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_INDEX_CASES_H_
