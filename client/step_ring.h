// The scheduler's side of a step ring (common/step_ring.h,
// docs/STEP_PATH.md "Step ring"): StepRequests through shared memory with
// the daemon, no gRPC call per step. Opened on the companion connection of
// the scheduler's session (the ring belongs to that session and closes
// with it); its requests run exactly as a StepStream's messages.
//
// Submit serializes a request into the next slot and publishes it (a
// system call only when the daemon's ring thread sleeps); Collect returns
// the replies in order, sleeping on a futex while none is ready. At most
// slots() requests may be unanswered or uncollected. Not thread-safe: one
// scheduler thread drives a ring. The daemon's side stays open until
// Close() or until the companion connection closes: Close() gives its slot
// in the stream limits back. (Not the destructor: the connection may be
// gone by then, and a ring never outlives its connection on the daemon.)
#ifndef KVDEPOT_CLIENT_STEP_RING_H_
#define KVDEPOT_CLIENT_STEP_RING_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/companion_connection.h"
#include "common/memfd.h"
#include "common/step_ring.h"
#include "common/unique_fd.h"
#include "kvdepot/v1/kvdepot.pb.h"
#include "kvdepot/v1/step.pb.h"

namespace kvdepot {

class StepRingClient {
 public:
  // Opens a ring on `companion` (slots and request_bytes 0 = the daemon's
  // defaults, 4 and 1 MiB).
  static absl::StatusOr<std::unique_ptr<StepRingClient>> Open(
      CompanionConnection* companion, int32_t slots = 0,
      int64_t request_bytes = 0);
  // Maps a ring from its descriptor (a sealed memfd of `fd_size` bytes)
  // and the daemon's description of it; checks the header against it.
  static absl::StatusOr<std::unique_ptr<StepRingClient>> Map(
      UniqueFd fd, int64_t fd_size, const v1::StepRingInfo& info);

  StepRingClient(const StepRingClient&) = delete;
  StepRingClient& operator=(const StepRingClient&) = delete;

  // Asks the daemon to close the ring (close_step_ring) when it was opened
  // here (Open); the mapping stays until destruction. Idempotent.
  // REQUIRES: the companion connection it was opened on is still open.
  absl::Status Close();

  // Publishes `request`; returns its number. RESOURCE_EXHAUSTED when
  // slots() requests are uncollected, INVALID_ARGUMENT ("request") when it
  // does not fit a slot, and the closing message when the ring is closed
  // (UNAVAILABLE: the daemon closed it; FAILED_PRECONDITION: it failed).
  absl::StatusOr<uint32_t> Submit(const v1::StepRequest& request);
  // The oldest uncollected reply, waiting at most `timeout`
  // (DEADLINE_EXCEEDED). FAILED_PRECONDITION when nothing is uncollected;
  // the closing message when the ring closed before the reply came.
  absl::StatusOr<v1::StepResponse> Collect(absl::Duration timeout);
  // Submit and Collect, with nothing else uncollected.
  absl::StatusOr<v1::StepResponse> Step(const v1::StepRequest& request,
                                        absl::Duration timeout);

  uint64_t ring_id() const { return ring_id_; }
  uint32_t slots() const { return view_.slots(); }
  int64_t request_capacity() const { return view_.request_capacity(); }
  int uncollected() const { return static_cast<int>(submitted_ - collected_); }
  // The ring's state word and closing message (kStepRingOpen: "").
  uint32_t state() const;
  std::string closing_message() const { return view_.Message(); }
  // The mapping (tests write into it as a hostile scheduler would).
  const StepRingView& view() const { return view_; }

 private:
  StepRingClient(MemfdRegion region, const v1::StepRingInfo& info);
  // The closing message as a status, or OK while open.
  absl::Status ClosedStatus() const;

  MemfdRegion region_;
  StepRingView view_;
  CompanionConnection* companion_ = nullptr;  // Open's; null after Close
  uint64_t ring_id_ = 0;
  uint32_t submitted_ = 0;
  uint32_t collected_ = 0;
};

}  // namespace kvdepot

#endif  // KVDEPOT_CLIENT_STEP_RING_H_
