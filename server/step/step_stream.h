// One StepStream call (step.proto, docs/STEP_PATH.md "StepStream"): a
// ServerBidiReactor that reads a StepRequest, runs the registry's Step on
// the gRPC thread that read it (the unary call's code path: session check
// per message, registry checks, enqueue; never a wait for the GPU), writes
// its StepResponse, then reads the next. One read or one write is pending
// at a time, so an idle stream holds no thread, only its reactor.
//
// Binding: the stream belongs to one session, the call's
// kvdepot-session-id metadata when it has one (checked when the call
// starts), else the first message whose session_id authenticates. A
// message naming another session is refused with PERMISSION_DENIED without
// looking the id up (no oracle for guessed ids); every message
// re-authenticates the bound session, so once it is closed every later
// message is refused (UNAUTHENTICATED). Refusals of a message are its
// reply (error_code, error_message, error_field) and the stream stays open;
// only the limits (StreamSlots) and the daemon's drain end a stream.
#ifndef KVDEPOT_SERVER_STEP_STEP_STREAM_H_
#define KVDEPOT_SERVER_STEP_STEP_STREAM_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvdepot/v1/step.pb.h"
#include "server/access.h"
#include "server/step/step_service.h"

namespace kvdepot::step {

class StepStreamReactor final
    : public grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse> {
 public:
  // Takes a daemon slot and binds from the metadata, or finishes at once.
  StepStreamReactor(StepService* service, grpc::CallbackServerContext* ctx);

  // Ends the stream with `status` (once; after a pending write).
  void End(grpc::Status status);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone() override;

 private:
  // The caller of message `r` under the binding rules above; binds an
  // unbound stream. *end receives a status that ends the stream instead
  // (the session's stream limit).
  absl::StatusOr<Caller> CallerOf(const v1::StepRequest& r, absl::Status* end)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes a slot of `caller`'s session and binds to `session_id`.
  absl::Status Bind(const Caller& caller, const std::string& session_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  StepService* const service_;
  absl::Mutex mu_;
  v1::StepRequest request_;    // reused by every read
  v1::StepResponse response_;  // reused by every write
  // Set in the constructor, read in OnDone.
  bool has_slot_ = false;  // holds a daemon slot
  bool added_ = false;     // in the service's set of streams
  uint64_t session_ ABSL_GUARDED_BY(mu_) = 0;    // bound session; 0 = none
  std::string session_id_ ABSL_GUARDED_BY(mu_);  // its id (secret)
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_wanted_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status finish_status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_STEP_STREAM_H_
