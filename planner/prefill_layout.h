// The prefill KV buffer (SPEC §6) and the SWA pivots of its query rows
// (SPEC §7). One buffer of total_rows rows holds, in order:
//
//   row 0                    swa_history_rows   main_kv_offset   total_rows
//   | SWA history            | this chunk        | compressed       |
//   | num_seqs x W rows:     | sum seqlen_q rows | sum of the       |
//   | sequence b owns        | sequence b owns   | compressed plan  |
//   | [b*W, (b+1)*W), i.e.   | [H + cu_q[b],     | rows (>= 1 per   |
//   | positions [he-W, he)   |  H + cu_q[b+1])   | sequence)        |
//
// where he = seqlen_k - seqlen_q is the end of the history and H =
// swa_history_rows. Load the SWA history before storing this chunk's SWA
// K/V: the store may overwrite ring slots that the load reads.
#ifndef KVDEPOT_PLANNER_PREFILL_LAYOUT_H_
#define KVDEPOT_PLANNER_PREFILL_LAYOUT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "planner/batch.h"

namespace kvdepot {

struct PrefillLayout {
  int32_t window = 0;            // W, 0 when the layer has no SWA
  int32_t swa_history_rows = 0;  // total_k_swa = num_seqs * W
  int32_t chunk_rows = 0;        // sum of seqlen_q
  int32_t compressed_rows = 0;   // sum of max(seqlen_k / ratio, 1), or 0
  int32_t main_kv_offset = 0;    // swa_history_rows + chunk_rows
  int32_t total_rows = 0;        // main_kv_offset + compressed_rows
};

// Sizes the buffer. window = 0: no SWA part; ratio = 0: no compressed part.
// Errors: negative window or ratio, invalid lengths (see ValidateLengths),
// or a total beyond the int32 row range.
absl::StatusOr<PrefillLayout> ComputePrefillLayout(const SequenceBatch& batch,
                                                   int32_t window,
                                                   int32_t ratio);

// The SWA pivots of every query row. Query j of sequence b sits at position
// p = he + j and sees keys max(p - W + 1, swa_valid_start[b]) .. p: the ones
// before he are history rows, the rest are this chunk's rows, in position
// order.
//   pivots: [chunk_rows][4] out, flattened; {off1, len1, off2, len2} with
//           len1 + len2 <= W (zero lengths come with offset 0).
// REQUIRES: `layout` is ComputePrefillLayout(batch, W, ...) with W > 0.
// Reads seqlen_k, seqlen_q and swa_valid_start.
absl::Status ComputeSwaPivots(const SequenceBatch& batch,
                              const PrefillLayout& layout,
                              absl::Span<int32_t> pivots);

}  // namespace kvdepot

#endif  // KVDEPOT_PLANNER_PREFILL_LAYOUT_H_
