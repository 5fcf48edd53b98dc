// The index RPCs (SPEC §7): ConvertTopk, SwaDecodeIndex and PrefillIndex.
// Inline arrays are host copies, checked here in full; the buffer forms
// (kvdepot.proto) read and write shared buffers of the caller. With an
// operand in device memory the backend runs the kernels (ordered like
// Store/Load); otherwise the host computes the same result from one copy of
// each buffer (a client may change its buffer while the daemon reads it:
// every value is read once). Entries read from a buffer are checked as they
// are read (out of range -> -1, counted), exactly as the kernels do.
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "proto/wire.h"
#include "server/data_refs.h"
#include "server/reply_scope.h"
#include "server/request_checks.h"
#include "server/service.h"
#include "server/thread_scratch.h"

namespace kvdepot {
namespace {

// Per-thread scratch (server/thread_scratch.h).
struct IndexScratch {
  std::vector<int32_t> a, b, c, d, e, f;
};

int64_t HeldBytes(const IndexScratch& s) {
  return CapacityBytes(s.a, s.b, s.c, s.d, s.e, s.f);
}

absl::Status CheckDim(absl::string_view field, int64_t v, int64_t lo) {
  if (v < lo || v > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " = ", v, " is outside [", lo, ", 2^31)"));
  }
  return absl::OkStatus();
}

absl::Status CheckCount(absl::string_view what, int64_t count, int64_t max) {
  if (count > max) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " = ", count, " exceeds ", max));
  }
  return absl::OkStatus();
}

// GPU ordering needs the CUDA backend; record_event needs the output in a
// buffer (an inline reply is sent after the GPU finished anyway).
absl::Status CheckIndexOrdering(const Backend& backend, absl::string_view wait,
                                bool record, bool output_in_buffer,
                                absl::string_view output_field) {
  if (wait.empty() && !record) return absl::OkStatus();
  if (backend.name() != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat(
        wait.empty() ? "record_event" : "wait_event_ipc_handle",
        ": GPU ordering needs the cuda backend; this daemon runs the ",
        backend.name(), " backend, whose replies already mean \"done\""));
  }
  if (record && !output_in_buffer) {
    return absl::InvalidArgumentError(
        absl::StrCat("record_event needs ", output_field,
                     ": an inline reply is sent after the GPU finished"));
  }
  return absl::OkStatus();
}

// A slice `field` set in place of the packed bytes `bytes_field`.
absl::Status CheckOneOf(absl::string_view bytes_field, absl::string_view bytes,
                        absl::string_view field) {
  if (bytes.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(bytes_field, " holds ", bytes.size(), " bytes but ", field,
                   " is set: give the array inline or in a buffer, not both"));
}

// One copy of request memory (buffer or inline) into `out`.
absl::Status Snapshot(Backend& backend, const ByteRange& r,
                      std::vector<int32_t>* out) {
  out->resize(static_cast<size_t>(r.size / 4));
  return backend.CopyBytes(out->data(), r.data, r.size);
}

absl::Status WriteWord(Backend& backend, const ByteRange& r, int64_t v) {
  if (r.data == nullptr) return absl::OkStatus();
  uint8_t le[8];
  for (int i = 0; i < 8; ++i) le[i] = static_cast<uint8_t>(v >> (8 * i));
  return backend.CopyBytes(r.data, le, 8);
}

bool SameRange(const ByteRange& a, const ByteRange& b) {
  return a.buffer != nullptr && a.buffer == b.buffer && a.offset == b.offset &&
         a.size == b.size;
}

// Every pair of `outputs` x `others` (and outputs among themselves) is
// disjoint in shared buffers.
struct Named {
  absl::string_view field;
  const ByteRange* range;
};
absl::Status CheckOutputsDisjoint(absl::Span<const Named> outputs,
                                  absl::Span<const Named> inputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (size_t j = i + 1; j < outputs.size(); ++j) {
      RETURN_IF_ERROR(CheckDisjoint(outputs[i].field, *outputs[i].range,
                                    outputs[j].field, *outputs[j].range));
    }
    for (const Named& in : inputs) {
      RETURN_IF_ERROR(CheckDisjoint(outputs[i].field, *outputs[i].range,
                                    in.field, *in.range));
    }
  }
  return absl::OkStatus();
}

absl::Time DeadlineOf(const grpc::ServerContextBase* ctx) {
  return ctx == nullptr ? absl::InfiniteFuture()
                        : absl::FromChrono(ctx->deadline());
}

}  // namespace

absl::Status KVCacheService::DoConvertTopk(Ctx* ctx, const Caller& caller,
                                           const v1::ConvertTopkRequest& r,
                                           v1::ConvertTopkResponse* out) {
  RETURN_IF_ERROR(CheckIndexOrdering(*backend_, r.wait_event_ipc_handle(),
                                     r.record_event(), r.has_slots_buffer(),
                                     "slots_buffer"));
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      UsablePool(caller, "pool", r.pool());
  if (!pool.ok()) return pool.status();
  const PoolLayout& l = (*pool)->layout;
  ThreadScratch<IndexScratch> scratch;
  IndexScratch& sc = *scratch;
  const int64_t max = options_.max_array_elements;
  RETURN_IF_ERROR(CheckDim("batch", r.batch(), 1));
  RETURN_IF_ERROR(CheckDim("k", r.k(), 0));
  RETURN_IF_ERROR(CheckDim("max_blocks_per_seq", r.max_blocks_per_seq(), 1));
  const int64_t entries = r.batch() * r.k();
  const int64_t table_entries = r.batch() * r.max_blocks_per_seq();
  ByteRange topk, table, slots, word;
  if (r.has_topk_buffer()) {
    RETURN_IF_ERROR(CheckOneOf("topk", r.topk(), "topk_buffer"));
    RETURN_IF_ERROR(CheckCount("batch * k", entries, max));
    ASSIGN_OR_RETURN(topk, ResolveSlice(*sessions_, caller, "topk_buffer",
                                        r.topk_buffer(), entries * 4));
  } else {
    RETURN_IF_ERROR(
        DecodeInt32s("topk", r.topk(), "batch * k", entries, max, &sc.a));
    topk.data = reinterpret_cast<uint8_t*>(sc.a.data());
    topk.size = entries * 4;
  }
  RETURN_IF_ERROR(DecodeInt32s("valid_count", r.valid_count(), "batch",
                               r.batch(), max, &sc.b));
  RETURN_IF_ERROR(DecodeInt32s("num_tokens", r.num_tokens(), "batch", r.batch(),
                               max, &sc.c));
  for (size_t b = 0; b < sc.b.size(); ++b) {
    if (sc.b[b] < 0 || sc.b[b] > r.k()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "valid_count[", b, "] = ", sc.b[b], " is outside [0, ", r.k(), "]"));
    }
    if (sc.c[b] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("num_tokens[", b, "] = ", sc.c[b], " is negative"));
    }
  }
  if (r.has_block_table_buffer()) {
    RETURN_IF_ERROR(
        CheckOneOf("block_table", r.block_table(), "block_table_buffer"));
    RETURN_IF_ERROR(
        CheckCount("batch * max_blocks_per_seq", table_entries, max));
    ASSIGN_OR_RETURN(table,
                     ResolveSlice(*sessions_, caller, "block_table_buffer",
                                  r.block_table_buffer(), table_entries * 4));
  } else {
    RETURN_IF_ERROR(DecodeInt32s("block_table", r.block_table(),
                                 "batch * max_blocks_per_seq", table_entries,
                                 max, &sc.d));
    table.data = reinterpret_cast<uint8_t*>(sc.d.data());
    table.size = table_entries * 4;
  }
  if (r.has_slots_buffer()) {
    ASSIGN_OR_RETURN(slots, ResolveSlice(*sessions_, caller, "slots_buffer",
                                         r.slots_buffer(), entries * 4));
  }
  if (r.has_invalid_count_buffer()) {
    ASSIGN_OR_RETURN(word,
                     ResolveSlice(*sessions_, caller, "invalid_count_buffer",
                                  r.invalid_count_buffer(), 8));
  }
  // slots_buffer may be topk_buffer itself (in place), nothing else.
  const bool in_place = SameRange(slots, topk);
  const Named outs[] = {{"slots_buffer", &slots},
                        {"invalid_count_buffer", &word}};
  const Named ins[] = {{"block_table_buffer", &table}, {"topk_buffer", &topk}};
  RETURN_IF_ERROR(
      CheckOutputsDisjoint(outs, absl::MakeConstSpan(ins, in_place ? 1 : 2)));

  if (!slots.buffer) {
    RETURN_IF_ERROR(ReplyScope::Reserve(BudgetClientOf(caller), entries * 4,
                                        "slots (inline reply)"));
  }
  const GpuOrdering ordering{r.wait_event_ipc_handle(), r.record_event(),
                             caller.session};
  if (topk.buffer || table.buffer || slots.buffer || word.buffer) {
    ConvertTopkCall call;
    call.topk = reinterpret_cast<const int32_t*>(topk.data);
    call.slots = reinterpret_cast<int32_t*>(slots.data);
    if (!slots.buffer) {
      out->mutable_slots()->assign(static_cast<size_t>(entries * 4), '\0');
      call.slots = reinterpret_cast<int32_t*>(out->mutable_slots()->data());
    }
    call.batch = r.batch();
    call.k = static_cast<int32_t>(r.k());
    call.valid_count = sc.b;
    call.num_tokens = sc.c;
    call.block_table = reinterpret_cast<const int32_t*>(table.data);
    call.cols = static_cast<int32_t>(r.max_blocks_per_seq());
    call.block_size = static_cast<int32_t>(l.block_size);
    call.num_blocks = static_cast<int32_t>(l.num_blocks);
    call.invalid_word = word.data;
    RETURN_IF_ERROR(CheckAlive(ctx));
    int64_t invalid = 0;
    const absl::Status s = backend_->ConvertTopkOrdered(
        *(*pool)->memory, call, ordering, DeadlineOf(ctx), &invalid,
        out->mutable_recorded_event_ipc_handle());
    if (s.ok()) out->set_invalid_count(invalid);
    if (!absl::IsUnimplemented(s)) return s;
    out->clear_slots();
  }
  // On the host: one copy of each buffer, the planner's semantics (an
  // index or table entry out of range becomes -1 and is counted).
  RETURN_IF_ERROR(backend_->AwaitClientEvent(
      *(*pool)->memory, r.wait_event_ipc_handle(), DeadlineOf(ctx)));
  if (topk.buffer) RETURN_IF_ERROR(Snapshot(*backend_, topk, &sc.a));
  if (table.buffer) RETURN_IF_ERROR(Snapshot(*backend_, table, &sc.d));
  absl::StatusOr<int64_t> invalid = kvdepot::ConvertTopk(
      absl::MakeSpan(sc.a), static_cast<int32_t>(r.k()), sc.b, sc.c,
      DenseTable(sc.d, r.batch(), r.max_blocks_per_seq()),
      static_cast<int32_t>(l.block_size), static_cast<int32_t>(l.num_blocks));
  if (!invalid.ok()) return invalid.status();
  if (slots.buffer) {
    RETURN_IF_ERROR(backend_->CopyBytes(slots.data, sc.a.data(), slots.size));
  } else {
    EncodeInt32s(sc.a, out->mutable_slots());
  }
  RETURN_IF_ERROR(WriteWord(*backend_, word, *invalid));
  out->set_invalid_count(*invalid);
  return absl::OkStatus();
}

absl::Status KVCacheService::DoSwaDecodeIndex(
    Ctx* ctx, const Caller& caller, const v1::SwaDecodeIndexRequest& r,
    v1::SwaDecodeIndexResponse* out) {
  RETURN_IF_ERROR(CheckIndexOrdering(*backend_, r.wait_event_ipc_handle(),
                                     r.record_event(), r.has_slots_buffer(),
                                     "slots_buffer"));
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      UsablePool(caller, "pool", r.pool());
  if (!pool.ok()) return pool.status();
  const PoolLayout& l = (*pool)->layout;
  ThreadScratch<IndexScratch> scratch;
  IndexScratch& sc = *scratch;
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
  // Validates every query (the planner's checks) before anything is queued.
  RETURN_IF_ERROR(
      ExpandSwaDecodeIndex(sc.b, sc.c, sc.d, params, absl::MakeSpan(sc.e)));
  const int64_t out_bytes = static_cast<int64_t>(sc.e.size()) * 4;
  if (!r.has_slots_buffer()) {
    RETURN_IF_ERROR(ReplyScope::Reserve(BudgetClientOf(caller), out_bytes,
                                        "slots (inline reply)"));
    RETURN_IF_ERROR(backend_->AwaitClientEvent(
        *(*pool)->memory, r.wait_event_ipc_handle(), DeadlineOf(ctx)));
    EncodeInt32s(sc.e, out->mutable_slots());
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(ByteRange slots,
                   ResolveSlice(*sessions_, caller, "slots_buffer",
                                r.slots_buffer(), out_bytes));
  SwaDecodeCall call;
  call.queries = sc.a;
  call.window = r.window();
  call.ring_size = params.ring_size;
  call.slots = reinterpret_cast<int32_t*>(slots.data);
  RETURN_IF_ERROR(CheckAlive(ctx));
  const GpuOrdering ordering{r.wait_event_ipc_handle(), r.record_event(),
                             caller.session};
  const absl::Status s = backend_->SwaDecodeOrdered(
      *(*pool)->memory, call, ordering, DeadlineOf(ctx),
      out->mutable_recorded_event_ipc_handle());
  if (!absl::IsUnimplemented(s)) return s;
  RETURN_IF_ERROR(backend_->AwaitClientEvent(
      *(*pool)->memory, r.wait_event_ipc_handle(), DeadlineOf(ctx)));
  return backend_->CopyBytes(slots.data, sc.e.data(), out_bytes);
}

absl::Status KVCacheService::DoPrefillIndex(Ctx* ctx, const Caller& caller,
                                            const v1::PrefillIndexRequest& r,
                                            v1::PrefillIndexResponse* out) {
  RETURN_IF_ERROR(CheckIndexOrdering(*backend_, r.wait_event_ipc_handle(),
                                     r.record_event(), r.has_index_buffer(),
                                     "index_buffer"));
  ThreadScratch<IndexScratch> scratch;
  IndexScratch& sc = *scratch;
  const int64_t max = options_.max_array_elements;
  const int64_t n = r.num_seqs();
  RETURN_IF_ERROR(CheckDim("num_seqs", n, 1));
  // window 0: no SWA part (rows are the compressed index only); ratio 0:
  // no compressed part (every compressed entry must be -1). Not both.
  if (r.window() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("window = ", r.window(), " must be >= 0"));
  }
  if (r.compress_ratio() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("compress_ratio = ", r.compress_ratio(), " must be >= 0"));
  }
  if (r.window() == 0 && r.compress_ratio() == 0) {
    return absl::InvalidArgumentError(
        "window = 0 and compress_ratio = 0: the layer has neither an SWA nor "
        "a compressed part");
  }
  RETURN_IF_ERROR(CheckDim("topk_k", r.topk_k(), 0));
  RETURN_IF_ERROR(
      DecodeInt32s("seqlen_k", r.seqlen_k(), "num_seqs", n, max, &sc.a));
  RETURN_IF_ERROR(
      DecodeInt32s("seqlen_q", r.seqlen_q(), "num_seqs", n, max, &sc.b));
  RETURN_IF_ERROR(
      DecodeInt32s("swa_valid_start", r.swa_valid_start(),
                   r.swa_valid_start().empty() ? "0 (empty)" : "num_seqs",
                   r.swa_valid_start().empty() ? 0 : n, max, &sc.c));
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
  const int64_t comp_entries = rows * r.topk_k();
  ByteRange comp, index, word;
  if (r.has_compressed_index_buffer()) {
    RETURN_IF_ERROR(CheckOneOf("compressed_index", r.compressed_index(),
                               "compressed_index_buffer"));
    ASSIGN_OR_RETURN(
        comp, ResolveSlice(*sessions_, caller, "compressed_index_buffer",
                           r.compressed_index_buffer(), comp_entries * 4));
  } else {
    RETURN_IF_ERROR(DecodeInt32s("compressed_index", r.compressed_index(),
                                 "sum(seqlen_q) * topk_k", comp_entries, max,
                                 &sc.d));
    for (size_t i = 0; i < sc.d.size(); ++i) {
      if (sc.d[i] < -1 || sc.d[i] >= pl->compressed_rows) {
        return absl::InvalidArgumentError(
            absl::StrCat("compressed_index[", i, "] = ", sc.d[i],
                         " is outside [-1, ", pl->compressed_rows, ")"));
      }
    }
    comp.data = reinterpret_cast<uint8_t*>(sc.d.data());
    comp.size = comp_entries * 4;
  }
  if (r.has_index_buffer()) {
    ASSIGN_OR_RETURN(index, ResolveSlice(*sessions_, caller, "index_buffer",
                                         r.index_buffer(), rows * width * 4));
  }
  if (r.has_invalid_count_buffer()) {
    ASSIGN_OR_RETURN(word,
                     ResolveSlice(*sessions_, caller, "invalid_count_buffer",
                                  r.invalid_count_buffer(), 8));
  }
  const Named outs[] = {{"index_buffer", &index},
                        {"invalid_count_buffer", &word}};
  const Named ins[] = {{"compressed_index_buffer", &comp}};
  RETURN_IF_ERROR(CheckOutputsDisjoint(outs, ins));
  if (!index.buffer) {
    RETURN_IF_ERROR(ReplyScope::Reserve(
        BudgetClientOf(caller), rows * width * 4, "index (inline reply)"));
  }
  sc.e.assign(static_cast<size_t>(rows * kPivotFields), 0);
  if (r.window() > 0) {
    RETURN_IF_ERROR(ComputeSwaPivots(batch, *pl, absl::MakeSpan(sc.e)));
  }
  out->set_row_width(width);
  out->set_main_kv_offset(pl->main_kv_offset);
  out->set_total_rows(pl->total_rows);

  const Memory* device_memory = nullptr;
  for (const ByteRange* b : {&index, &comp, &word}) {
    if (b->buffer != nullptr && device_memory == nullptr) {
      device_memory = b->buffer->memory.get();
    }
  }
  if (device_memory == nullptr && !r.wait_event_ipc_handle().empty()) {
    return absl::InvalidArgumentError(
        "wait_event_ipc_handle orders buffer operands; this request has none "
        "(set compressed_index_buffer or index_buffer)");
  }
  if (device_memory != nullptr) {
    PrefillIndexCall call;
    call.pivots = sc.e;
    call.rows = rows;
    call.window = r.window();
    call.compressed = reinterpret_cast<const int32_t*>(comp.data);
    call.topk_k = static_cast<int32_t>(r.topk_k());
    call.compressed_rows = pl->compressed_rows;
    call.main_kv_offset = pl->main_kv_offset;
    call.index = reinterpret_cast<int32_t*>(index.data);
    if (!index.buffer) {
      out->mutable_index()->assign(static_cast<size_t>(rows * width * 4), '\0');
      call.index = reinterpret_cast<int32_t*>(out->mutable_index()->data());
    }
    call.invalid_word = word.data;
    RETURN_IF_ERROR(CheckAlive(ctx));
    const GpuOrdering ordering{r.wait_event_ipc_handle(), r.record_event(),
                               caller.session};
    int64_t invalid = 0;
    const absl::Status s = backend_->PrefillIndexOrdered(
        *device_memory, call, ordering, DeadlineOf(ctx), &invalid,
        out->mutable_recorded_event_ipc_handle());
    if (s.ok()) out->set_invalid_count(invalid);
    if (!absl::IsUnimplemented(s)) return s;
    out->clear_index();
    RETURN_IF_ERROR(backend_->AwaitClientEvent(
        *device_memory, r.wait_event_ipc_handle(), DeadlineOf(ctx)));
  }
  // On the host: a buffer's entries outside [-1, compressed rows) become
  // -1 and are counted, as the kernel does.
  int64_t invalid = 0;
  if (comp.buffer) {
    RETURN_IF_ERROR(Snapshot(*backend_, comp, &sc.d));
    for (int32_t& v : sc.d) {
      if (v < -1 || v >= pl->compressed_rows) {
        v = -1;
        ++invalid;
      }
    }
  }
  sc.f.assign(static_cast<size_t>(rows * r.window()), -1);
  if (r.window() > 0) {
    RETURN_IF_ERROR(ExpandSwaIndex(sc.e, r.window(), pl->main_kv_offset,
                                   absl::MakeSpan(sc.f)));
  }
  std::vector<int32_t> result(static_cast<size_t>(rows * width), -1);
  RETURN_IF_ERROR(KvIndexCat(
      sc.f, r.window(), sc.d, static_cast<int32_t>(r.topk_k()), rows,
      pl->main_kv_offset, pl->compressed_rows, absl::MakeSpan(result)));
  if (index.buffer) {
    RETURN_IF_ERROR(backend_->CopyBytes(index.data, result.data(), index.size));
  } else {
    EncodeInt32s(result, out->mutable_index());
  }
  RETURN_IF_ERROR(WriteWord(*backend_, word, invalid));
  out->set_invalid_count(invalid);
  return absl::OkStatus();
}

}  // namespace kvdepot
