// The host-side description of a batch of sequences that the planner reads:
// per-sequence length arrays and a row-major block table. Nothing is owned;
// every array is untrusted and is validated by the planner before use.
#ifndef KVDEPOT_PLANNER_BATCH_H_
#define KVDEPOT_PLANNER_BATCH_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvdepot {

// Pivot fields of one prefill query row: {off1, len1, off2, len2}.
inline constexpr int kPivotFields = 4;

// Block tables of a batch: row b lists the physical block of each logical
// block of sequence b.
//   data: [num_rows][row_stride] int32 row-major (the last row may stop at
//         num_cols); entries past a row's length are never read.
//   row_lens: [num_rows] entries valid in each row, each in [0, num_cols];
//             empty = every row holds num_cols entries.
struct BlockTableView {
  absl::Span<const int32_t> data;
  int64_t num_rows = 0;
  int32_t num_cols = 0;    // max_blocks: entries usable per row
  int64_t row_stride = 0;  // int32 elements between rows, >= num_cols
  absl::Span<const int32_t> row_lens;

  // REQUIRES: Validate() returned OK and 0 <= b < num_rows.
  absl::Span<const int32_t> Row(int64_t b) const {
    return data.subspan(b * row_stride,
                        row_lens.empty() ? num_cols : row_lens[b]);
  }

  // Shape checks: num_rows >= min_rows, 0 <= num_cols <= row_stride, data
  // large enough, row_lens empty or [num_rows] with entries in [0, num_cols].
  absl::Status Validate(int64_t min_rows) const;
};

// One batch. seqlen_k counts every token of the sequence including this
// step's; seqlen_q counts this step's (the chunk of a prefill, 1 for plain
// decode); the history is [0, seqlen_k - seqlen_q).
struct SequenceBatch {
  absl::Span<const int32_t> seqlen_k;         // [num_seqs]; >= 0
  absl::Span<const int32_t> seqlen_q;         // [num_seqs]; 0..seqlen_k[b]
  absl::Span<const int32_t> state_ids;        // [num_seqs]; SWA ring id
  absl::Span<const int32_t> swa_valid_start;  // [num_seqs] >= 0; empty = 0s
  BlockTableView block_table;                 // compressed cache, num_seqs rows

  int64_t num_seqs() const { return static_cast<int64_t>(seqlen_k.size()); }
  int32_t valid_start(int64_t b) const {
    return swa_valid_start.empty() ? 0 : swa_valid_start[b];
  }
};

// Checks seqlen_q has num_seqs entries, seqlen_k[b] >= 0 and
// 0 <= seqlen_q[b] <= seqlen_k[b].
absl::Status ValidateLengths(const SequenceBatch& batch);

// Checks swa_valid_start is empty or num_seqs entries >= 0.
absl::Status ValidateValidStart(const SequenceBatch& batch);

// Checks the SWA inputs: state_ids has num_seqs entries, each in
// [0, num_states); swa_valid_start is empty or num_seqs entries >= 0.
absl::Status ValidateSwaInputs(const SequenceBatch& batch, int32_t num_states);

// ValidateLengths and ValidateSwaInputs in one pass over the batch; returns
// the sum of seqlen_q, checked to fit int32.
absl::StatusOr<int32_t> ValidateSwaBatch(const SequenceBatch& batch,
                                         int32_t num_states);

// Checks that `span` (named `name`) holds exactly `expected` elements.
absl::Status CheckSize(absl::string_view name, size_t actual, int64_t expected);

}  // namespace kvdepot

#endif  // KVDEPOT_PLANNER_BATCH_H_
