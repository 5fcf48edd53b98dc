// Store, Load, BuildPlan and PrefillLoad: validation of the whole request,
// then the backend call under the pool lock.
#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/quant.h"
#include "kernels/store_load_host.h"
#include "planner/prefill_layout.h"
#include "proto/wire.h"
#include "server/backend/inline_call.h"
#include "server/data_refs.h"
#include "server/fused_store.h"
#include "server/reply_scope.h"
#include "server/request_checks.h"
#include "server/service.h"
#include "server/thread_scratch.h"

namespace kvdepot {
namespace {

// Per-thread scratch (server/thread_scratch.h): decoded arrays and the plan
// builder keep their capacity across calls, within the kept-scratch bounds.
struct Scratch {
  std::vector<int32_t> slots;
  std::vector<int32_t> segments;
  std::vector<int32_t> cu_rows;
  DecodedSequences seqs;
  BlockLoadPlanBuilder builder{1, 1};
};

int64_t HeldBytes(const Scratch& s) {
  return CapacityBytes(s.slots, s.segments, s.cu_rows, s.seqs.seqlen_k,
                       s.seqs.block_table) +
         s.builder.capacity_bytes();
}

// A pool's lock for one data call, shared (Load) or exclusive (Store). A
// holder may be waiting for the GPU (a synchronous call waits for its
// kernels under it), so an inline call only tries the lock and, when it is
// taken, is deferred to a worker (server/backend/inline_call.h).
class PoolLock {
 public:
  PoolLock(absl::Mutex& mu, bool shared) : mu_(mu), shared_(shared) {
    if (MayWait()) {
      shared ? mu_.ReaderLock() : mu_.Lock();
      held_ = true;
    } else {
      held_ = shared ? mu_.ReaderTryLock() : mu_.TryLock();
    }
  }
  ~PoolLock() {
    if (held_) shared_ ? mu_.ReaderUnlock() : mu_.Unlock();
  }
  PoolLock(const PoolLock&) = delete;
  PoolLock& operator=(const PoolLock&) = delete;

  // OK when held; else the inline call's deferral.
  absl::Status status() const {
    return held_ ? absl::OkStatus()
                 : DeferInlineCall("another call holds the pool's lock");
  }

 private:
  absl::Mutex& mu_;
  const bool shared_;
  bool held_ = false;
};

}  // namespace

absl::Status KVCacheService::CheckGpuOrdering(absl::string_view wait_event,
                                              bool record_event) const {
  if (backend_->name() == "cuda" || (wait_event.empty() && !record_event)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      wait_event.empty() ? "record_event" : "wait_event_ipc_handle",
      ": GPU ordering needs the cuda backend; this daemon runs the ",
      backend_->name(), " backend, whose replies already mean \"done\""));
}

absl::StatusOr<std::shared_ptr<Pool>> KVCacheService::DataTarget(
    const Caller& caller, absl::string_view pool_name, int64_t layer,
    absl::string_view wait_event, bool record_event) {
  RETURN_IF_ERROR(CheckGpuOrdering(wait_event, record_event));
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      UsablePool(caller, "pool", pool_name);
  if (!pool.ok()) return pool.status();
  RETURN_IF_ERROR(CheckLayer("layer", layer, (*pool)->layout));
  return pool;
}

absl::StatusOr<GpuOrdering> KVCacheService::AwaitOrdering(
    Ctx* ctx, const Caller& caller, const Pool& pool,
    const GpuOrdering& ordering) {
  // Only an event to await needs the deadline: reading it costs a clock
  // read and two conversions, on every Store and Load otherwise.
  const absl::Time deadline = ctx == nullptr || ordering.wait_event.empty()
                                  ? absl::InfiniteFuture()
                                  : absl::FromChrono(ctx->deadline());
  RETURN_IF_ERROR(
      backend_->AwaitClientEvent(*pool.memory, ordering.wait_event, deadline));
  GpuOrdering queued;
  queued.record_event = ordering.record_event;
  queued.session = caller.session;
  return queued;
}

absl::Status KVCacheService::DoStore(Ctx* ctx, const Caller& caller,
                                     const v1::StoreRequest& r,
                                     v1::StoreResponse* out) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = DataTarget(
      caller, r.pool(), r.layer(), r.wait_event_ipc_handle(), r.record_event());
  if (!pool.ok()) return pool.status();
  const PoolLayout& layout = (*pool)->layout;
  int64_t dtype_bytes = 0;
  absl::StatusOr<InputDtype> dtype =
      ToInputDtype("dtype", r.dtype(), &dtype_bytes);
  if (!dtype.ok()) return dtype.status();
  RETURN_IF_ERROR(ValidateInputDtype(layout.format, *dtype));
  if (r.has_fused()) {
    RETURN_IF_ERROR(CheckFusedStore(
        *dtype, !r.wait_event_ipc_handle().empty() || r.record_event()));
  }
  ThreadScratch<Scratch> scratch;
  Scratch& sc = *scratch;
  RETURN_IF_ERROR(DecodeInt32s("slot_mapping", r.slot_mapping(), "num_tokens",
                               r.num_tokens(), options_.max_array_elements,
                               &sc.slots));
  RETURN_IF_ERROR(ValidateSlotMapping(layout, sc.slots));
  absl::StatusOr<ByteRange> kv =
      ResolveInput(*sessions_, caller, "kv", r.kv(),
                   r.num_tokens() * layout.format.elements() * dtype_bytes);
  if (!kv.ok()) return kv.status();
  std::optional<FusedStoreInputs> fused;
  if (r.has_fused()) {
    ASSIGN_OR_RETURN(
        fused, ResolveFusedStore(
                   *sessions_, *backend_, caller, layout.format, r.fused(),
                   r.num_tokens(), *kv, options_.max_array_elements,
                   options_.max_inline_bytes, out->mutable_cast_back()));
  }
  int64_t written = 0;
  for (int32_t slot : sc.slots) written += slot >= 0 ? 1 : 0;
  out->set_tokens_written(written);
  if (fused.has_value()) {
    if (r.num_tokens() == 0) return absl::OkStatus();
    RETURN_IF_ERROR(CheckAlive(ctx));
    absl::MutexLock lock(&(*pool)->mu);
    return backend_->StoreFused(
        layout, *(*pool)->memory, r.layer(),
        reinterpret_cast<const uint16_t*>(kv->data), fused->params, sc.slots,
        reinterpret_cast<uint16_t*>(fused->cast_back.data));
  }
  const GpuOrdering ordering{r.wait_event_ipc_handle(), r.record_event()};
  if (r.num_tokens() == 0 && ordering.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(CheckAlive(ctx));
  absl::StatusOr<GpuOrdering> queued =
      AwaitOrdering(ctx, caller, **pool, ordering);
  if (!queued.ok()) return queued.status();
  const PoolLock lock((*pool)->mu, /*shared=*/false);
  RETURN_IF_ERROR(lock.status());
  return backend_->StoreOrdered(layout, *(*pool)->memory, r.layer(), kv->data,
                                *dtype, sc.slots, *queued,
                                out->mutable_recorded_event_ipc_handle());
}

absl::Status KVCacheService::DoLoad(Ctx* ctx, const Caller& caller,
                                    const v1::LoadRequest& r,
                                    v1::LoadResponse* out) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = DataTarget(
      caller, r.pool(), r.layer(), r.wait_event_ipc_handle(), r.record_event());
  if (!pool.ok()) return pool.status();
  const PoolLayout& layout = (*pool)->layout;
  ThreadScratch<Scratch> scratch;
  Scratch& sc = *scratch;
  absl::Span<const int32_t> segments;
  int64_t total_k = 0;
  switch (r.plan_case()) {
    case v1::LoadRequest::kSegments: {
      const v1::Segments& p = r.segments();
      if (p.num_segments() > options_.max_array_elements / 4) {
        return absl::InvalidArgumentError(
            absl::StrCat("segments.num_segments = ", p.num_segments(),
                         " exceeds ", options_.max_array_elements / 4));
      }
      RETURN_IF_ERROR(DecodeInt32s(
          "segments.segments", p.segments(), "4 * segments.num_segments",
          4 * p.num_segments(), options_.max_array_elements, &sc.segments));
      if (p.total_k() < 0 || p.total_k() > INT32_MAX) {
        return absl::InvalidArgumentError(absl::StrCat(
            "segments.total_k = ", p.total_k(), " is outside [0, 2^31)"));
      }
      segments = sc.segments;
      total_k = p.total_k();
      break;
    }
    case v1::LoadRequest::kSequences: {
      RETURN_IF_ERROR(DecodeSequencePlan("sequences", r.sequences(), layout,
                                         options_.max_array_elements,
                                         &sc.seqs));
      RETURN_IF_ERROR(BuildSequenceLoadPlan(sc.seqs, &sc.builder, &sc.cu_rows));
      segments = sc.builder.Finish();
      total_k = sc.builder.total_k();
      EncodeInt32s(sc.cu_rows, out->mutable_cu_rows());
      break;
    }
    default:
      return absl::InvalidArgumentError("plan: set segments or sequences");
  }
  RETURN_IF_ERROR(ValidateSegments(layout, segments, total_k));
  const KVCacheFormat& f = layout.format;
  const int64_t scale_row = f.do_cast ? 0 : LoadScaleRowBytes(f);
  if (f.do_cast && r.has_scales() &&
      r.scales().kind_case() != v1::DataRef::KIND_NOT_SET) {
    return absl::InvalidArgumentError(
        "scales must be unset: a do_cast format loads BF16 rows only");
  }
  absl::StatusOr<ByteRange> data = ResolveOutput(
      *sessions_, caller, "data", r.data(), total_k * LoadDataRowBytes(f),
      options_.max_inline_bytes, out->mutable_data());
  if (!data.ok()) return data.status();
  absl::StatusOr<ByteRange> scales = ResolveOutput(
      *sessions_, caller, "scales", r.scales(), total_k * scale_row,
      options_.max_inline_bytes, out->mutable_scales());
  if (!scales.ok()) return scales.status();
  RETURN_IF_ERROR(CheckDisjoint("data", *data, "scales", *scales));
  out->set_total_k(total_k);
  const GpuOrdering ordering{r.wait_event_ipc_handle(), r.record_event()};
  if (segments.empty() && ordering.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(CheckAlive(ctx));
  absl::StatusOr<GpuOrdering> queued =
      AwaitOrdering(ctx, caller, **pool, ordering);
  if (!queued.ok()) return queued.status();
  const PoolLock lock((*pool)->mu, /*shared=*/true);
  RETURN_IF_ERROR(lock.status());
  return backend_->LoadOrdered(layout, *(*pool)->memory, r.layer(), segments,
                               total_k, data->data,
                               f.do_cast ? nullptr : scales->data, *queued,
                               out->mutable_recorded_event_ipc_handle());
}

absl::Status KVCacheService::DoBuildPlan(const Caller& caller,
                                         const v1::BuildPlanRequest& r,
                                         v1::BuildPlanResponse* out) {
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      UsablePool(caller, "pool", r.pool());
  if (!pool.ok()) return pool.status();
  ThreadScratch<Scratch> scratch;
  Scratch& sc = *scratch;
  RETURN_IF_ERROR(DecodeSequencePlan("sequences", r.sequences(),
                                     (*pool)->layout,
                                     options_.max_array_elements, &sc.seqs));
  RETURN_IF_ERROR(BuildSequenceLoadPlan(sc.seqs, &sc.builder, &sc.cu_rows));
  absl::Span<const int32_t> segments = sc.builder.Finish();
  const int64_t reply_bytes =
      4 * static_cast<int64_t>(segments.size() + sc.cu_rows.size());
  if (reply_bytes > options_.max_inline_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequences: the plan and cu_rows take ", reply_bytes,
        " bytes, more than max_inline_bytes = ", options_.max_inline_bytes,
        " (a reply must fit one message); split the batch"));
  }
  RETURN_IF_ERROR(ReplyScope::Reserve(BudgetClientOf(caller), reply_bytes,
                                      "plan (inline reply)"));
  v1::Segments* plan = out->mutable_plan();
  plan->set_num_segments(static_cast<int64_t>(segments.size()) / 4);
  plan->set_total_k(sc.builder.total_k());
  EncodeInt32s(segments, plan->mutable_segments());
  EncodeInt32s(sc.cu_rows, out->mutable_cu_rows());
  return absl::OkStatus();
}

}  // namespace kvdepot
