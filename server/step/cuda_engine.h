// The CUDA engine of the step path (SPEC §10, docs/STEP_PATH.md): per
// registration a work stream and a control stream (non-blocking), two
// staging slots in device memory with their pinned host twins, and one
// enqueue thread. A step's metadata goes up with one copy; then every
// phase waits on its doorbell flag (cuStreamWaitValue64), resets it, runs
// the gate kernel and the phase's kernels, and writes done. Completion is
// reported by a host function at the end of the step (by default the whole
// step is one CUDA graph launch: CudaEngineOptions); cancellation writes
// the cancel word and releases the flags from the control stream (memory
// writes only, never a kernel).
#ifndef KVDEPOT_SERVER_STEP_CUDA_ENGINE_H_
#define KVDEPOT_SERVER_STEP_CUDA_ENGINE_H_

#include <memory>

#include "server/step/step_engine.h"

namespace kvdepot::step {

struct CudaEngineOptions {
  // Each step captured into a CUDA graph and launched as one operation (the
  // slot's executable graph updated when only parameters changed), instead
  // of ~12 stream operations per layer.
  bool graphs = true;
  // Phase kernels after the first (the stores after the gate, one after
  // another) launched with Programmatic Dependent Launch: each is launched
  // while the previous one drains and waits for it on the GPU.
  bool pdl = true;
  // Every Nth step (step_id % N == 0) stamps each phase with the GPU's
  // global timer (the gate at its start, a one-thread kernel after its
  // kernels) and reads the stamps back with the step's header; the phase
  // times reach the registry's histograms with its outcome. 0 = never.
  int timing_every = 16;
};

// FAILED_PRECONDITION from Create unless the daemon's environment passes
// doorbell::CheckStepEnvironment() and the driver entry points load.
std::unique_ptr<StepEngineFactory> MakeCudaEngineFactory(
    const CudaEngineOptions& options = {});

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_CUDA_ENGINE_H_
