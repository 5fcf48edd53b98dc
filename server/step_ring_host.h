// What the companion socket needs from the step path to open step rings
// (common/step_ring.h, docs/STEP_PATH.md "Step ring"): the companion
// server (server/companion.h) checks the request and admits the ring's
// memory; the step path (server/step/step_rings.h) creates the ring and
// serves it. The interface lives here so that the companion depends on no
// step code.
#ifndef KVDEPOT_SERVER_STEP_RING_HOST_H_
#define KVDEPOT_SERVER_STEP_RING_HOST_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/unique_fd.h"
#include "kvdepot/v1/kvdepot.pb.h"
#include "server/access.h"
#include "server/memory_budget.h"

namespace kvdepot {

class StepRingHost {
 public:
  virtual ~StepRingHost() = default;

  // Creates a ring of `slots` x `request_bytes` (CheckStepRingGeometry
  // passed) for `caller`'s session, whose secret id is `session_id`, and
  // starts serving it; `reservation` (its bytes) is held as long as the
  // ring. Fills `info` and returns the descriptor to hand over.
  // RESOURCE_EXHAUSTED beyond the ring limits, UNAVAILABLE while draining.
  virtual absl::StatusOr<UniqueFd> OpenRing(const Caller& caller,
                                            const std::string& session_id,
                                            int32_t slots,
                                            int64_t request_bytes,
                                            MemoryReservation reservation,
                                            v1::StepRingInfo* info) = 0;

  // Closes ring `ring_id` of `caller`'s session; NOT_FOUND when that
  // session has no such ring (another session's ring is not told apart).
  virtual absl::Status CloseRing(const Caller& caller, uint64_t ring_id) = 0;

  // Stops and frees the rings of `session` (its connection closed).
  virtual void CloseRingsOf(uint64_t session) = 0;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_STEP_RING_HOST_H_
