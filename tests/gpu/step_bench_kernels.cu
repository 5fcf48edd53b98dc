#include <cuda_runtime.h>

#include "tests/gpu/step_bench_kernels.h"

namespace kvdepot::testing {
namespace {

__device__ uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void SpinKernel(int64_t ns) {
  const uint64_t end = GlobalTimer() + static_cast<uint64_t>(ns);
  while (GlobalTimer() < end) {
  }
}

}  // namespace

int LaunchSpin(int64_t ns, void* stream) {
  if (ns <= 0) return 0;
  SpinKernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(ns);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kvdepot::testing
