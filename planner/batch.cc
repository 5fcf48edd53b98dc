#include "planner/batch.h"

#include <limits>
#include <string>

#include "absl/numeric/int128.h"
#include "absl/strings/str_cat.h"

namespace kvdepot {

absl::Status CheckSize(absl::string_view name, size_t actual,
                       int64_t expected) {
  if (static_cast<int64_t>(actual) != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " has ", actual, " entries, expected ", expected));
  }
  return absl::OkStatus();
}

absl::Status BlockTableView::Validate(int64_t min_rows) const {
  if (num_rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_table num_rows = ", num_rows, " is negative"));
  }
  if (num_rows < min_rows) {
    return absl::InvalidArgumentError(absl::StrCat("block_table has ", num_rows,
                                                   " rows, fewer than the ",
                                                   min_rows, " sequences"));
  }
  if (num_cols < 0 || row_stride < num_cols) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_table num_cols = ", num_cols,
                     " is outside [0, row_stride = ", row_stride, "]"));
  }
  if (num_rows > 0) {
    // (num_rows - 1) * row_stride + num_cols in 128 bits: both counts are
    // untrusted int64 and the product overflows int64.
    const absl::int128 needed =
        absl::int128(num_rows - 1) * row_stride + num_cols;
    if (absl::int128(data.size()) < needed) {
      const std::string count = needed <= std::numeric_limits<int64_t>::max()
                                    ? absl::StrCat(static_cast<int64_t>(needed))
                                    : std::string("more than 2^63");
      return absl::InvalidArgumentError(absl::StrCat(
          "block_table data holds ", data.size(), " entries, fewer than the ",
          count, " that ", num_rows, " rows of stride ", row_stride, " need"));
    }
  }
  if (!row_lens.empty()) {
    absl::Status size =
        CheckSize("block_table row_lens", row_lens.size(), num_rows);
    if (!size.ok()) return size;
    for (int64_t b = 0; b < num_rows; ++b) {
      if (row_lens[b] < 0 || row_lens[b] > num_cols) {
        return absl::InvalidArgumentError(
            absl::StrCat("block_table row_lens[", b, "] = ", row_lens[b],
                         " is outside [0, ", num_cols, "]"));
      }
    }
  }
  return absl::OkStatus();
}

namespace {

// The length rules of sequence b.
absl::Status CheckLengths(const SequenceBatch& batch, int64_t b) {
  const int32_t k = batch.seqlen_k[b];
  const int32_t q = batch.seqlen_q[b];
  if (k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("seqlen_k[", b, "] = ", k, " is negative"));
  }
  if (q < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("seqlen_q[", b, "] = ", q, " is negative"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "seqlen_q[", b, "] = ", q, " exceeds seqlen_k[", b, "] = ", k));
}

}  // namespace

absl::StatusOr<int32_t> ValidateSwaBatch(const SequenceBatch& batch,
                                         int32_t num_states) {
  const int64_t n = batch.num_seqs();
  absl::Status s = CheckSize("seqlen_q", batch.seqlen_q.size(), n);
  if (!s.ok()) return s;
  s = CheckSize("state_ids", batch.state_ids.size(), n);
  if (!s.ok()) return s;
  const bool has_start = !batch.swa_valid_start.empty();
  if (has_start) {
    s = CheckSize("swa_valid_start", batch.swa_valid_start.size(), n);
    if (!s.ok()) return s;
  }
  int64_t total_q = 0;
  for (int64_t b = 0; b < n; ++b) {
    const int32_t k = batch.seqlen_k[b];
    const int32_t q = batch.seqlen_q[b];
    // One unsigned compare covers q < 0 and q > k (k < 0 fails it too).
    if (static_cast<uint32_t>(q) > static_cast<uint32_t>(k) || k < 0) {
      return CheckLengths(batch, b);
    }
    total_q += q;
    const int32_t id = batch.state_ids[b];
    if (static_cast<uint32_t>(id) >= static_cast<uint32_t>(num_states)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "state_ids[", b, "] = ", id, " is outside [0, ", num_states, ")"));
    }
    if (has_start && batch.swa_valid_start[b] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("swa_valid_start[", b, "] = ", batch.swa_valid_start[b],
                       " is negative"));
    }
  }
  if (total_q > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sum of seqlen_q = ", total_q, " exceeds the int32 row limit"));
  }
  return static_cast<int32_t>(total_q);
}

absl::Status ValidateLengths(const SequenceBatch& batch) {
  const int64_t n = batch.num_seqs();
  absl::Status size = CheckSize("seqlen_q", batch.seqlen_q.size(), n);
  if (!size.ok()) return size;
  for (int64_t b = 0; b < n; ++b) {
    const int32_t k = batch.seqlen_k[b];
    const int32_t q = batch.seqlen_q[b];
    if (k < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("seqlen_k[", b, "] = ", k, " is negative"));
    }
    if (q < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("seqlen_q[", b, "] = ", q, " is negative"));
    }
    if (q > k) {
      return absl::InvalidArgumentError(absl::StrCat(
          "seqlen_q[", b, "] = ", q, " exceeds seqlen_k[", b, "] = ", k));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateValidStart(const SequenceBatch& batch) {
  if (batch.swa_valid_start.empty()) return absl::OkStatus();
  const int64_t n = batch.num_seqs();
  absl::Status size =
      CheckSize("swa_valid_start", batch.swa_valid_start.size(), n);
  if (!size.ok()) return size;
  for (int64_t b = 0; b < n; ++b) {
    if (batch.swa_valid_start[b] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("swa_valid_start[", b, "] = ", batch.swa_valid_start[b],
                       " is negative"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateSwaInputs(const SequenceBatch& batch, int32_t num_states) {
  const int64_t n = batch.num_seqs();
  absl::Status s = CheckSize("state_ids", batch.state_ids.size(), n);
  if (!s.ok()) return s;
  for (int64_t b = 0; b < n; ++b) {
    const int32_t id = batch.state_ids[b];
    if (id < 0 || id >= num_states) {
      return absl::InvalidArgumentError(absl::StrCat(
          "state_ids[", b, "] = ", id, " is outside [0, ", num_states, ")"));
    }
  }
  return ValidateValidStart(batch);
}

}  // namespace kvdepot
