// Step rings (common/step_ring.h, docs/STEP_PATH.md "Step ring"): Steps
// submitted through shared memory. Each ring belongs to the companion
// session that opened it and has one thread, which sleeps on the ring's
// `submitted` word, copies each request out of the shared slot, runs the
// registry's Step exactly as StepStream does (the session authenticated
// per request, a request naming another session refused, the same checks
// and errors), writes the StepResponse into the reply slot and publishes
// it. Nothing in the ring is trusted; a `submitted` counter more than
// `slots` ahead of the daemon's `done` fails the ring (state word and
// closing message) and ends its thread. Rings count against the StepStream
// limits (--max_step_streams, --max_step_streams_per_session) and their
// memory against the session's budget; they end on close_step_ring, with
// their session's companion connection, or in the daemon's drain (a
// failed ring keeps its slot until then).
#ifndef KVDEPOT_SERVER_STEP_STEP_RINGS_H_
#define KVDEPOT_SERVER_STEP_STEP_RINGS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/memfd.h"
#include "common/step_ring.h"
#include "server/log_limiter.h"
#include "server/sessions.h"
#include "server/step/step_registry.h"
#include "server/step/stream_slots.h"
#include "server/step_ring_host.h"

namespace kvdepot::step {

class StepRings final : public StepRingHost {
 public:
  // `slots` is shared with the StepStreams; all must outlive this.
  StepRings(StepRegistry* registry, SessionManager* sessions,
            StreamSlots* slots);
  StepRings(const StepRings&) = delete;
  StepRings& operator=(const StepRings&) = delete;
  ~StepRings() override { StopAll(); }

  absl::StatusOr<UniqueFd> OpenRing(const Caller& caller,
                                    const std::string& session_id,
                                    int32_t slots, int64_t request_bytes,
                                    MemoryReservation reservation,
                                    v1::StepRingInfo* info) override;
  absl::Status CloseRing(const Caller& caller, uint64_t ring_id) override;
  void CloseRingsOf(uint64_t session) override;

  // The drain: closes every ring (state kStepRingClosed) and refuses new
  // ones. Idempotent.
  void StopAll();

  int open() const;
  // kvdepot_step_rings_open, kvdepot_step_ring_requests_total,
  // kvdepot_step_rings_failed_total.
  std::string RenderPrometheus() const;

  // How long a ring's thread sleeps at most before it looks again (it is
  // woken at once by the scheduler and by a close).
  static constexpr absl::Duration kIdleCheck = absl::Milliseconds(100);

 private:
  struct Ring {
    uint64_t id = 0;
    uint64_t session = 0;
    std::string session_id;                            // secret
    LogClient log_client = LogClient::Unidentified();  // its owner's
    MemfdRegion region;
    StepRingView view;
    MemoryReservation reservation;
    std::atomic<bool> stop{false};
    std::atomic<bool> closed{false};  // CloseRing ran
    std::thread thread;
  };

  void Serve(Ring* ring);
  // Request number n of `ring` (its slot read once, copied out, parsed).
  v1::StepResponse Handle(Ring* ring, uint32_t n, std::string* scratch,
                          v1::StepRequest* request, bool* session_ended);
  // Sets the closing message and `state`, wakes the scheduler.
  static void CloseRing(Ring& ring, uint32_t state, absl::string_view message);
  // Stops the thread of a ring taken out of rings_, closes it, frees it.
  void Retire(std::unique_ptr<Ring> ring);

  StepRegistry* const registry_;
  SessionManager* const sessions_;
  StreamSlots* const slots_;
  std::atomic<int64_t> requests_{0};
  std::atomic<int64_t> failed_{0};
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Ring>> rings_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_STEP_RINGS_H_
