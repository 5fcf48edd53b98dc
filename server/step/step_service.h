// The kvdepot.v1.Step gRPC service (proto/kvdepot/v1/step.proto): the
// service edge of the step path, on gRPC's callback API like the KVCache
// service (server/serving.h). Each handler authenticates the call's
// session and runs the registry. Step, StepStatus, GrantRegistration and
// ListRegistrations are host work only (checks, plan, enqueue) and run on
// the gRPC thread that read them; RegisterWorker (device allocations,
// uploads, engine creation) and Unregister (it cancels through the
// engine) run on a bounded WorkerPool, and a full pool answers
// RESOURCE_EXHAUSTED at once. No handler waits for the GPU.
//
// StepStream (step_stream.h) is a bidirectional stream of Steps: read,
// the same registry Step as the unary call, write, read; an idle stream
// holds no thread.
#ifndef KVDEPOT_SERVER_STEP_STEP_SERVICE_H_
#define KVDEPOT_SERVER_STEP_STEP_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "kvdepot/v1/step.grpc.pb.h"
#include "server/memory_budget.h"
#include "server/sessions.h"
#include "server/step/step_registry.h"
#include "server/step/stream_slots.h"
#include "server/worker_pool.h"

namespace kvdepot::step {

// PlanStep requests of at least this many row-table entries (num_tokens x
// block_table_cols) are planned off the gRPC callback threads.
inline constexpr int64_t kPlanStepInlineEntries = int64_t{1} << 14;

class StepStreamReactor;

// The StepResponse that answers a message of a StepStream or a step ring:
// `res` itself when the step was accepted, else the refusal as
// error_code, error_message and error_field (ViolatedField) with
// step_id = `step_id`.
v1::StepResponse StepReplyOf(uint64_t step_id,
                             absl::StatusOr<v1::StepResponse> res);

struct StepServiceOptions {
  // Open StepStreams in the daemon and per session (docs/DAEMON.md,
  // --max_step_streams, --max_step_streams_per_session); each >= 1.
  int max_streams = 64;
  int max_streams_per_session = 4;
  // PlanStep replies (up to 64 MiB each) are admitted against the daemon's
  // reply budget (server/reply_scope.h) and held until each call is done;
  // null admits everything. Not owned.
  MemoryBudget* replies = nullptr;
};

class StepService final : public v1::Step::CallbackService {
 public:
  // `pool` runs RegisterWorker and Unregister; everything must outlive
  // the gRPC server.
  StepService(StepRegistry* registry, SessionManager* sessions,
              WorkerPool* pool, StepServiceOptions options);

  using Ctx = grpc::CallbackServerContext;
  grpc::ServerUnaryReactor* RegisterWorker(
      Ctx* ctx, const v1::RegisterWorkerRequest* request,
      v1::RegisterWorkerResponse* response) override;
  grpc::ServerUnaryReactor* Step(Ctx* ctx, const v1::StepRequest* request,
                                 v1::StepResponse* response) override;
  grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* StepStream(
      Ctx* ctx) override;
  // Builds the plan on the gRPC thread, as Step does (host work only), or
  // on a step worker when num_tokens x block_table_cols reaches
  // kPlanStepInlineEntries.
  grpc::ServerUnaryReactor* PlanStep(Ctx* ctx, const v1::StepRequest* request,
                                     v1::PlanStepResponse* response) override;
  grpc::ServerUnaryReactor* StepStatus(
      Ctx* ctx, const v1::StepStatusRequest* request,
      v1::StepStatusResponse* response) override;
  grpc::ServerUnaryReactor* Unregister(
      Ctx* ctx, const v1::UnregisterRequest* request,
      v1::UnregisterResponse* response) override;
  grpc::ServerUnaryReactor* GrantRegistration(
      Ctx* ctx, const v1::GrantRegistrationRequest* request,
      v1::GrantRegistrationResponse* response) override;
  grpc::ServerUnaryReactor* ListRegistrations(
      Ctx* ctx, const v1::ListRegistrationsRequest* request,
      v1::ListRegistrationsResponse* response) override;

  // Ends every open StepStream with UNAVAILABLE and refuses new ones (the
  // daemon's drain: an open stream would hold the server's shutdown until
  // its deadline). Idempotent.
  void EndAllStreams();
  // StepStreams open now (bound or not).
  int open_streams() const { return slots_.open(); }
  // The streams' gauge and refusal counter (StreamSlots::RenderPrometheus).
  std::string RenderStreamMetrics() const { return slots_.RenderPrometheus(); }
  // The limits StepStreams and step rings share.
  StreamSlots* stream_slots() { return &slots_; }

 private:
  friend class StepStreamReactor;

  // The StepResponse that answers a message of a StepStream or a step ring:
  // `res` itself when the step was accepted, else the refusal as
  // error_code, error_message and error_field (ViolatedField) with
  // step_id = `step_id`.
  v1::StepResponse StepReplyOf(uint64_t step_id,
                               absl::StatusOr<v1::StepResponse> res);
  // Runs `call` on the pool (or answers RESOURCE_EXHAUSTED when it is
  // full); its status finishes the call.
  template <typename Call>
  grpc::ServerUnaryReactor* Offload(Ctx* ctx, Call call);
  // A StepStream reactor starts (false: draining) and ends.
  bool AddStream(StepStreamReactor* s);
  void RemoveStream(StepStreamReactor* s);

  StepRegistry* const registry_;
  SessionManager* const sessions_;
  WorkerPool* const pool_;
  MemoryBudget* const replies_;
  StreamSlots slots_;
  absl::Mutex mu_;
  absl::flat_hash_set<StepStreamReactor*> streams_ ABSL_GUARDED_BY(mu_);
  bool ending_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_STEP_SERVICE_H_
