#include "planner/decode_index.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace kvdepot {
namespace {

// Writes one SWA decode row: `len` ring slots from position `start`, then
// -1 up to the window.
void WriteRingRow(int32_t base, int32_t start, int32_t len, int32_t ring,
                  int32_t window, int32_t* row) {
  int32_t offset = start % ring;
  for (int32_t i = 0; i < len; ++i) {
    row[i] = base + offset;
    if (++offset == ring) offset = 0;
  }
  std::fill(row + len, row + window, -1);
}

}  // namespace

absl::StatusOr<int64_t> ConvertTopk(absl::Span<int32_t> topk, int32_t k,
                                    absl::Span<const int32_t> valid_count,
                                    absl::Span<const int32_t> num_tokens,
                                    const BlockTableView& block_table,
                                    int32_t block_size, int32_t num_blocks) {
  if (block_size <= 0 || num_blocks <= 0 ||
      static_cast<int64_t>(block_size) * num_blocks >
          std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_blocks = ", num_blocks, " of block_size = ", block_size,
        " must be positive and fit the int32 slot range"));
  }
  if (k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("k = ", k, " is negative"));
  }
  const int64_t n = static_cast<int64_t>(valid_count.size());
  absl::Status s = CheckSize("num_tokens", num_tokens.size(), n);
  if (!s.ok()) return s;
  s = CheckSize("topk", topk.size(), n * k);
  if (!s.ok()) return s;
  s = block_table.Validate(n);
  if (!s.ok()) return s;
  for (int64_t b = 0; b < n; ++b) {
    if (valid_count[b] < 0 || valid_count[b] > k) {
      return absl::InvalidArgumentError(
          absl::StrCat("valid_count[", b, "] = ", valid_count[b],
                       " is outside [0, ", k, "]"));
    }
    if (num_tokens[b] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "num_tokens[", b, "] = ", num_tokens[b], " is negative"));
    }
  }

  int64_t invalid = 0;
  for (int64_t b = 0; b < n; ++b) {
    const absl::Span<const int32_t> row = block_table.Row(b);
    // Past this index the block is beyond the row or the sequence.
    const int64_t limit = std::min<int64_t>(
        num_tokens[b], static_cast<int64_t>(row.size()) * block_size);
    // data() + offset: with k = 0 the span is empty and has no element 0.
    int32_t* entries = topk.data() + b * k;
    const int32_t count = valid_count[b];
    for (int32_t c = 0; c < count; ++c) {
      const int32_t x = entries[c];
      if (x < 0 || x >= limit) {
        entries[c] = -1;
        ++invalid;
        continue;
      }
      const int32_t id = row[x / block_size];
      if (id < 0 || id >= num_blocks) {
        entries[c] = -1;
        ++invalid;
        continue;
      }
      entries[c] = id * block_size + x % block_size;
    }
    std::fill(entries + count, entries + k, -1);
  }
  return invalid;
}

absl::Status ExpandSwaDecodeIndex(absl::Span<const int32_t> state_ids,
                                  absl::Span<const int32_t> starts,
                                  absl::Span<const int32_t> valid_lens,
                                  const SwaParams& params,
                                  absl::Span<int32_t> out) {
  absl::Status s = ValidateSwaParams(params);
  if (!s.ok()) return s;
  const int64_t n = static_cast<int64_t>(state_ids.size());
  const int32_t w = params.window;
  s = CheckSize("starts", starts.size(), n);
  if (!s.ok()) return s;
  s = CheckSize("valid_lens", valid_lens.size(), n);
  if (!s.ok()) return s;
  s = CheckSize("out", out.size(), n * w);
  if (!s.ok()) return s;
  for (int64_t i = 0; i < n; ++i) {
    if (state_ids[i] < 0 || state_ids[i] >= params.num_states) {
      return absl::InvalidArgumentError(
          absl::StrCat("state_ids[", i, "] = ", state_ids[i],
                       " is outside [0, ", params.num_states, ")"));
    }
    if (starts[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("starts[", i, "] = ", starts[i], " is negative"));
    }
    if (valid_lens[i] < 0 || valid_lens[i] > w) {
      return absl::InvalidArgumentError(
          absl::StrCat("valid_lens[", i, "] = ", valid_lens[i],
                       " is outside [0, window = ", w, "]"));
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    WriteRingRow(state_ids[i] * params.ring_size, starts[i], valid_lens[i],
                 params.ring_size, w, &out[i * w]);
  }
  return absl::OkStatus();
}

namespace {

// Checks the batch for the SWA decode functions and that the ring still
// holds every window; returns the total number of queries.
absl::StatusOr<int32_t> ValidateDecodeBatch(const SequenceBatch& batch,
                                            const SwaParams& params) {
  absl::Status s = ValidateSwaParams(params);
  if (!s.ok()) return s;
  absl::StatusOr<int32_t> total_q = ValidateSwaBatch(batch, params.num_states);
  if (!total_q.ok()) return total_q.status();
  const int32_t w = params.window;
  for (int64_t b = 0; b < batch.num_seqs(); ++b) {
    // Windows start no earlier as j grows: check the first non-empty one.
    const int64_t k = batch.seqlen_k[b];
    const int64_t p0 = k - batch.seqlen_q[b];
    const int64_t vs = batch.valid_start(b);
    const int64_t j = std::max<int64_t>(0, vs - p0);
    if (j >= batch.seqlen_q[b]) continue;
    const int64_t lo = std::max(p0 + j - w + 1, vs);
    if (lo < k - params.ring_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "seqlen_q[", b, "] = ", batch.seqlen_q[b], " with window ", w,
          ": query ", j, " sees position ", lo, " but a ring of ",
          params.ring_size, " slots holds only positions >= ",
          k - params.ring_size, " of seqlen_k[", b, "] = ", k));
    }
  }
  return total_q;
}

// Calls fn(query_row, state_id, start, valid_len) for every query.
template <typename Fn>
void ForEachDecodeWindow(const SequenceBatch& batch, int32_t window, Fn fn) {
  int64_t row = 0;
  for (int64_t b = 0; b < batch.num_seqs(); ++b) {
    const int64_t p0 =
        static_cast<int64_t>(batch.seqlen_k[b]) - batch.seqlen_q[b];
    const int64_t vs = batch.valid_start(b);
    const int32_t state = batch.state_ids[b];
    for (int32_t j = 0; j < batch.seqlen_q[b]; ++j, ++row) {
      const int64_t p = p0 + j;
      const int64_t lo = std::max(p - window + 1, vs);
      if (lo > p) {
        fn(row, state, 0, 0);
      } else {
        fn(row, state, static_cast<int32_t>(lo),
           static_cast<int32_t>(p - lo + 1));
      }
    }
  }
}

}  // namespace

absl::Status ComputeSwaDecodeWindows(const SequenceBatch& batch,
                                     const SwaParams& params,
                                     absl::Span<int32_t> state_ids,
                                     absl::Span<int32_t> starts,
                                     absl::Span<int32_t> valid_lens) {
  absl::StatusOr<int32_t> total_q = ValidateDecodeBatch(batch, params);
  if (!total_q.ok()) return total_q.status();
  absl::Status s = CheckSize("state_ids", state_ids.size(), *total_q);
  if (!s.ok()) return s;
  s = CheckSize("starts", starts.size(), *total_q);
  if (!s.ok()) return s;
  s = CheckSize("valid_lens", valid_lens.size(), *total_q);
  if (!s.ok()) return s;
  ForEachDecodeWindow(
      batch, params.window,
      [&](int64_t row, int32_t state, int32_t start, int32_t len) {
        state_ids[row] = state;
        starts[row] = start;
        valid_lens[row] = len;
      });
  return absl::OkStatus();
}

absl::Status BuildSwaDecodeIndex(const SequenceBatch& batch,
                                 const SwaParams& params,
                                 absl::Span<int32_t> out) {
  absl::StatusOr<int32_t> total_q = ValidateDecodeBatch(batch, params);
  if (!total_q.ok()) return total_q.status();
  const int32_t w = params.window;
  absl::Status s =
      CheckSize("out", out.size(), static_cast<int64_t>(*total_q) * w);
  if (!s.ok()) return s;
  const int32_t ring = params.ring_size;
  ForEachDecodeWindow(
      batch, w, [&](int64_t row, int32_t state, int32_t start, int32_t len) {
        WriteRingRow(state * ring, start, len, ring, w, &out[row * w]);
      });
  return absl::OkStatus();
}

}  // namespace kvdepot
