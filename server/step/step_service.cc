#include "server/step/step_service.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/error_details.h"
#include "server/reply_reactor.h"
#include "server/reply_scope.h"
#include "server/step/step_stream.h"

namespace kvdepot::step {
namespace {

// The caller of `session_id`, or the failure as a grpc::Status.
#define KV_AUTH_OR_RETURN(caller, session_id)                                  \
  absl::StatusOr<Caller> caller##_or =                                         \
      sessions_->Authenticate((session_id), absl::Now());                      \
  if (!caller##_or.ok()) return ToGrpcStatusWithDetails(caller##_or.status()); \
  const Caller& caller = *caller##_or

// Runs `call` on the gRPC thread; its status finishes the call.
template <typename Call>
grpc::ServerUnaryReactor* Inline(grpc::CallbackServerContext* ctx, Call call) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(call());
  return reactor;
}

}  // namespace

v1::StepResponse StepReplyOf(uint64_t step_id,
                             absl::StatusOr<v1::StepResponse> res) {
  if (res.ok()) return *std::move(res);
  v1::StepResponse reply;
  reply.set_step_id(step_id);
  reply.set_error_code(static_cast<int32_t>(res.status().code()));
  reply.set_error_message(std::string(res.status().message()));
  reply.set_error_field(ViolatedField(res.status()));
  return reply;
}

StepService::StepService(StepRegistry* registry, SessionManager* sessions,
                         WorkerPool* pool, StepServiceOptions options)
    : registry_(registry),
      sessions_(sessions),
      pool_(pool),
      replies_(options.replies),
      slots_(options.max_streams, options.max_streams_per_session) {}

template <typename Call>
grpc::ServerUnaryReactor* StepService::Offload(Ctx* ctx, Call call) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (!pool_->TrySubmit([reactor, call] { reactor->Finish(call()); })) {
    reactor->Finish(grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat("kvdepot: ", pool_->threads(),
                     " step workers are busy and the queue is full; retry")));
  }
  return reactor;
}

grpc::ServerUnaryReactor* StepService::RegisterWorker(
    Ctx* ctx, const v1::RegisterWorkerRequest* r,
    v1::RegisterWorkerResponse* out) {
  // Device allocations, the doorbell's initialization, engine creation.
  return Offload(ctx, [this, r, out]() -> grpc::Status {
    KV_AUTH_OR_RETURN(caller, r->session_id());
    absl::StatusOr<v1::RegisterWorkerResponse> res =
        registry_->Register(caller, *r);
    if (!res.ok()) return ToGrpcStatusWithDetails(res.status());
    *out = *std::move(res);
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* StepService::Step(Ctx* ctx, const v1::StepRequest* r,
                                            v1::StepResponse* out) {
  return Inline(ctx, [this, r, out]() -> grpc::Status {
    KV_AUTH_OR_RETURN(caller, r->session_id());
    absl::StatusOr<v1::StepResponse> res = registry_->Step(caller, *r);
    if (!res.ok()) return ToGrpcStatusWithDetails(res.status());
    *out = *std::move(res);
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* StepService::PlanStep(Ctx* /*ctx*/,
                                                const v1::StepRequest* r,
                                                v1::PlanStepResponse* out) {
  // The reply is admitted against the reply budget once built (its size
  // is known then) and held until the call is done: a client that stops
  // reading cannot pile plans up in the daemon. A plan that does not fit
  // is dropped at once.
  auto* reactor = new ReplyReactor;  // deletes itself in OnDone
  auto call = [this, r, out, reactor] {
    ReplyScope scope(replies_);
    grpc::Status status = [&]() -> grpc::Status {
      KV_AUTH_OR_RETURN(caller, r->session_id());
      absl::StatusOr<v1::PlanStepResponse> res =
          registry_->PlanStep(caller, *r);
      if (!res.ok()) return ToGrpcStatusWithDetails(res.status());
      if (absl::Status s = ReplyScope::Reserve(
              BudgetClientOf(caller), static_cast<int64_t>(res->ByteSizeLong()),
              "PlanStep reply");
          !s.ok()) {
        return ToGrpcStatusWithDetails(s);
      }
      *out = *std::move(res);
      return grpc::Status::OK;
    }();
    reactor->Hold(scope.Take());
    reactor->Finish(status);
  };
  // A decode step's plan is built on the gRPC thread, as Step's; one whose
  // row tables are large (a long prefill chunk: milliseconds of copying)
  // on a step worker, so the callback threads stay free.
  if (int64_t{r->num_tokens()} * r->block_table_cols() <
      kPlanStepInlineEntries) {
    call();
  } else if (!pool_->TrySubmit(call)) {
    reactor->Finish(grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat("kvdepot: ", pool_->threads(),
                     " step workers are busy and the queue is full; retry")));
  }
  return reactor;
}

grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>*
StepService::StepStream(Ctx* ctx) {
  return new StepStreamReactor(this, ctx);  // deletes itself in OnDone
}

grpc::ServerUnaryReactor* StepService::StepStatus(
    Ctx* ctx, const v1::StepStatusRequest* r, v1::StepStatusResponse* out) {
  return Inline(ctx, [this, r, out]() -> grpc::Status {
    KV_AUTH_OR_RETURN(caller, r->session_id());
    absl::StatusOr<v1::RegistrationInfo> res =
        registry_->Status(caller, r->registration_id());
    if (!res.ok()) return ToGrpcStatusWithDetails(res.status());
    *out->mutable_registration() = *std::move(res);
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* StepService::Unregister(
    Ctx* ctx, const v1::UnregisterRequest* r, v1::UnregisterResponse*) {
  // Cancels through the engine (control-stream writes) when steps are in
  // flight: not on a gRPC thread.
  return Offload(ctx, [this, r]() -> grpc::Status {
    KV_AUTH_OR_RETURN(caller, r->session_id());
    return ToGrpcStatusWithDetails(
        registry_->Unregister(caller, r->registration_id()));
  });
}

grpc::ServerUnaryReactor* StepService::GrantRegistration(
    Ctx* ctx, const v1::GrantRegistrationRequest* r,
    v1::GrantRegistrationResponse*) {
  return Inline(ctx, [this, r]() -> grpc::Status {
    KV_AUTH_OR_RETURN(caller, r->session_id());
    return ToGrpcStatusWithDetails(registry_->Grant(caller, *r));
  });
}

grpc::ServerUnaryReactor* StepService::ListRegistrations(
    Ctx* ctx, const v1::ListRegistrationsRequest* r,
    v1::ListRegistrationsResponse* out) {
  return Inline(ctx, [this, r, out]() -> grpc::Status {
    KV_AUTH_OR_RETURN(caller, r->session_id());
    for (v1::RegistrationInfo& info : registry_->List(caller)) {
      *out->add_registrations() = std::move(info);
    }
    return grpc::Status::OK;
  });
}

bool StepService::AddStream(StepStreamReactor* s) {
  absl::MutexLock lock(&mu_);
  if (ending_) return false;
  streams_.insert(s);
  return true;
}

void StepService::RemoveStream(StepStreamReactor* s) {
  absl::MutexLock lock(&mu_);
  streams_.erase(s);
}

void StepService::EndAllStreams() {
  absl::MutexLock lock(&mu_);
  ending_ = true;
  // A stream leaves streams_ only in its OnDone (after Finish, run by
  // gRPC's callback threads, never inside End), so every one is alive here.
  for (StepStreamReactor* s : streams_) {
    s->End(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "kvdepot is shutting down: the step stream ended"));
  }
}

}  // namespace kvdepot::step
