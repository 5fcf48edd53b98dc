// Per-batch load plans of SPEC §6: the compressed (paged) plan, the SWA
// (ring) plan, and the slots where a chunk's SWA K/V is stored.
//
// Each function validates every input before producing output; on error the
// outputs (builder included) are unchanged and the status is
// INVALID_ARGUMENT naming the field and index. The builder is Reset() to the
// right source pool and reserved once per call: a builder reused across
// calls does not allocate per sequence.
#ifndef KVDEPOT_PLANNER_SEQUENCE_PLANS_H_
#define KVDEPOT_PLANNER_SEQUENCE_PLANS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "planner/batch.h"
#include "planner/plan_builder.h"

namespace kvdepot {

// The compressed cache: one compressed token per `ratio` tokens, pool blocks
// of block_size / ratio compressed tokens.
struct CompressedParams {
  int32_t block_size = 0;  // logical tokens per block table entry; > 0
  int32_t ratio = 0;       // > 0, divides block_size
  int32_t num_blocks = 0;  // pool blocks; ids in [0, num_blocks)

  // Compressed tokens per pool block (B = block_size / ratio).
  int32_t source_block_size() const { return block_size / ratio; }
  // Output rows of one sequence: seqlen_k / ratio, at least 1.
  int32_t RowsFor(int32_t seqlen_k) const {
    const int32_t n = seqlen_k / ratio;
    return n == 0 ? 1 : n;
  }
};

// The SWA ring cache: one ring of ring_size slots per state.
struct SwaParams {
  int32_t window = 0;      // W: keys a query sees; 0 < W <= ring_size
  int32_t ring_size = 0;   // B: slots per ring (the pool's block size)
  int32_t num_states = 0;  // rings in the pool; state ids in [0, num_states)
};

absl::Status ValidateCompressedParams(const CompressedParams& params);
absl::Status ValidateSwaParams(const SwaParams& params);

// Compressed plan: sequence b contributes n = seqlen_k[b] / ratio rows
// (append_paged_range over its block table), or one zero row when n = 0.
//   cu_compressed: [num_seqs + 1] out; rows of sequence b are
//                  [cu_compressed[b], cu_compressed[b + 1]).
// Reads batch.seqlen_k and batch.block_table only.
absl::Status BuildCompressedPlan(const SequenceBatch& batch,
                                 const CompressedParams& params,
                                 BlockLoadPlanBuilder* builder,
                                 absl::Span<int32_t> cu_compressed);

// SWA plan: the W positions before this chunk, [seqlen_k - seqlen_q - W,
// seqlen_k - seqlen_q), in order; positions before swa_valid_start (or
// before 0) are zero rows, the rest come from the ring. Sequence b owns rows
// [b * W, (b + 1) * W); at most three segments per sequence.
absl::Status BuildSwaPlan(const SequenceBatch& batch, const SwaParams& params,
                          BlockLoadPlanBuilder* builder);

// SWA store slots for this chunk's tokens, sequence after sequence:
//   slots: [sum seqlen_q] out; query j of sequence b (position
//          seqlen_k - seqlen_q + j) goes to state_id * B + position % B, or
//          -1 when seqlen_q - j > B (overwritten before the chunk ends).
absl::Status BuildSwaStoreSlots(const SequenceBatch& batch,
                                const SwaParams& params,
                                absl::Span<int32_t> slots);

// Sum of seqlen_q, validated to fit int32 (the row count of a chunk).
absl::StatusOr<int32_t> TotalQueries(const SequenceBatch& batch);

}  // namespace kvdepot

#endif  // KVDEPOT_PLANNER_SEQUENCE_PLANS_H_
