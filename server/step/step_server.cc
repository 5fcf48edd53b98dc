#include "server/step/step_server.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

#ifdef KVDEPOT_HAVE_CUDA
#include "server/step/cuda_engine.h"
#endif

namespace kvdepot::step {

StepServer::StepServer(std::unique_ptr<StepEngineFactory> factory,
                       const PoolRegistry* pools, SessionManager* sessions,
                       const StepServerOptions& options)
    : factory_(std::move(factory)),
      registry_(factory_.get(), pools, sessions, options.registry),
      pool_("kvdepot-step", options.worker_threads, options.max_queued_calls),
      service_(&registry_, sessions, &pool_, options.service),
      rings_(&registry_, sessions, service_.stream_slots()) {}

absl::StatusOr<std::unique_ptr<StepServer>> MakeStepServer(
    std::unique_ptr<StepEngineFactory> factory, const PoolRegistry* pools,
    SessionManager* sessions, const StepServerOptions& options) {
  if (options.service.max_streams < 1 ||
      options.service.max_streams_per_session < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_step_streams = ", options.service.max_streams,
        ", --max_step_streams_per_session = ",
        options.service.max_streams_per_session, ": each must be >= 1"));
  }
  if (options.worker_threads < 1 || options.worker_threads > 1024 ||
      options.max_queued_calls < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step workers: ", options.worker_threads, " threads (in [1, 1024]), ",
        options.max_queued_calls, " queued calls (>= 1)"));
  }
  return std::make_unique<StepServer>(std::move(factory), pools, sessions,
                                      options);
}

absl::StatusOr<std::unique_ptr<StepServer>> MakeStepServer(
    const Backend& backend, const PoolRegistry* pools, SessionManager* sessions,
    const StepServerOptions& options) {
  std::unique_ptr<StepEngineFactory> factory;
#ifdef KVDEPOT_HAVE_CUDA
  if (backend.name() == "cuda") {
    CudaEngineOptions cuda;
    cuda.graphs = options.graphs;
    cuda.pdl = options.pdl;
    cuda.timing_every = options.timing_every;
    factory = MakeCudaEngineFactory(cuda);
  }
#endif
  if (factory == nullptr) {
    factory = MakeUnavailableEngineFactory(std::string(backend.name()));
  }
  return MakeStepServer(std::move(factory), pools, sessions, options);
}

}  // namespace kvdepot::step
