#include "server/step/step_service.h"

#include "absl/time/clock.h"
#include "server/error_details.h"

namespace kvdepot::step {
namespace {

// The caller of `session_id`, or the failure as a grpc::Status.
#define KV_AUTH_OR_RETURN(caller, session_id)                                  \
  absl::StatusOr<Caller> caller##_or =                                         \
      sessions_->Authenticate((session_id), absl::Now());                      \
  if (!caller##_or.ok()) return ToGrpcStatusWithDetails(caller##_or.status()); \
  const Caller& caller = *caller##_or

}  // namespace

grpc::Status StepService::RegisterWorker(grpc::ServerContext*,
                                         const v1::RegisterWorkerRequest* r,
                                         v1::RegisterWorkerResponse* out) {
  KV_AUTH_OR_RETURN(caller, r->session_id());
  absl::StatusOr<v1::RegisterWorkerResponse> res =
      registry_->Register(caller, *r);
  if (!res.ok()) return ToGrpcStatusWithDetails(res.status());
  *out = *std::move(res);
  return grpc::Status::OK;
}

grpc::Status StepService::Step(grpc::ServerContext*, const v1::StepRequest* r,
                               v1::StepResponse* out) {
  KV_AUTH_OR_RETURN(caller, r->session_id());
  absl::StatusOr<v1::StepResponse> res = registry_->Step(caller, *r);
  if (!res.ok()) return ToGrpcStatusWithDetails(res.status());
  *out = *std::move(res);
  return grpc::Status::OK;
}

grpc::Status StepService::StepStatus(grpc::ServerContext*,
                                     const v1::StepStatusRequest* r,
                                     v1::StepStatusResponse* out) {
  KV_AUTH_OR_RETURN(caller, r->session_id());
  absl::StatusOr<v1::RegistrationInfo> res =
      registry_->Status(caller, r->registration_id());
  if (!res.ok()) return ToGrpcStatusWithDetails(res.status());
  *out->mutable_registration() = *std::move(res);
  return grpc::Status::OK;
}

grpc::Status StepService::Unregister(grpc::ServerContext*,
                                     const v1::UnregisterRequest* r,
                                     v1::UnregisterResponse*) {
  KV_AUTH_OR_RETURN(caller, r->session_id());
  return ToGrpcStatusWithDetails(
      registry_->Unregister(caller, r->registration_id()));
}

grpc::Status StepService::GrantRegistration(
    grpc::ServerContext*, const v1::GrantRegistrationRequest* r,
    v1::GrantRegistrationResponse*) {
  KV_AUTH_OR_RETURN(caller, r->session_id());
  return ToGrpcStatusWithDetails(registry_->Grant(caller, *r));
}

grpc::Status StepService::ListRegistrations(
    grpc::ServerContext*, const v1::ListRegistrationsRequest* r,
    v1::ListRegistrationsResponse* out) {
  KV_AUTH_OR_RETURN(caller, r->session_id());
  for (v1::RegistrationInfo& info : registry_->List(caller)) {
    *out->add_registrations() = std::move(info);
  }
  return grpc::Status::OK;
}

}  // namespace kvdepot::step
