// What runs a registration's steps: the CUDA engine (cuda_engine.h) on the
// GPU host, a test double in CI. The registry (step_registry.h) owns the
// host-side rules (step ids, queue depth, access, watchdog deadlines); an
// engine only enqueues and cancels.
#ifndef KVDEPOT_SERVER_STEP_STEP_ENGINE_H_
#define KVDEPOT_SERVER_STEP_STEP_ENGINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/step/step_config.h"
#include "server/step/step_plan.h"

namespace kvdepot::step {

// At most this many steps of one registration are in flight (accepted and
// not finished on the GPU); one more is RESOURCE_EXHAUSTED.
inline constexpr int kMaxInFlight = 2;

// A finished step as the device saw it.
struct StepOutcome {
  uint64_t step_id = 0;
  uint64_t status_bits = 0;   // the doorbell's sticky status word
  uint64_t out_of_range = 0;  // the doorbell's out-of-range count
  // Host-side wall time from the first phase wait being enqueued to the
  // step's completion callback (0 when the engine cannot tell).
  double step_us = 0;
  // A timed step's GPU time of every phase (doorbell::NumPhases, in phase
  // order), from the gate's start (just after the daemon's stream passed
  // the worker's flag) to the end of the phase's kernels; empty when the
  // step was not timed or was cut short.
  std::vector<float> phase_us;
  // The step's CUDA graph was instantiated anew (first of its shape, or
  // the update failed), not updated in place.
  bool graph_instantiated = false;
};

using CompletionFn = std::function<void(const StepOutcome&)>;

class StepEngine {
 public:
  virtual ~StepEngine() = default;
  // Queues the step and returns without waiting for the GPU. REQUIRES:
  // fewer than kMaxInFlight steps of this engine unfinished. The
  // completion function runs once per enqueued step, cancelled steps
  // included, holding no engine lock: on the engine's thread, or (CUDA) on
  // the driver's host-function thread as soon as the GPU finished the step;
  // it must not call CUDA.
  virtual absl::Status Enqueue(StepPlan plan) = 0;
  // Writes the cancel word, then releases every phase of the unfinished
  // steps (memory writes from a control stream only). Idempotent; the
  // registration is dead afterwards.
  virtual void Cancel() = 0;
};

class StepEngineFactory {
 public:
  virtual ~StepEngineFactory() = default;
  // FAILED_PRECONDITION where the backend has no step path (CPU).
  virtual absl::StatusOr<std::unique_ptr<StepEngine>> Create(
      const RegistrationConfig& config, CompletionFn done) = 0;
};

// The factory of a backend without a GPU: every Create fails with
// FAILED_PRECONDITION naming the backend.
std::unique_ptr<StepEngineFactory> MakeUnavailableEngineFactory(
    std::string backend_name);

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_STEP_ENGINE_H_
