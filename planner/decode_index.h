// Decode index operations of SPEC §7, on host arrays: top-k conversion to
// compressed-pool slots and the SWA decode index. Each validates all of its
// structural inputs first; on error nothing is written and the status is
// INVALID_ARGUMENT naming the field and index.
#ifndef KVDEPOT_PLANNER_DECODE_INDEX_H_
#define KVDEPOT_PLANNER_DECODE_INDEX_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "planner/batch.h"
#include "planner/sequence_plans.h"

namespace kvdepot {

// Decode top-k conversion, in place: logical compressed-token indices
// become physical slots of the compressed pool.
//   topk:        [num_seqs][k] in/out; entry x at column c < valid_count[b]
//                becomes block_table[b][x / B] * B + x % B; columns
//                >= valid_count[b] become -1.
//   valid_count: [num_seqs]; each in [0, k]
//   num_tokens:  [num_seqs]; compressed tokens of each sequence, >= 0
//   block_table: num_seqs rows of pool block ids
// An entry x < 0, x >= num_tokens[b], with x / B past the row, or whose
// table entry is outside [0, num_blocks) becomes -1 without reading past
// the table; the number of such entries is returned.
absl::StatusOr<int64_t> ConvertTopk(absl::Span<int32_t> topk, int32_t k,
                                    absl::Span<const int32_t> valid_count,
                                    absl::Span<const int32_t> num_tokens,
                                    const BlockTableView& block_table,
                                    int32_t block_size, int32_t num_blocks);

// SWA decode index from explicit windows, one row per query:
//   state_ids, starts, valid_lens: [n]; state in [0, num_states),
//                                  start >= 0, valid_len in [0, W]
//   out: [n][W]; column i = state * B + (start + i) % B for i < valid_len,
//        else -1.
absl::Status ExpandSwaDecodeIndex(absl::Span<const int32_t> state_ids,
                                  absl::Span<const int32_t> starts,
                                  absl::Span<const int32_t> valid_lens,
                                  const SwaParams& params,
                                  absl::Span<int32_t> out);

// SWA decode windows of a batch whose seqlen_q tokens are already stored
// in the ring: query j of sequence b (position p = seqlen_k - seqlen_q + j)
// sees max(p - W + 1, swa_valid_start[b]) .. p. This compact form is what
// ExpandSwaDecodeIndex (or its kernel) expands.
//   state_ids, starts, valid_lens: [sum seqlen_q] out, rows in sequence
//   order; an empty window has start 0 and valid_len 0.
// Errors, beyond the batch checks: a window reaching a position that the
// ring (the last B positions before seqlen_k) no longer holds.
absl::Status ComputeSwaDecodeWindows(const SequenceBatch& batch,
                                     const SwaParams& params,
                                     absl::Span<int32_t> state_ids,
                                     absl::Span<int32_t> starts,
                                     absl::Span<int32_t> valid_lens);

// The dense SWA decode index of the same windows, without intermediate
// arrays: out is [sum seqlen_q][W], as ExpandSwaDecodeIndex writes it.
absl::Status BuildSwaDecodeIndex(const SequenceBatch& batch,
                                 const SwaParams& params,
                                 absl::Span<int32_t> out);

}  // namespace kvdepot

#endif  // KVDEPOT_PLANNER_DECODE_INDEX_H_
