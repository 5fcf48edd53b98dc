#include <cuda_runtime.h>

#include "tests/gpu/shared_prefill_kernels.h"

namespace kvdepot::testing {
namespace {

__device__ uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void DelayKernel(int64_t ns) {
  const uint64_t end = GlobalTimer() + static_cast<uint64_t>(ns);
  while (GlobalTimer() < end) {
  }
}

// rows, snapshot: [bytes]; a grid-stride byte copy (a test, not a
// benchmark).
__global__ void ReadKernel(const uint8_t* rows, uint8_t* snapshot,
                           int64_t bytes) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < bytes;
       i += stride) {
    snapshot[i] = rows[i];
  }
}

}  // namespace

int LaunchDelayedRead(const uint8_t* rows, uint8_t* snapshot, int64_t bytes,
                      int64_t delay_ns, void* stream) {
  auto st = static_cast<cudaStream_t>(stream);
  if (delay_ns > 0) {
    DelayKernel<<<1, 32, 0, st>>>(delay_ns);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
      return static_cast<int>(e);
    }
  }
  if (bytes <= 0) return 0;
  ReadKernel<<<256, 256, 0, st>>>(rows, snapshot, bytes);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kvdepot::testing
