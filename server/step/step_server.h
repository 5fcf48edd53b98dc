// The step path inside the daemon (the one hook server/daemon.cc calls):
// picks the engine for the backend (CUDA, or one that refuses every
// registration), owns the registry and the gRPC service, and registers the
// service with the daemon's ServerBuilder.
#ifndef KVDEPOT_SERVER_STEP_STEP_SERVER_H_
#define KVDEPOT_SERVER_STEP_STEP_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <memory>

#include "absl/status/statusor.h"
#include "server/backend/backend.h"
#include "server/pools.h"
#include "server/sessions.h"
#include "server/step/step_engine.h"
#include "server/step/step_registry.h"
#include "server/step/step_service.h"

namespace kvdepot::step {

class StepServer {
 public:
  StepServer(std::unique_ptr<StepEngineFactory> factory,
             const PoolRegistry* pools, SessionManager* sessions,
             RegistryOptions options);

  StepRegistry* registry() { return &registry_; }
  StepService* service() { return &service_; }

 private:
  std::unique_ptr<StepEngineFactory> factory_;
  StepRegistry registry_;
  StepService service_;
};

// The CUDA engine's settings (cuda_engine.h CudaEngineOptions, which this
// header cannot name in a build without CUDA).
struct StepEngineSettings {
  bool graphs = true;
  bool pdl = true;
  int timing_every = 16;
};

// The step path for `backend`: the CUDA engine on the CUDA backend, else
// one that refuses every registration. The caller registers service() with
// its ServerBuilder; the result must outlive the server.
std::unique_ptr<StepServer> MakeStepServer(
    const Backend& backend, const PoolRegistry* pools, SessionManager* sessions,
    const StepEngineSettings& settings = {});

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_STEP_SERVER_H_
