// Sending a Step while a scheduler keeps two steps of a registration in
// flight (docs/STEP_PATH.md, "Scheduler, per step").
//
// The daemon admits at most kMaxInFlight (2) steps per registration; a third
// is RESOURCE_EXHAUSTED and consumes no step id. A step stops counting when
// the daemon's completion report has run: the host function its enqueue
// thread queues on the work stream after the last phase, the kDaemonDone
// write and the doorbell header's readback, then that thread passing the
// outcome to the registry (server/step/cuda_engine.cc, OnHostDone;
// StepRegistry::OnComplete). The worker's stream passing the step's last
// wait(B) is earlier than that, by a host callback and a thread wake-up
// (tens of us; more when the daemon's and the worker's contexts
// time-slice the GPU without MPS). So a scheduler that sends step s+2 as
// soon as the worker finished step s is refused now and then.
//
// The refusal is the only exact signal a scheduler has (StepStatus per step
// would cost one more RPC per step, and kDaemonDone in the doorbell is
// written before the report), so the answer is the documented one: send the
// same step again, with a short backoff, for a bounded time. Other codes are
// returned at once.
#ifndef KVDEPOT_TESTS_GPU_STEP_SEND_RETRY_H_
#define KVDEPOT_TESTS_GPU_STEP_SEND_RETRY_H_

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"

namespace kvdepot::testing {

struct InFlightRetry {
  // How long to keep sending again, from the first refusal. A step the
  // worker never finishes is cancelled by its deadline (10 s by default),
  // after which the daemon answers FAILED_PRECONDITION (not retried).
  absl::Duration budget = absl::Seconds(10);
  absl::Duration first_backoff = absl::Microseconds(20);  // doubles per retry
  absl::Duration max_backoff = absl::Milliseconds(1);
};

// Calls send() (one Step RPC for the same step id) until it returns
// anything but RESOURCE_EXHAUSTED or `retry.budget` has passed since the
// first refusal; then returns that status (the last refusal's message gains
// the number of retries). *retries (may be null) gets how many times the
// step was sent again.
absl::Status SendRespectingDepth(absl::FunctionRef<absl::Status()> send,
                                 const InFlightRetry& retry = {},
                                 int* retries = nullptr);

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_GPU_STEP_SEND_RETRY_H_
