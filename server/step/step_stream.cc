#include "server/step/step_stream.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace kvdepot::step {
namespace {

// The metadata key the client libraries send the session id in (as
// server/service.h's kSessionMetadataKey).
constexpr char kSessionMetadataKey[] = "kvdepot-session-id";

grpc::Status ToGrpc(const absl::Status& s) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      std::string(s.message()));
}

}  // namespace

StepStreamReactor::StepStreamReactor(StepService* service,
                                     grpc::CallbackServerContext* ctx)
    : service_(service) {
  // Before mu_: the service locks its set, then a stream's mu_ (End).
  added_ = service_->AddStream(this);
  absl::MutexLock lock(&mu_);
  if (!added_) {
    FinishLocked(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                              "kvdepot is draining (shutting down): no new "
                              "step streams"));
    return;
  }
  if (finish_wanted_) return;  // EndAllStreams came first
  if (absl::Status s = service_->slots_.Open(); !s.ok()) {
    FinishLocked(ToGrpc(s));
    return;
  }
  has_slot_ = true;
  const auto& md = ctx->client_metadata();
  if (auto it = md.find(kSessionMetadataKey); it != md.end()) {
    const std::string id(it->second.data(), it->second.size());
    absl::StatusOr<Caller> caller =
        service_->sessions_->Authenticate(id, absl::Now());
    absl::Status s = caller.ok() ? Bind(*caller, id) : caller.status();
    if (!s.ok()) {
      FinishLocked(ToGrpc(s));
      return;
    }
  }
  StartRead(&request_);
}

absl::Status StepStreamReactor::Bind(const Caller& caller,
                                     const std::string& session_id) {
  if (!caller.authenticated()) return RequireSession(caller);
  RETURN_IF_ERROR(service_->slots_.Bind(caller.session));
  session_ = caller.session;
  session_id_ = session_id;
  return absl::OkStatus();
}

absl::StatusOr<Caller> StepStreamReactor::CallerOf(const v1::StepRequest& r,
                                                   absl::Status* end) {
  if (session_ != 0) {
    if (!r.session_id().empty() && r.session_id() != session_id_) {
      return absl::PermissionDeniedError(absl::StrCat(
          "session_id: this StepStream is bound to session ", session_,
          " (its kvdepot-session-id metadata or its first message); a "
          "message may name only that session, or none: open one stream "
          "per session"));
    }
    return service_->sessions_->Authenticate(session_id_, absl::Now());
  }
  ASSIGN_OR_RETURN(Caller caller, service_->sessions_->Authenticate(
                                      r.session_id(), absl::Now()));
  // No session: the registry refuses the message (UNAUTHENTICATED), and
  // the stream stays unbound.
  if (!caller.authenticated()) return caller;
  if (absl::Status s = Bind(caller, r.session_id()); !s.ok()) {
    *end = std::move(s);
  }
  return caller;
}

void StepStreamReactor::OnReadDone(bool ok) {
  absl::MutexLock lock(&mu_);
  if (finish_wanted_ || finished_) return;
  if (!ok) {  // the client closed its side (or the call ended)
    FinishLocked(grpc::Status::OK);
    return;
  }
  absl::Status end;
  absl::StatusOr<Caller> caller = CallerOf(request_, &end);
  if (!end.ok()) {
    FinishLocked(ToGrpc(end));
    return;
  }
  response_ =
      StepReplyOf(request_.step_id(),
                  caller.ok() ? service_->registry_->Step(*caller, request_)
                              : caller.status());
  writing_ = true;
  // Under mu_ on purpose, and safe: gRPC's bidi handler registers the
  // read and write reactions as not inlineable (the installed
  // grpcpp/impl/codegen/server_callback_handlers.h, can_inline=false),
  // so OnWriteDone never runs inside StartWrite on this thread, and a
  // bidi OnDone is never inlined into Finish either.
  StartWrite(&response_);
}

void StepStreamReactor::OnWriteDone(bool ok) {
  absl::MutexLock lock(&mu_);
  writing_ = false;
  if (finish_wanted_) {
    FinishLocked(finish_status_);
  } else if (!ok) {
    FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED,
                              "the step's reply could not be sent"));
  } else {
    StartRead(&request_);
  }
}

void StepStreamReactor::End(grpc::Status status) {
  absl::MutexLock lock(&mu_);
  if (finish_wanted_ || finished_) return;
  finish_wanted_ = true;
  finish_status_ = std::move(status);
  if (!writing_) FinishLocked(finish_status_);
}

void StepStreamReactor::FinishLocked(grpc::Status status) {
  if (finished_) return;
  finished_ = true;
  Finish(std::move(status));
}

void StepStreamReactor::OnDone() {
  uint64_t session = 0;
  {
    absl::MutexLock lock(&mu_);
    session = session_;
  }
  if (has_slot_) service_->slots_.Close(session);
  if (added_) service_->RemoveStream(this);
  delete this;
}

}  // namespace kvdepot::step
