// The daemon's step-path registrations (SPEC §10, docs/STEP_PATH.md): who
// owns and may drive each one, the step-id bookkeeping, the queue depth,
// and the host side of the watchdog (a step past its deadline, or a
// worker whose companion session closed, is cancelled through its engine).
// Nothing here touches a GPU: the engine does, so all of it runs in CI
// against a test double.
#ifndef KVDEPOT_SERVER_STEP_STEP_REGISTRY_H_
#define KVDEPOT_SERVER_STEP_STEP_REGISTRY_H_

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvdepot/v1/step.pb.h"
#include "server/access.h"
#include "server/pools.h"
#include "server/sessions.h"
#include "server/step/step_config.h"
#include "server/step/step_engine.h"
#include "server/step/step_histogram.h"

namespace kvdepot::step {

struct RegistryOptions {
  int max_registrations = 64;
  int max_registrations_per_session = 16;
  absl::Duration default_deadline = absl::Seconds(10);
  // How often the watchdog thread runs (0 = no thread; tests call Watch).
  absl::Duration watch_interval = absl::Milliseconds(20);
  // A cancelled registration whose owner's session is gone is kept this
  // long (for StepStatus / kvcachectl) once nothing is in flight, then
  // removed.
  absl::Duration dead_retention = absl::Seconds(60);
};

// Counters for metrics (all registrations, since start).
struct StepCounters {
  int64_t registrations = 0;  // live
  int64_t steps_accepted = 0;
  int64_t steps_completed = 0;
  int64_t steps_rejected_queue_full = 0;
  int64_t steps_with_status = 0;  // finished with a status bit set
  int64_t cancels = 0;
  int64_t watchdog_expiries = 0;
  int64_t out_of_range = 0;
  // Steps whose CUDA graph was instantiated anew instead of updated in
  // place (a new batch shape; each costs the daemon milliseconds of CPU).
  int64_t graph_instantiations = 0;
  int64_t steps_planned = 0;  // PlanStep replies (library mode)
};

class StepRegistry {
 public:
  StepRegistry(StepEngineFactory* factory, const PoolRegistry* pools,
               const SessionManager* sessions, RegistryOptions options);
  StepRegistry(const StepRegistry&) = delete;
  StepRegistry& operator=(const StepRegistry&) = delete;
  // Stops the watchdog and cancels every registration.
  ~StepRegistry();

  absl::StatusOr<v1::RegisterWorkerResponse> Register(
      const Caller& caller, const v1::RegisterWorkerRequest& request);
  // Checks (owner or granted; not cancelled; step_id = previous + 1; fewer
  // than kMaxInFlight in flight), builds the plan and enqueues it.
  absl::StatusOr<v1::StepResponse> Step(const Caller& caller,
                                        const v1::StepRequest& request);
  // Library mode (Step.PlanStep): the same checks as Step but the step id
  // and the queue, then the plan as its caller's kernels take it
  // (plan_export.h). Enqueues nothing and changes no state but a counter.
  absl::StatusOr<v1::PlanStepResponse> PlanStep(const Caller& caller,
                                                const v1::StepRequest& request);
  absl::StatusOr<v1::RegistrationInfo> Status(const Caller& caller,
                                              uint64_t id) const;
  // Owner or admin. Cancels unfinished steps; the engine is destroyed once
  // they finished (by the watchdog thread, never on the caller's thread).
  absl::Status Unregister(const Caller& caller, uint64_t id);
  absl::Status Grant(const Caller& caller,
                     const v1::GrantRegistrationRequest& request);
  // The registrations the caller may see (owned, granted; all for admin).
  std::vector<v1::RegistrationInfo> List(const Caller& caller) const;

  // One watchdog pass at `now`: cancels registrations whose oldest step
  // passed its deadline or whose owner's session is gone, and destroys
  // retired ones that have nothing in flight.
  void Watch(absl::Time now);

  StepCounters Counters() const;

  // The Prometheus text (format 0.0.4) of the counters, and per
  // registration: in flight, finished steps, status bits, out-of-range
  // count, cancelled, a histogram of the host-seen step time (from
  // enqueue to the completion report, which includes waiting for the
  // worker) and histograms of the GPU phase time of the timed steps (from
  // the daemon's stream passing the worker's flag to its done write, by
  // phase kind). Appended to the daemon's /metrics.
  std::string RenderPrometheus() const;

 private:
  struct Registration {
    uint64_t id = 0;
    Caller owner;
    RegistrationConfig config;
    std::unique_ptr<StepEngine> engine;
    mutable absl::Mutex mu;
    Acl acl ABSL_GUARDED_BY(mu);
    uint64_t last_step_id ABSL_GUARDED_BY(mu) = 0;
    uint64_t completed_step_id ABSL_GUARDED_BY(mu) = 0;
    std::deque<absl::Time> deadlines ABSL_GUARDED_BY(mu);  // in flight
    uint64_t status_bits ABSL_GUARDED_BY(mu) = 0;
    uint64_t out_of_range ABSL_GUARDED_BY(mu) = 0;
    bool cancelled ABSL_GUARDED_BY(mu) = false;
    std::string cancel_reason ABSL_GUARDED_BY(mu);
    absl::Time cancelled_at ABSL_GUARDED_BY(mu);
    uint64_t steps_completed ABSL_GUARDED_BY(mu) = 0;
    uint64_t watchdog_expiries ABSL_GUARDED_BY(mu) = 0;
    // Host-seen step time (kStepLatencyBoundsUs).
    Histogram latency ABSL_GUARDED_BY(mu);
    // GPU phase time of the timed steps (kPhaseBoundsUs), by kind: the
    // begin phase, phases A (stores), phases B (convert_topk).
    std::array<Histogram, 3> phase ABSL_GUARDED_BY(mu);
  };

  absl::StatusOr<std::shared_ptr<Registration>> Find(const Caller& caller,
                                                     uint64_t id) const;
  // FAILED_PRECONDITION naming the cancel reason once `reg` is cancelled.
  static absl::Status NotCancelled(const Registration& reg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(reg.mu);
  // Cancels through the engine once; REQUIRES reg->mu held.
  void CancelLocked(Registration* reg, std::string reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(reg->mu);
  void OnComplete(Registration* reg, const StepOutcome& outcome);
  static v1::RegistrationInfo InfoOf(const Registration& reg);
  void WatchLoop();

  StepEngineFactory* const factory_;
  const PoolRegistry* const pools_;
  const SessionManager* const sessions_;
  const RegistryOptions options_;

  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::btree_map<uint64_t, std::shared_ptr<Registration>> regs_
      ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Registration>> retired_ ABSL_GUARDED_BY(mu_);
  // Lock order: mu_, then a Registration's mu, then counters_mu_ (a leaf:
  // nothing is locked while it is held).
  mutable absl::Mutex counters_mu_;
  StepCounters counters_ ABSL_GUARDED_BY(counters_mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread watcher_;
};

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_STEP_REGISTRY_H_
