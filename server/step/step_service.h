// The kvdepot.v1.Step gRPC service (proto/kvdepot/v1/step.proto): the
// service edge of the step path. Each handler authenticates the call's
// session, runs the registry (host work only: checks, plan, enqueue) and
// replies at once; no handler waits for the GPU.
#ifndef KVDEPOT_SERVER_STEP_STEP_SERVICE_H_
#define KVDEPOT_SERVER_STEP_STEP_SERVICE_H_

#include <memory>

#include "kvdepot/v1/step.grpc.pb.h"
#include "server/sessions.h"
#include "server/step/step_registry.h"

namespace kvdepot::step {

class StepService final : public v1::Step::Service {
 public:
  StepService(StepRegistry* registry, SessionManager* sessions)
      : registry_(registry), sessions_(sessions) {}

  grpc::Status RegisterWorker(grpc::ServerContext* ctx,
                              const v1::RegisterWorkerRequest* request,
                              v1::RegisterWorkerResponse* response) override;
  grpc::Status Step(grpc::ServerContext* ctx, const v1::StepRequest* request,
                    v1::StepResponse* response) override;
  grpc::Status StepStatus(grpc::ServerContext* ctx,
                          const v1::StepStatusRequest* request,
                          v1::StepStatusResponse* response) override;
  grpc::Status Unregister(grpc::ServerContext* ctx,
                          const v1::UnregisterRequest* request,
                          v1::UnregisterResponse* response) override;
  grpc::Status GrantRegistration(
      grpc::ServerContext* ctx, const v1::GrantRegistrationRequest* request,
      v1::GrantRegistrationResponse* response) override;
  grpc::Status ListRegistrations(
      grpc::ServerContext* ctx, const v1::ListRegistrationsRequest* request,
      v1::ListRegistrationsResponse* response) override;

 private:
  StepRegistry* const registry_;
  SessionManager* const sessions_;
};

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_STEP_SERVICE_H_
