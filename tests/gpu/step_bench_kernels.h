// The step benchmark's synthetic worker work (host-only header).
#ifndef KVDEPOT_TESTS_GPU_STEP_BENCH_KERNELS_H_
#define KVDEPOT_TESTS_GPU_STEP_BENCH_KERNELS_H_

#include <cstdint>

namespace kvdepot::testing {

// One block that spins on the GPU's global timer for `ns` nanoseconds
// (0 launches nothing). Returns the launch's cudaError_t as int.
int LaunchSpin(int64_t ns, void* stream);

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_GPU_STEP_BENCH_KERNELS_H_
