// The worker library's one kernel (host-only header).
#ifndef KVDEPOT_WORKER_WORKER_KERNELS_H_
#define KVDEPOT_WORKER_WORKER_KERNELS_H_

#include <cstdint>

namespace kvdepot::worker {

// One thread: doorbell[kStepCounter] += 1; doorbell[kStepIdWord] = the new
// value. Returns the launch's cudaError_t as int.
int LaunchStepBegin(uint64_t* doorbell, void* stream);

}  // namespace kvdepot::worker

#endif  // KVDEPOT_WORKER_WORKER_KERNELS_H_
