#include "planner/sequence_plans.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace kvdepot {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// First position of the SWA history window of sequence b (may be negative).
int64_t HistoryBegin(const SequenceBatch& batch, int64_t b, int32_t window) {
  return static_cast<int64_t>(batch.seqlen_k[b]) - batch.seqlen_q[b] - window;
}

}  // namespace

absl::Status ValidateCompressedParams(const CompressedParams& params) {
  if (params.block_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_size = ", params.block_size, " must be positive"));
  }
  if (params.ratio <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ratio = ", params.ratio, " must be positive"));
  }
  if (params.block_size % params.ratio != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ratio = ", params.ratio,
                     " does not divide block_size = ", params.block_size));
  }
  if (params.num_blocks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_blocks = ", params.num_blocks, " must be positive"));
  }
  return absl::OkStatus();
}

absl::Status ValidateSwaParams(const SwaParams& params) {
  if (params.ring_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring_size = ", params.ring_size, " must be positive"));
  }
  if (params.window <= 0 || params.window > params.ring_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("window = ", params.window,
                     " is outside [1, ring_size = ", params.ring_size, "]"));
  }
  if (params.num_states <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_states = ", params.num_states, " must be positive"));
  }
  if (static_cast<int64_t>(params.num_states) * params.ring_size > kInt32Max) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_states = ", params.num_states, " rings of ",
                     params.ring_size, " slots exceed the int32 slot range"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int32_t> TotalQueries(const SequenceBatch& batch) {
  int64_t total = 0;
  for (const int32_t q : batch.seqlen_q) total += q;
  if (total > kInt32Max) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sum of seqlen_q = ", total, " exceeds the int32 row limit"));
  }
  return static_cast<int32_t>(total);
}

absl::Status BuildCompressedPlan(const SequenceBatch& batch,
                                 const CompressedParams& params,
                                 BlockLoadPlanBuilder* builder,
                                 absl::Span<int32_t> cu_compressed) {
  absl::Status s = ValidateCompressedParams(params);
  if (!s.ok()) return s;
  const int64_t n = batch.num_seqs();
  s = CheckSize("cu_compressed", cu_compressed.size(), n + 1);
  if (!s.ok()) return s;
  s = batch.block_table.Validate(n);
  if (!s.ok()) return s;
  const int32_t bs = params.source_block_size();
  int64_t total = 0;
  int64_t num_segments = 0;
  for (int64_t b = 0; b < n; ++b) {
    const int32_t k = batch.seqlen_k[b];
    if (k < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("seqlen_k[", b, "] = ", k, " is negative"));
    }
    const int32_t tokens = k / params.ratio;
    const int64_t blocks = (static_cast<int64_t>(tokens) + bs - 1) / bs;
    const absl::Span<const int32_t> row = batch.block_table.Row(b);
    if (blocks > static_cast<int64_t>(row.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block_table[", b, "] holds ", row.size(), " blocks, fewer than the ",
          blocks, " that seqlen_k[", b, "] = ", k, " needs (", tokens,
          " compressed tokens, ", bs, " per block)"));
    }
    for (int64_t i = 0; i < blocks; ++i) {
      if (row[i] < 0 || row[i] >= params.num_blocks) {
        return absl::InvalidArgumentError(
            absl::StrCat("block_table[", b, "][", i, "] = ", row[i],
                         " is outside [0, ", params.num_blocks, ")"));
      }
    }
    total += params.RowsFor(k);
    num_segments += tokens == 0 ? 1 : blocks;
  }
  if (total > kInt32Max) {
    return absl::InvalidArgumentError(absl::StrCat(
        "compressed plan of ", total, " rows exceeds the int32 row limit"));
  }

  builder->Reset(bs, params.num_blocks);
  builder->Reserve(num_segments);
  cu_compressed[0] = 0;
  for (int64_t b = 0; b < n; ++b) {
    const int32_t tokens = batch.seqlen_k[b] / params.ratio;
    s = tokens == 0
            ? builder->AppendZeroFill(1)
            : builder->AppendPagedRange(batch.block_table.Row(b), 0, tokens);
    if (!s.ok()) return s;  // unreachable: validated above
    cu_compressed[b + 1] = builder->total_k();
  }
  return absl::OkStatus();
}

absl::Status BuildSwaPlan(const SequenceBatch& batch, const SwaParams& params,
                          BlockLoadPlanBuilder* builder) {
  absl::Status s = ValidateSwaParams(params);
  if (!s.ok()) return s;
  absl::StatusOr<int32_t> total_q = ValidateSwaBatch(batch, params.num_states);
  if (!total_q.ok()) return total_q.status();
  const int64_t n = batch.num_seqs();
  const int32_t w = params.window;
  if (n * w > kInt32Max) {
    return absl::InvalidArgumentError(
        absl::StrCat("SWA plan of ", n, " sequences x window ", w,
                     " rows exceeds the int32 row limit"));
  }

  builder->Reset(params.ring_size, params.num_states);
  builder->Reserve(3 * n);
  for (int64_t b = 0; b < n; ++b) {
    const int64_t begin = HistoryBegin(batch, b, w);
    const int32_t padding = static_cast<int32_t>(
        std::clamp<int64_t>(batch.valid_start(b) - begin, 0, w));
    s = builder->AppendZeroFill(padding);
    if (!s.ok()) return s;  // unreachable: validated above
    s = builder->AppendRingRange(batch.state_ids[b],
                                 static_cast<int32_t>(begin + padding),
                                 static_cast<int32_t>(begin + w));
    if (!s.ok()) return s;  // unreachable: validated above
  }
  return absl::OkStatus();
}

absl::Status BuildSwaStoreSlots(const SequenceBatch& batch,
                                const SwaParams& params,
                                absl::Span<int32_t> slots) {
  absl::Status s = ValidateSwaParams(params);
  if (!s.ok()) return s;
  absl::StatusOr<int32_t> total_q = ValidateSwaBatch(batch, params.num_states);
  if (!total_q.ok()) return total_q.status();
  s = CheckSize("slots", slots.size(), *total_q);
  if (!s.ok()) return s;

  const int32_t ring = params.ring_size;
  int32_t* out = slots.data();
  for (int64_t b = 0; b < batch.num_seqs(); ++b) {
    const int32_t q = batch.seqlen_q[b];
    const int32_t base = batch.state_ids[b] * ring;
    // Tokens j < q - ring are overwritten by later tokens of the chunk.
    const int32_t skipped = std::max(q - ring, 0);
    std::fill(out, out + skipped, -1);
    // seqlen_k - q + skipped is in [0, seqlen_k]: 32-bit arithmetic.
    int32_t offset = (batch.seqlen_k[b] - q + skipped) % ring;
    for (int32_t j = skipped; j < q; ++j) {
      out[j] = base + offset;
      if (++offset == ring) offset = 0;
    }
    out += q;
  }
  return absl::OkStatus();
}

}  // namespace kvdepot
