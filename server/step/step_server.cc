#include "server/step/step_server.h"

#include <string>
#include <utility>

#ifdef KVDEPOT_HAVE_CUDA
#include "server/step/cuda_engine.h"
#endif

namespace kvdepot::step {

StepServer::StepServer(std::unique_ptr<StepEngineFactory> factory,
                       const PoolRegistry* pools, SessionManager* sessions,
                       RegistryOptions options)
    : factory_(std::move(factory)),
      registry_(factory_.get(), pools, sessions, options),
      service_(&registry_, sessions) {}

std::unique_ptr<StepServer> MakeStepServer(const Backend& backend,
                                           const PoolRegistry* pools,
                                           SessionManager* sessions,
                                           const StepEngineSettings& settings) {
  std::unique_ptr<StepEngineFactory> factory;
#ifdef KVDEPOT_HAVE_CUDA
  if (backend.name() == "cuda") {
    CudaEngineOptions options;
    options.graphs = settings.graphs;
    options.pdl = settings.pdl;
    options.timing_every = settings.timing_every;
    factory = MakeCudaEngineFactory(options);
  }
#else
  (void)settings;
#endif
  if (factory == nullptr) {
    factory = MakeUnavailableEngineFactory(std::string(backend.name()));
  }
  return std::make_unique<StepServer>(std::move(factory), pools, sessions,
                                      RegistryOptions());
}

}  // namespace kvdepot::step
