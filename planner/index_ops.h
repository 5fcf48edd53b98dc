// Prefill index operations of SPEC §7, on host arrays. Each validates all of
// its inputs first; on error nothing is written and the status is
// INVALID_ARGUMENT naming the field and index.
#ifndef KVDEPOT_PLANNER_INDEX_OPS_H_
#define KVDEPOT_PLANNER_INDEX_OPS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvdepot {

// Dense prefill SWA index from pivots (see ComputeSwaPivots):
//   pivots: [rows][4] {off1, len1, off2, len2}; lengths >= 0,
//           len1 + len2 <= width, each range inside [0, num_kv_rows)
//   out:    [rows][width]; column c = off1 + c for c < len1,
//           off2 + (c - len1) for c < len1 + len2, else -1.
absl::Status ExpandSwaIndex(absl::Span<const int32_t> pivots, int32_t width,
                            int32_t num_kv_rows, absl::Span<int32_t> out);

// Concatenates the SWA and compressed indices of each query row:
//   swa_index:        [rows][swa_width]; entries in [-1, main_kv_offset)
//   compressed_index: [rows][compressed_width]; entries in
//                     [-1, compressed_rows), -1 = masked
//   out:              [rows][swa_width + compressed_width]; the SWA entries
//                     as they are, then every compressed entry other than
//                     -1 shifted by main_kv_offset.
absl::Status KvIndexCat(absl::Span<const int32_t> swa_index, int32_t swa_width,
                        absl::Span<const int32_t> compressed_index,
                        int32_t compressed_width, int64_t rows,
                        int32_t main_kv_offset, int32_t compressed_rows,
                        absl::Span<int32_t> out);

}  // namespace kvdepot

#endif  // KVDEPOT_PLANNER_INDEX_OPS_H_
