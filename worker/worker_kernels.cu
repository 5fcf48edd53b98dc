#include <cuda_runtime.h>

#include "proto/step_doorbell.h"
#include "worker/worker_kernels.h"

namespace kvdepot::worker {
namespace {

__global__ void StepBeginKernel(uint64_t* doorbell) {
  volatile uint64_t* words = doorbell;
  const uint64_t step = words[doorbell::kStepCounter] + 1;
  words[doorbell::kStepCounter] = step;
  words[doorbell::kStepIdWord] = step;
  __threadfence_system();
}

}  // namespace

int LaunchStepBegin(uint64_t* doorbell, void* stream) {
  StepBeginKernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(doorbell);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kvdepot::worker
