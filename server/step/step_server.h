// The step path inside the daemon (the one hook server/daemon.cc calls):
// picks the engine for the backend (CUDA, or one that refuses every
// registration), owns the registry, the gRPC service and the worker pool
// its long calls run on, and registers the service with the daemon's
// ServerBuilder.
#ifndef KVDEPOT_SERVER_STEP_STEP_SERVER_H_
#define KVDEPOT_SERVER_STEP_STEP_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/backend/backend.h"
#include "server/pools.h"
#include "server/sessions.h"
#include "server/step/step_engine.h"
#include "server/step/step_registry.h"
#include "server/step/step_rings.h"
#include "server/step/step_service.h"
#include "server/worker_pool.h"

namespace kvdepot::step {

struct StepServerOptions {
  RegistryOptions registry;
  StepServiceOptions service;
  // The pool RegisterWorker and Unregister run on (the daemon's
  // --worker_threads and --max_queued_calls).
  int worker_threads = 4;
  int max_queued_calls = 1024;
  // The CUDA engine's CudaEngineOptions (cuda_engine.h, which this header
  // cannot name in a build without CUDA).
  bool graphs = true;
  bool pdl = true;
  int timing_every = 16;
};

class StepServer {
 public:
  StepServer(std::unique_ptr<StepEngineFactory> factory,
             const PoolRegistry* pools, SessionManager* sessions,
             const StepServerOptions& options);

  StepRegistry* registry() { return &registry_; }
  StepService* service() { return &service_; }
  // What the companion socket opens step rings with.
  StepRings* rings() { return &rings_; }
  // The step path's /metrics text: the registry's, the streams' and the
  // rings'.
  std::string RenderPrometheus() const {
    return registry_.RenderPrometheus() + service_.RenderStreamMetrics() +
           rings_.RenderPrometheus();
  }

  // Before the gRPC server's Shutdown (the drain): ends the open
  // StepStreams and closes the step rings.
  void EndStreams() {
    service_.EndAllStreams();
    rings_.StopAll();
  }
  // After the gRPC server's Wait: runs the queued calls and joins the
  // pool's threads.
  void Shutdown() { pool_.Shutdown(); }

 private:
  std::unique_ptr<StepEngineFactory> factory_;
  StepRegistry registry_;
  WorkerPool pool_;
  StepService service_;
  StepRings rings_;  // last: its threads stop first
};

// The step path for `backend`: the CUDA engine on the CUDA backend, else
// one that refuses every registration. The caller registers service() with
// its ServerBuilder; the result must outlive the server. INVALID_ARGUMENT
// for limits or pool sizes below 1.
absl::StatusOr<std::unique_ptr<StepServer>> MakeStepServer(
    const Backend& backend, const PoolRegistry* pools, SessionManager* sessions,
    const StepServerOptions& options);

// The same with `factory` (tests: an engine without a GPU).
absl::StatusOr<std::unique_ptr<StepServer>> MakeStepServer(
    std::unique_ptr<StepEngineFactory> factory, const PoolRegistry* pools,
    SessionManager* sessions, const StepServerOptions& options);

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_STEP_SERVER_H_
