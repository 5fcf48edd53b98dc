#include "planner/prefill_layout.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace kvdepot {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

}  // namespace

absl::StatusOr<PrefillLayout> ComputePrefillLayout(const SequenceBatch& batch,
                                                   int32_t window,
                                                   int32_t ratio) {
  if (window < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("window = ", window, " is negative"));
  }
  if (ratio < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ratio = ", ratio, " is negative"));
  }
  absl::Status s = ValidateLengths(batch);
  if (!s.ok()) return s;
  const int64_t n = batch.num_seqs();
  const int64_t history = n * window;
  int64_t chunk = 0;
  int64_t compressed = 0;
  for (int64_t b = 0; b < n; ++b) {
    chunk += batch.seqlen_q[b];
    if (ratio > 0) compressed += std::max(batch.seqlen_k[b] / ratio, 1);
  }
  const int64_t total = history + chunk + compressed;
  if (total > kInt32Max) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill buffer of ", total, " rows (", history,
                     " SWA history + ", chunk, " chunk + ", compressed,
                     " compressed) exceeds the int32 row limit"));
  }
  PrefillLayout layout;
  layout.window = window;
  layout.swa_history_rows = static_cast<int32_t>(history);
  layout.chunk_rows = static_cast<int32_t>(chunk);
  layout.compressed_rows = static_cast<int32_t>(compressed);
  layout.main_kv_offset = static_cast<int32_t>(history + chunk);
  layout.total_rows = static_cast<int32_t>(total);
  return layout;
}

absl::Status ComputeSwaPivots(const SequenceBatch& batch,
                              const PrefillLayout& layout,
                              absl::Span<int32_t> pivots) {
  const int64_t n = batch.num_seqs();
  const int32_t w = layout.window;
  if (w <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout window = ", w, " must be positive for pivots"));
  }
  absl::Status s = ValidateLengths(batch);
  if (!s.ok()) return s;
  s = ValidateValidStart(batch);
  if (!s.ok()) return s;
  int64_t chunk = 0;
  for (int64_t b = 0; b < n; ++b) chunk += batch.seqlen_q[b];
  if (layout.swa_history_rows != n * w || layout.chunk_rows != chunk) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout (", layout.swa_history_rows, " history rows, ",
        layout.chunk_rows, " chunk rows) does not match the batch (", n * w,
        ", ", chunk, ")"));
  }
  s = CheckSize("pivots", pivots.size(), chunk * kPivotFields);
  if (!s.ok()) return s;

  int32_t* out = pivots.data();
  int64_t chunk_base = layout.swa_history_rows;  // first row of sequence b
  for (int64_t b = 0; b < n; ++b) {
    const int32_t q = batch.seqlen_q[b];
    const int64_t he = static_cast<int64_t>(batch.seqlen_k[b]) - q;
    const int64_t history_base = b * w - (he - w);  // row of position x: +x
    const int64_t vs = batch.valid_start(b);
    for (int32_t j = 0; j < q; ++j, out += kPivotFields) {
      const int64_t p = he + j;
      const int64_t lo = std::max(p - w + 1, vs);
      int64_t off1 = 0, len1 = 0, off2 = 0, len2 = 0;
      if (lo < he) {  // history part, then the chunk up to p
        off1 = history_base + lo;
        len1 = he - lo;
        off2 = chunk_base;
        len2 = j + 1;
      } else if (lo <= p) {  // only this chunk's rows
        off1 = chunk_base + (lo - he);
        len1 = p - lo + 1;
      }
      out[0] = static_cast<int32_t>(off1);
      out[1] = static_cast<int32_t>(len1);
      out[2] = static_cast<int32_t>(off2);
      out[3] = static_cast<int32_t>(len2);
    }
    chunk_base += q;
  }
  return absl::OkStatus();
}

}  // namespace kvdepot
