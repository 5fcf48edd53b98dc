// The index RPCs (SPEC §7) on host arrays through the planner: ConvertTopk,
// SwaDecodeIndex and PrefillIndex. Nothing touches a pool's bytes; the pools
// only supply block sizes and counts.
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "proto/wire.h"
#include "server/request_checks.h"
#include "server/service.h"

namespace kvdepot {
namespace {

struct IndexScratch {
  std::vector<int32_t> a, b, c, d, e, f;
};

IndexScratch& ThreadIndexScratch() {
  thread_local IndexScratch scratch;
  return scratch;
}

absl::Status CheckDim(absl::string_view field, int64_t v, int64_t lo) {
  if (v < lo || v > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " = ", v, " is outside [", lo, ", 2^31)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status KVCacheService::DoConvertTopk(const Caller& caller,
                                           const v1::ConvertTopkRequest& r,
                                           v1::ConvertTopkResponse* out) {
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      UsablePool(caller, "pool", r.pool());
  if (!pool.ok()) return pool.status();
  const PoolLayout& l = (*pool)->layout;
  IndexScratch& sc = ThreadIndexScratch();
  const int64_t max = options_.max_array_elements;
  absl::Status s = CheckDim("batch", r.batch(), 1);
  if (s.ok()) s = CheckDim("k", r.k(), 0);
  if (s.ok()) s = CheckDim("max_blocks_per_seq", r.max_blocks_per_seq(), 1);
  if (s.ok()) {
    s = DecodeInt32s("topk", r.topk(), "batch * k", r.batch() * r.k(), max,
                     &sc.a);
  }
  if (s.ok()) {
    s = DecodeInt32s("valid_count", r.valid_count(), "batch", r.batch(), max,
                     &sc.b);
  }
  if (s.ok()) {
    s = DecodeInt32s("num_tokens", r.num_tokens(), "batch", r.batch(), max,
                     &sc.c);
  }
  if (s.ok()) {
    s = DecodeInt32s("block_table", r.block_table(),
                     "batch * max_blocks_per_seq",
                     r.batch() * r.max_blocks_per_seq(), max, &sc.d);
  }
  if (!s.ok()) return s;
  absl::StatusOr<int64_t> invalid = kvdepot::ConvertTopk(
      absl::MakeSpan(sc.a), static_cast<int32_t>(r.k()), sc.b, sc.c,
      DenseTable(sc.d, r.batch(), r.max_blocks_per_seq()),
      static_cast<int32_t>(l.block_size), static_cast<int32_t>(l.num_blocks));
  if (!invalid.ok()) return invalid.status();
  EncodeInt32s(sc.a, out->mutable_slots());
  out->set_invalid_count(*invalid);
  return absl::OkStatus();
}

absl::Status KVCacheService::DoSwaDecodeIndex(
    const Caller& caller, const v1::SwaDecodeIndexRequest& r,
    v1::SwaDecodeIndexResponse* out) {
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      UsablePool(caller, "pool", r.pool());
  if (!pool.ok()) return pool.status();
  const PoolLayout& l = (*pool)->layout;
  IndexScratch& sc = ThreadIndexScratch();
  const int64_t max = options_.max_array_elements;
  // Bounded on both sides before 3 * num_queries (a negative count wrapped
  // to a small positive one, then resize() threw: UNKNOWN).
  if (r.num_queries() < 0 || r.num_queries() > max / 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_queries = ", r.num_queries(), " is outside [0, ", max / 3, "]"));
  }
  RETURN_IF_ERROR(DecodeInt32s("queries", r.queries(), "3 * num_queries",
                               3 * r.num_queries(), max, &sc.a));
  SwaParams params;
  params.window = r.window();
  params.ring_size = static_cast<int32_t>(l.block_size);
  params.num_states = static_cast<int32_t>(l.num_blocks);
  RETURN_IF_ERROR(ValidateSwaParams(params));
  if (r.num_queries() * r.window() > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_queries * window = ", r.num_queries() * r.window(),
                     " exceeds ", max));
  }
  const size_t n = static_cast<size_t>(r.num_queries());
  sc.b.resize(n);
  sc.c.resize(n);
  sc.d.resize(n);
  for (size_t i = 0; i < n; ++i) {
    sc.b[i] = sc.a[3 * i];
    sc.c[i] = sc.a[3 * i + 1];
    sc.d[i] = sc.a[3 * i + 2];
  }
  sc.e.assign(n * static_cast<size_t>(r.window()), -1);
  RETURN_IF_ERROR(
      ExpandSwaDecodeIndex(sc.b, sc.c, sc.d, params, absl::MakeSpan(sc.e)));
  EncodeInt32s(sc.e, out->mutable_slots());
  return absl::OkStatus();
}

absl::Status KVCacheService::DoPrefillIndex(const v1::PrefillIndexRequest& r,
                                            v1::PrefillIndexResponse* out) {
  IndexScratch& sc = ThreadIndexScratch();
  const int64_t max = options_.max_array_elements;
  const int64_t n = r.num_seqs();
  absl::Status s = CheckDim("num_seqs", n, 1);
  if (s.ok() && r.window() < 1) {
    s = absl::InvalidArgumentError(
        absl::StrCat("window = ", r.window(), " must be >= 1"));
  }
  if (s.ok() && r.compress_ratio() < 1) {
    s = absl::InvalidArgumentError(
        absl::StrCat("compress_ratio = ", r.compress_ratio(), " must be >= 1"));
  }
  if (s.ok()) s = CheckDim("topk_k", r.topk_k(), 0);
  if (s.ok())
    s = DecodeInt32s("seqlen_k", r.seqlen_k(), "num_seqs", n, max, &sc.a);
  if (s.ok())
    s = DecodeInt32s("seqlen_q", r.seqlen_q(), "num_seqs", n, max, &sc.b);
  if (s.ok()) {
    s = DecodeInt32s("swa_valid_start", r.swa_valid_start(),
                     r.swa_valid_start().empty() ? "0 (empty)" : "num_seqs",
                     r.swa_valid_start().empty() ? 0 : n, max, &sc.c);
  }
  if (!s.ok()) return s;
  SequenceBatch batch;
  batch.seqlen_k = sc.a;
  batch.seqlen_q = sc.b;
  batch.swa_valid_start = sc.c;
  absl::StatusOr<PrefillLayout> pl =
      ComputePrefillLayout(batch, r.window(), r.compress_ratio());
  if (!pl.ok()) return pl.status();
  const int64_t rows = pl->chunk_rows;
  const int64_t width = r.window() + r.topk_k();
  if (rows * width > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("sum(seqlen_q) * (window + topk_k) = ", rows * width,
                     " exceeds ", max));
  }
  if (s = DecodeInt32s("compressed_index", r.compressed_index(),
                       "sum(seqlen_q) * topk_k", rows * r.topk_k(), max, &sc.d);
      !s.ok()) {
    return s;
  }
  sc.e.assign(static_cast<size_t>(rows * kPivotFields), 0);
  if (s = ComputeSwaPivots(batch, *pl, absl::MakeSpan(sc.e)); !s.ok()) return s;
  sc.f.assign(static_cast<size_t>(rows * r.window()), -1);
  if (s = ExpandSwaIndex(sc.e, r.window(), pl->main_kv_offset,
                         absl::MakeSpan(sc.f));
      !s.ok()) {
    return s;
  }
  std::vector<int32_t> index(static_cast<size_t>(rows * width), -1);
  if (s = KvIndexCat(sc.f, r.window(), sc.d, static_cast<int32_t>(r.topk_k()),
                     rows, pl->main_kv_offset, pl->compressed_rows,
                     absl::MakeSpan(index));
      !s.ok()) {
    return s;
  }
  EncodeInt32s(index, out->mutable_index());
  out->set_row_width(width);
  out->set_main_kv_offset(pl->main_kv_offset);
  out->set_total_rows(pl->total_rows);
  return absl::OkStatus();
}

}  // namespace kvdepot
