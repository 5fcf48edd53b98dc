// PrefillLoad's gRPC handler: decodes and checks the request, resolves its
// buffers and locks the pools; the planning and the work are
// server/prefill_load.h's. A consumer layer (shared_compressed) is checked
// against the recorded source load of its output slice
// (server/prefill_sources.h) and loads only its SWA part.
#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/store_load_host.h"
#include "proto/wire.h"
#include "server/data_refs.h"
#include "server/prefill_load.h"
#include "server/prefill_sources.h"
#include "server/request_checks.h"
#include "server/service.h"
#include "server/thread_scratch.h"

namespace kvdepot {
namespace {

// Per-thread scratch (server/thread_scratch.h).
struct PrefillScratch {
  std::vector<int32_t> seqlen_k, seqlen_q, state_ids, valid_start;
  std::vector<int32_t> block_table;
  PrefillLoadPlan plan;
  PrefillHostScratch host;
};

int64_t HeldBytes(const PrefillScratch& s) {
  const PrefillLoadPlan& p = s.plan;
  const PrefillHostScratch& h = s.host;
  return CapacityBytes(s.seqlen_k, s.seqlen_q, s.state_ids, s.valid_start,
                       s.block_table, p.swa_segments, p.main_segments,
                       p.store_slots, p.cu_compressed, h.chunk_in, h.chunk_out,
                       h.record, h.token, h.decoded) +
         p.builder.capacity_bytes();
}

}  // namespace

absl::Status KVCacheService::DoPrefillLoad(Ctx* ctx, const Caller& caller,
                                           const v1::PrefillLoadRequest& r,
                                           v1::PrefillLoadResponse* out) {
  // window 0 = no SWA part, compress_ratio 0 = no compressed part (SPEC
  // §6); the absent part's pool may be left empty: the other one stands in
  // for it (nothing of it is read or written).
  RETURN_IF_ERROR(
      CheckGpuOrdering(r.wait_event_ipc_handle(), r.record_event()));
  const bool no_swa = r.window() == 0, no_main = r.compress_ratio() == 0;
  if (no_swa && no_main) {
    return absl::InvalidArgumentError(
        "window = 0 and compress_ratio = 0: the layer has neither an SWA nor "
        "a compressed part");
  }
  const bool swa_as_main = no_swa && r.swa_pool().empty();
  const bool main_as_swa = no_main && r.main_pool().empty();
  absl::StatusOr<std::shared_ptr<Pool>> swa =
      UsablePool(caller, swa_as_main ? "main_pool" : "swa_pool",
                 swa_as_main ? r.main_pool() : r.swa_pool());
  if (!swa.ok()) return swa.status();
  absl::StatusOr<std::shared_ptr<Pool>> main =
      UsablePool(caller, main_as_swa ? "swa_pool" : "main_pool",
                 main_as_swa ? r.swa_pool() : r.main_pool());
  if (!main.ok()) return main.status();
  const PoolLayout& sl = (*swa)->layout;
  const PoolLayout& ml = (*main)->layout;
  const int64_t swa_layer = swa_as_main ? r.main_layer() : r.swa_layer();
  const int64_t main_layer = main_as_swa ? r.swa_layer() : r.main_layer();
  RETURN_IF_ERROR(
      CheckLayer(swa_as_main ? "main_layer" : "swa_layer", swa_layer, sl));
  RETURN_IF_ERROR(
      CheckLayer(main_as_swa ? "swa_layer" : "main_layer", main_layer, ml));
  if (!sl.format.do_cast || !ml.format.do_cast ||
      sl.format.elements() != ml.format.elements()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "swa_pool and main_pool must be do_cast formats with the same "
        "elements (got ",
        sl.format.elements(), " and ", ml.format.elements(), ")"));
  }
  int64_t dtype_bytes = 0;
  absl::StatusOr<InputDtype> dtype =
      ToInputDtype("dtype", r.dtype(), &dtype_bytes);
  if (!dtype.ok()) return dtype.status();
  RETURN_IF_ERROR(ValidateInputDtype(sl.format, *dtype));
  RETURN_IF_ERROR(ValidateInputDtype(ml.format, *dtype));
  ThreadScratch<PrefillScratch> scratch;
  PrefillScratch& sc = *scratch;
  const int64_t n = r.num_seqs();
  const int64_t max = options_.max_array_elements;
  if (n < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_seqs = ", n, " must be >= 1"));
  }
  absl::Status s =
      DecodeInt32s("seqlen_k", r.seqlen_k(), "num_seqs", n, max, &sc.seqlen_k);
  if (s.ok()) {
    s = DecodeInt32s("seqlen_q", r.seqlen_q(), "num_seqs", n, max,
                     &sc.seqlen_q);
  }
  if (s.ok()) {
    s = DecodeInt32s("swa_state_id", r.swa_state_id(), "num_seqs", n, max,
                     &sc.state_ids);
  }
  if (s.ok()) {
    s = DecodeInt32s("swa_valid_start", r.swa_valid_start(),
                     r.swa_valid_start().empty() ? "0 (empty)" : "num_seqs",
                     r.swa_valid_start().empty() ? 0 : n, max, &sc.valid_start);
  }
  const bool shared = r.shared_compressed();
  if (s.ok() && shared &&
      (r.max_blocks_per_seq() != 0 || !r.block_table().empty())) {
    s = absl::InvalidArgumentError(absl::StrCat(
        r.block_table().empty() ? "max_blocks_per_seq" : "block_table",
        ": a shared_compressed (consumer) load reads no compressed blocks; "
        "leave block_table and max_blocks_per_seq unset"));
  }
  if (s.ok() && !shared &&
      (r.max_blocks_per_seq() < (no_main ? 0 : 1) ||
       r.max_blocks_per_seq() > INT32_MAX)) {
    s = absl::InvalidArgumentError(
        absl::StrCat("max_blocks_per_seq = ", r.max_blocks_per_seq(),
                     " is outside [", no_main ? 0 : 1, ", 2^31)"));
  }
  if (s.ok() && !shared) {
    s = DecodeInt32s("block_table", r.block_table(),
                     "num_seqs * max_blocks_per_seq",
                     n * r.max_blocks_per_seq(), max, &sc.block_table);
  }
  if (!s.ok()) return s;
  absl::StatusOr<int32_t> ratio =
      no_main ? absl::StatusOr<int32_t>(0)
              : CheckRatio("compress_ratio", r.compress_ratio(), ml);
  if (!ratio.ok()) return ratio.status();

  SequenceBatch batch;
  batch.seqlen_k = sc.seqlen_k;
  batch.seqlen_q = sc.seqlen_q;
  batch.state_ids = sc.state_ids;
  batch.swa_valid_start = sc.valid_start;
  if (!shared) {
    batch.block_table = DenseTable(sc.block_table, n, r.max_blocks_per_seq());
  }
  RETURN_IF_ERROR(
      shared ? PlanSharedPrefillLoad(sl, batch, r.window(), *ratio, &sc.plan)
             : PlanPrefillLoad(sl, ml, batch, r.window(), *ratio, &sc.plan));
  const PrefillLayout* pl = &sc.plan.layout;
  const int64_t row_bytes = LoadDataRowBytes(ml.format);
  absl::StatusOr<ByteRange> kv = ResolveInput(
      *sessions_, caller, "chunk_kv", r.chunk_kv(),
      int64_t{pl->chunk_rows} * ml.format.elements() * dtype_bytes);
  if (!kv.ok()) return kv.status();
  absl::StatusOr<ByteRange> output =
      ResolveOutput(*sessions_, caller, "output", r.output(),
                    int64_t{pl->total_rows} * row_bytes,
                    options_.max_inline_bytes, out->mutable_output());
  if (!output.ok()) return output.status();
  RETURN_IF_ERROR(CheckDisjoint("chunk_kv", *kv, "output", *output));
  if (shared) {
    // After ResolveOutput: only a caller with access to the buffer learns
    // whether a source is recorded for it.
    if (output->buffer == nullptr) {
      return absl::InvalidArgumentError(
          "output: a shared_compressed (consumer) load writes in place into "
          "the source layer's buffer slice; inline_output has no source");
    }
    ASSIGN_OR_RETURN(std::shared_ptr<const PrefillSource> source,
                     prefill_sources_.Find(output->buffer->id, output->offset));
    RETURN_IF_ERROR(CheckConsumer(*source, *main, main_layer, r.window(),
                                  *ratio, sc.seqlen_k, sc.seqlen_q,
                                  sc.valid_start, *pl));
  }
  out->set_total_k_swa(pl->swa_history_rows);
  out->set_chunk_offset(pl->swa_history_rows);
  out->set_main_kv_offset(pl->main_kv_offset);
  out->set_total_rows(pl->total_rows);
  out->set_swa_segments(static_cast<int64_t>(sc.plan.swa_segments.size()) / 4);
  out->set_main_segments(static_cast<int64_t>(sc.plan.main_segments.size()) /
                         4);
  EncodeInt32s(sc.plan.cu_compressed, out->mutable_cu_compressed());
  RETURN_IF_ERROR(CheckAlive(ctx));
  // The caller's event (e.g. after the previous layer's attention, which
  // reads the rows this call overwrites), awaited on the host before any
  // lock is taken or anything queued; the CPU backend refuses one.
  GpuOrdering requested;
  requested.wait_event = r.wait_event_ipc_handle();
  requested.record_event = r.record_event();
  absl::StatusOr<GpuOrdering> ordering =
      AwaitOrdering(ctx, caller, **swa, requested);
  if (!ordering.ok()) return ordering.status();
  std::string* event = out->mutable_recorded_event_ipc_handle();
  // A full load into a buffer slice is a possible source: the records it
  // overwrites go now, its own once its work is done or queued (a
  // consumer's calls on the buffer queue behind that work in the daemon).
  const bool records = !shared && output->buffer != nullptr;
  if (records) {
    prefill_sources_.Forget(output->buffer->id, output->offset, output->size);
  }
  auto record = [&](absl::Status done) {
    if (!records || !done.ok()) return done;
    PrefillSourceKey key;
    key.main_pool = *main;
    key.main_layer = main_layer;
    key.window = pl->window;
    key.ratio = *ratio;
    key.seqlen_k = sc.seqlen_k;
    key.seqlen_q = sc.seqlen_q;
    key.swa_valid_start = sc.valid_start;
    key.swa_valid_start.resize(sc.seqlen_k.size(), 0);  // empty = zeros
    key.layout = *pl;
    prefill_sources_.Record(output->buffer, output->offset, output->size,
                            std::move(key));
    return done;
  };

  // A consumer touches only the SWA pool (the compressed rows stay).
  if (shared) {
    absl::MutexLock lock(&(*swa)->mu);
    return RunPrefillLoad(*backend_,
                          LayerRef{&sl, (*swa)->memory.get(), swa_layer},
                          LayerRef{&ml, nullptr, main_layer}, sc.plan, kv->data,
                          *dtype, output->data, *ordering, event, &sc.host);
  }
  // Lock both pools (once when they are the same), in address order.
  Pool* first = swa->get();
  Pool* second = main->get();
  const bool same = first == second;
  if (!same && second < first) std::swap(first, second);
  absl::MutexLock lock1(&first->mu);
  std::optional<absl::MutexLock> lock2;
  if (!same) lock2.emplace(&second->mu);

  return record(RunPrefillLoad(
      *backend_, LayerRef{&sl, (*swa)->memory.get(), swa_layer},
      LayerRef{&ml, (*main)->memory.get(), main_layer}, sc.plan, kv->data,
      *dtype, output->data, *ordering, event, &sc.host));
}

}  // namespace kvdepot
