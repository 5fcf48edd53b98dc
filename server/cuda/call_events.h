// One event per call of the CUDA backend: recorded once after the call's
// last work on its stream and shared by everything that call used (its
// staging, the UseFence of the pool and of each device operand), instead of
// one cudaEventRecord per holder. Each record is a driver call on the
// request's critical path (rpc_device_benchmark times them); sharing keeps
// every holder's wait exact: the point it waits for is the end of the call
// that used it, nothing later on the stream.
//
// Events are recycled: when the last holder drops a CallEvent it goes back
// to a free list of its device (a later record re-arms it; waits already
// queued keep the record they were queued against, as CUDA defines).
#ifndef KVDEPOT_SERVER_CUDA_CALL_EVENTS_H_
#define KVDEPOT_SERVER_CUDA_CALL_EVENTS_H_

#include <cuda_runtime_api.h>

#include <memory>

#include "absl/status/statusor.h"

namespace kvdepot {

// A recorded event shared by its holders; get() is the cudaEvent_t.
using CallEvent = std::shared_ptr<CUevent_st>;

// Thread-safe. Events may outlive it (their holders keep the free list).
class CallEvents {
 public:
  CallEvents();
  CallEvents(const CallEvents&) = delete;
  CallEvents& operator=(const CallEvents&) = delete;

  // An event of `device` (recycled or created) recorded on `stream`, a
  // stream of that device. REQUIRES: `device` is current.
  absl::StatusOr<CallEvent> Record(int device, cudaStream_t stream);

  // Events created so far (recycling keeps this at the number of points
  // held at once, not the number of calls).
  int64_t created() const;

 private:
  struct FreeList;
  std::shared_ptr<FreeList> free_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_CUDA_CALL_EVENTS_H_
