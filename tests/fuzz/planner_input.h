// Planner inputs read from fuzz bytes: batches, block tables and output
// sizes (see fuzz_input.h for how values are read). Arrays are short (the
// planner's cost is per element, not what is fuzzed) but their lengths,
// like every count, may disagree with each other.
#ifndef KVDEPOT_TESTS_FUZZ_PLANNER_INPUT_H_
#define KVDEPOT_TESTS_FUZZ_PLANNER_INPUT_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "planner/batch.h"
#include "tests/fuzz/fuzz_input.h"

namespace kvdepot::fuzz {

inline constexpr int64_t kMaxOut = int64_t{1} << 16;  // output elements

// a * b, or -1 when it leaves int64 or either is negative.
inline int64_t Mul(int64_t a, int64_t b) {
  int64_t r;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) return -1;
  return r;
}

// An output size: usually `expected` (when it is sane), sometimes a little
// off, so size checks are exercised too.
inline int64_t OutSize(FuzzInput& in, int64_t expected) {
  const uint8_t mode = in.Byte() % 8;
  if (expected >= 0 && expected <= kMaxOut && mode != 0) return expected;
  const int64_t off =
      (expected >= 0 && expected <= kMaxOut ? expected : 0) + in.Range(-2, 2);
  return off < 0 ? 0 : off;
}

// Length of an array of `n` intended entries: n, or sometimes another one.
inline size_t Len(FuzzInput& in, int64_t n) {
  if (in.Byte() % 8 != 0 && n >= 0 && n <= 64) return static_cast<size_t>(n);
  return static_cast<size_t>(in.Range(0, 9));
}

// Owns the arrays a BlockTableView / SequenceBatch points into.
struct TableInput {
  std::vector<int32_t> data, row_lens;
  BlockTableView view;

  void Read(FuzzInput& in, int64_t rows) {
    view.num_rows = in.Bool() ? rows : in.Int64();
    view.num_cols = in.Int32();
    view.row_stride = in.Bool() ? view.num_cols : in.Int64();
    const int64_t want = Mul(view.num_rows, view.row_stride);
    data = in.Int32s(Len(in, want));
    if (in.Bool()) row_lens = in.Int32s(Len(in, view.num_rows));
    view.data = data;
    view.row_lens = row_lens;
  }
};

struct BatchInput {
  std::vector<int32_t> seqlen_k, seqlen_q, state_ids, valid_start;
  TableInput table;
  SequenceBatch batch;

  void Read(FuzzInput& in) {
    const int64_t n = in.Range(0, 6);
    seqlen_k = in.Int32s(n);
    seqlen_q = in.Int32s(Len(in, n));
    state_ids = in.Int32s(Len(in, n));
    if (in.Bool()) valid_start = in.Int32s(Len(in, n));
    table.Read(in, n);
    batch.seqlen_k = seqlen_k;
    batch.seqlen_q = seqlen_q;
    batch.state_ids = state_ids;
    batch.swa_valid_start = valid_start;
    batch.block_table = table.view;
  }

  // Sum of seqlen_q as the planner would count it, or -1 if negative ones.
  int64_t TotalQ() const {
    int64_t t = 0;
    for (int32_t q : seqlen_q) {
      if (q < 0) return -1;
      t += q;
    }
    return t;
  }
};

// An error of a planner function: INVALID_ARGUMENT with a message.
inline void CheckRejection(const absl::Status& s, const char* what) {
  FUZZ_CHECK(
      s.code() == absl::StatusCode::kInvalidArgument && !s.message().empty(),
      "%s: unexpected status %s", what, s.ToString().c_str());
}

}  // namespace kvdepot::fuzz

#endif  // KVDEPOT_TESTS_FUZZ_PLANNER_INPUT_H_
