#include "server/serving.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "google/protobuf/message.h"
#include "server/backend/inline_call.h"
#include "server/reply_reactor.h"
#include "server/reply_scope.h"
#include "server/serving_policy.h"
#include "server/worker_pool.h"

namespace kvdepot {
namespace {

using CallbackCtx = grpc::CallbackServerContext;

// The callback API: inline or offloaded unary calls, Verify as a write
// reactor fed by an ops-pool thread.
class CallbackServing final : public Serving,
                              public v1::KVCache::CallbackService {
 public:
  CallbackServing(KVCacheService* impl, const ServingOptions& o)
      : impl_(impl),
        replies_(o.replies),
        policy_{o.inline_max_rows, impl->backend_waits_for_device()},
        data_pool_("kvdepot-work", o.worker_threads, o.max_queued_calls),
        wait_pool_("kvdepot-wait", o.worker_threads, o.max_queued_calls),
        ops_pool_("kvdepot-ops", o.ops_threads, o.max_queued_calls) {}

  grpc::Service* service() override { return this; }
  void Shutdown() override {
    data_pool_.Shutdown();
    wait_pool_.Shutdown();
    ops_pool_.Shutdown();
  }

  // Runs `call` here, or on `pool` when `offload` or when the inline
  // attempt would have had to wait (server/backend/inline_call.h: then it
  // wrote nothing, and `out` is cleared for the second run); its status
  // finishes the call.
  template <typename Call>
  grpc::ServerUnaryReactor* Dispatch(CallbackCtx* ctx, WorkerPool* pool,
                                     bool offload,
                                     google::protobuf::Message* out,
                                     Call call) {
    if (!offload) {
      grpc::Status status;
      bool deferred = false;
      ReplyScope scope(replies_);
      {
        InlineCall inline_call;
        status = call();
        deferred = inline_call.deferred();
      }
      if (!deferred) {
        std::vector<MemoryReservation> held = scope.Take();
        // gRPC's default reactor unless there is something to give back
        // when the call is done (it finishes without a hand-off: measured
        // a few us faster per call).
        grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
        if (!held.empty()) {
          auto* r = new ReplyReactor;  // deletes itself in OnDone
          r->Hold(std::move(held));
          reactor = r;
        }
        reactor->Finish(status);
        return reactor;
      }
      // The second run reserves again.
      out->Clear();
    }
    auto* reactor = new ReplyReactor;  // deletes itself in OnDone
    if (!pool->TrySubmit([reactor, call, replies = replies_] {
          ReplyScope scope(replies);
          grpc::Status status = call();
          reactor->Hold(scope.Take());
          reactor->Finish(status);
        })) {
      reactor->Finish(grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("kvdepot: ", pool->threads(),
                       " workers are busy and the queue is full; retry")));
    }
    return reactor;
  }

#define KVDEPOT_UNARY(Method, Req, Resp, pool, offload)                \
  grpc::ServerUnaryReactor* Method(CallbackCtx* ctx, const v1::Req* r, \
                                   v1::Resp* out) override {           \
    return Dispatch(ctx, pool, offload, out, [this, ctx, r, out] {     \
      return impl_->Method(ctx, r, out);                               \
    });                                                                \
  }
  // Session and lookup calls: short, inline. CloseSession releases the
  // session's buffers, which on a device waits for their work.
  KVDEPOT_UNARY(OpenSession, OpenSessionRequest, OpenSessionResponse,
                &data_pool_, false)
  KVDEPOT_UNARY(KeepAlive, KeepAliveRequest, KeepAliveResponse, &data_pool_,
                false)
  KVDEPOT_UNARY(CloseSession, CloseSessionRequest, CloseSessionResponse,
                &data_pool_, policy_.device)
  KVDEPOT_UNARY(GetPool, GetPoolRequest, PoolInfo, &data_pool_, false)
  KVDEPOT_UNARY(ListPools, ListPoolsRequest, ListPoolsResponse, &data_pool_,
                false)
  KVDEPOT_UNARY(Grant, GrantRequest, GrantResponse, &data_pool_, false)
  KVDEPOT_UNARY(Stats, StatsRequest, StatsResponse, &data_pool_, false)
  KVDEPOT_UNARY(Ping, PingRequest, PingResponse, &data_pool_, false)
  KVDEPOT_UNARY(Drain, DrainRequest, DrainResponse, &data_pool_, false)
  // Allocation, zero-fill, mapping and release: offloaded.
  KVDEPOT_UNARY(CreatePool, CreatePoolRequest, PoolInfo, &data_pool_, true)
  KVDEPOT_UNARY(DeletePool, DeletePoolRequest, DeletePoolResponse, &data_pool_,
                true)
  KVDEPOT_UNARY(AllocateBuffer, AllocateBufferRequest, BufferInfo, &data_pool_,
                true)
  KVDEPOT_UNARY(ImportBuffer, ImportBufferRequest, BufferInfo, &data_pool_,
                true)
  KVDEPOT_UNARY(ReleaseBuffer, ReleaseBufferRequest, ReleaseBufferResponse,
                &data_pool_, policy_.device)
  // The data path: inline when short (serving.h).
  // A call awaiting a client's event holds its worker until the event fires
  // or the watchdog ends it: those have their own pool, so clients that
  // never signal cannot take the workers everybody else's calls run on.
  KVDEPOT_UNARY(Store, StoreRequest, StoreResponse,
                PoolFor(r->wait_event_ipc_handle()), policy_.Offload(*r))
  KVDEPOT_UNARY(Load, LoadRequest, LoadResponse,
                PoolFor(r->wait_event_ipc_handle()), policy_.Offload(*r))
  KVDEPOT_UNARY(BuildPlan, BuildPlanRequest, BuildPlanResponse, &data_pool_,
                policy_.Offload(*r))
  KVDEPOT_UNARY(ConvertTopk, ConvertTopkRequest, ConvertTopkResponse,
                PoolFor(r->wait_event_ipc_handle()), policy_.Offload(*r))
  KVDEPOT_UNARY(SwaDecodeIndex, SwaDecodeIndexRequest, SwaDecodeIndexResponse,
                PoolFor(r->wait_event_ipc_handle()), policy_.Offload(*r))
  KVDEPOT_UNARY(PrefillIndex, PrefillIndexRequest, PrefillIndexResponse,
                PoolFor(r->wait_event_ipc_handle()), true)
  KVDEPOT_UNARY(PrefillLoad, PrefillLoadRequest, PrefillLoadResponse,
                PoolFor(r->wait_event_ipc_handle()), true)
  // Operator scans: their own pool.
  KVDEPOT_UNARY(Inspect, InspectRequest, InspectResponse, &ops_pool_, true)
#undef KVDEPOT_UNARY

  grpc::ServerWriteReactor<v1::VerifyProgress>* Verify(
      CallbackCtx* ctx, const v1::VerifyRequest* r) override;

 private:
  WorkerPool* PoolFor(const std::string& wait_event) {
    return wait_event.empty() ? &data_pool_ : &wait_pool_;
  }

  KVCacheService* const impl_;
  MemoryBudget* const replies_;
  const OffloadPolicy policy_;
  WorkerPool data_pool_;
  WorkerPool wait_pool_;  // calls that await a client's event first
  WorkerPool ops_pool_;
};

// Verify on an ops-pool thread: each progress message is one write, and
// the thread waits for it to complete (or the call to end) before the
// next, so a reader that stops reading stalls only this scan, which ends
// at the call's deadline or cancellation. Deletes itself in OnDone.
class VerifyReactor final
    : public grpc::ServerWriteReactor<v1::VerifyProgress> {
 public:
  VerifyReactor(KVCacheService* impl, CallbackCtx* ctx,
                const v1::VerifyRequest* r)
      : impl_(impl), ctx_(ctx), request_(r) {}

  // On a pool thread.
  void Run() {
    grpc::Status status =
        impl_->Verify(ctx_, request_,
                      [this](const v1::VerifyProgress& p) { return Write(p); });
    Finish(status);
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    write_ok_ = ok;
  }
  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
  }
  void OnDone() override { delete this; }

 private:
  bool Write(const v1::VerifyProgress& p) {
    {
      absl::MutexLock lock(&mu_);
      if (cancelled_) return false;
      // The reactor owns the message until OnWriteDone (gRPC serializes it
      // when the write is performed).
      message_ = p;
      writing_ = true;
    }
    // Not under mu_: OnWriteDone takes it.
    StartWrite(&message_);
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &VerifyReactor::WriteEnded));
    return write_ok_;
  }
  bool WriteEnded() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !writing_;
  }

  KVCacheService* const impl_;
  CallbackCtx* const ctx_;
  const v1::VerifyRequest* const request_;
  absl::Mutex mu_;
  v1::VerifyProgress message_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool write_ok_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

grpc::ServerWriteReactor<v1::VerifyProgress>* CallbackServing::Verify(
    CallbackCtx* ctx, const v1::VerifyRequest* r) {
  auto* reactor = new VerifyReactor(impl_, ctx, r);
  if (!ops_pool_.TrySubmit([reactor] { reactor->Run(); })) {
    reactor->Finish(grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        "kvdepot: too many Verify/Inspect scans are queued; retry later"));
  }
  return reactor;
}

// The sync API: gRPC's handler threads call the handlers directly.
class SyncServing final : public Serving, public v1::KVCache::Service {
 public:
  SyncServing(KVCacheService* impl, MemoryBudget* replies)
      : impl_(impl), replies_(replies) {}
  grpc::Service* service() override { return this; }
  void Shutdown() override {}

#define KVDEPOT_SYNC(Method, Req, Resp)                           \
  grpc::Status Method(grpc::ServerContext* ctx, const v1::Req* r, \
                      v1::Resp* out) override {                   \
    ReplyScope scope(replies_);                                   \
    return impl_->Method(ctx, r, out);                            \
  }
  KVDEPOT_SYNC(OpenSession, OpenSessionRequest, OpenSessionResponse)
  KVDEPOT_SYNC(KeepAlive, KeepAliveRequest, KeepAliveResponse)
  KVDEPOT_SYNC(CloseSession, CloseSessionRequest, CloseSessionResponse)
  KVDEPOT_SYNC(CreatePool, CreatePoolRequest, PoolInfo)
  KVDEPOT_SYNC(GetPool, GetPoolRequest, PoolInfo)
  KVDEPOT_SYNC(ListPools, ListPoolsRequest, ListPoolsResponse)
  KVDEPOT_SYNC(DeletePool, DeletePoolRequest, DeletePoolResponse)
  KVDEPOT_SYNC(AllocateBuffer, AllocateBufferRequest, BufferInfo)
  KVDEPOT_SYNC(ImportBuffer, ImportBufferRequest, BufferInfo)
  KVDEPOT_SYNC(ReleaseBuffer, ReleaseBufferRequest, ReleaseBufferResponse)
  KVDEPOT_SYNC(Grant, GrantRequest, GrantResponse)
  KVDEPOT_SYNC(Store, StoreRequest, StoreResponse)
  KVDEPOT_SYNC(Load, LoadRequest, LoadResponse)
  KVDEPOT_SYNC(BuildPlan, BuildPlanRequest, BuildPlanResponse)
  KVDEPOT_SYNC(PrefillLoad, PrefillLoadRequest, PrefillLoadResponse)
  KVDEPOT_SYNC(ConvertTopk, ConvertTopkRequest, ConvertTopkResponse)
  KVDEPOT_SYNC(SwaDecodeIndex, SwaDecodeIndexRequest, SwaDecodeIndexResponse)
  KVDEPOT_SYNC(PrefillIndex, PrefillIndexRequest, PrefillIndexResponse)
  KVDEPOT_SYNC(Stats, StatsRequest, StatsResponse)
  KVDEPOT_SYNC(Ping, PingRequest, PingResponse)
  KVDEPOT_SYNC(Inspect, InspectRequest, InspectResponse)
  KVDEPOT_SYNC(Drain, DrainRequest, DrainResponse)
#undef KVDEPOT_SYNC
  grpc::Status Verify(grpc::ServerContext* ctx, const v1::VerifyRequest* r,
                      grpc::ServerWriter<v1::VerifyProgress>* w) override {
    return impl_->Verify(ctx, r, w);
  }

 private:
  KVCacheService* const impl_;
  MemoryBudget* const replies_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Serving>> MakeServing(
    KVCacheService* impl, const ServingOptions& options) {
  if (options.worker_threads < 1 || options.worker_threads > 1024 ||
      options.ops_threads < 1 || options.ops_threads > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--worker_threads = ", options.worker_threads, ", --ops_threads = ",
        options.ops_threads, ": each must be in [1, 1024]"));
  }
  if (options.max_queued_calls < 1 || options.inline_max_rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_queued_calls = ", options.max_queued_calls,
        " must be >= 1 and --inline_max_rows = ", options.inline_max_rows,
        " >= 0"));
  }
  if (options.model == "callback") {
    return std::unique_ptr<Serving>(new CallbackServing(impl, options));
  }
  if (options.model == "sync") {
    return std::unique_ptr<Serving>(new SyncServing(impl, options.replies));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--serving_model = \"", options.model, "\": use callback or sync"));
}

}  // namespace kvdepot
