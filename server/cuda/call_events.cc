#include "server/cuda/call_events.h"

#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "common/cuda/cuda_status.h"
#include "common/status_macros.h"

namespace kvdepot {

struct CallEvents::FreeList {
  ~FreeList() {
    for (auto& [device, events] : free) {
      for (cudaEvent_t e : events) (void)cudaEventDestroy(e);
    }
  }
  mutable absl::Mutex mu;
  absl::flat_hash_map<int, std::vector<cudaEvent_t>> free ABSL_GUARDED_BY(mu);
  int64_t created ABSL_GUARDED_BY(mu) = 0;
};

CallEvents::CallEvents() : free_(std::make_shared<FreeList>()) {}

int64_t CallEvents::created() const {
  absl::MutexLock lock(&free_->mu);
  return free_->created;
}

absl::StatusOr<CallEvent> CallEvents::Record(int device, cudaStream_t stream) {
  cudaEvent_t e = nullptr;
  {
    absl::MutexLock lock(&free_->mu);
    std::vector<cudaEvent_t>& list = free_->free[device];
    if (!list.empty()) {
      e = list.back();
      list.pop_back();
    }
  }
  if (e == nullptr) {
    RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                         "cudaEventCreateWithFlags (a call's event)");
    absl::MutexLock lock(&free_->mu);
    ++free_->created;
  }
  // Owned from here: a failed record gives the event back.
  CallEvent event(e, [list = free_, device](cudaEvent_t ev) {
    absl::MutexLock lock(&list->mu);
    list->free[device].push_back(ev);
  });
  RETURN_IF_CUDA_ERROR(cudaEventRecord(e, stream),
                       "recording the end of a call's work");
  return event;
}

}  // namespace kvdepot
