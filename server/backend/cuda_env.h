// The process environment the CUDA backend needs (SPEC §10, GPU_HOST.md
// hazards, measured on the GPU host with a stream parked in a wait):
// - CUDA_MODULE_LOADING=EAGER: with lazy loading (CUDA 13's default) the
//   first launch of a kernel not yet loaded hangs the launching thread
//   while any stream of the context is parked;
// - CUDA_DEVICE_MAX_CONNECTIONS unset (8) or >= 8: with 1 or 2 other
//   streams queue behind a parked one and a release never lands.
// Both are read by the driver when CUDA initializes, so they must be right
// before the first CUDA call of the process. No CUDA headers here.
#ifndef KVDEPOT_SERVER_BACKEND_CUDA_ENV_H_
#define KVDEPOT_SERVER_BACKEND_CUDA_ENV_H_

#include "absl/status/status.h"

namespace kvdepot {

inline constexpr int kMinCudaDeviceConnections = 8;

// OK when the environment is what the CUDA backend needs;
// FAILED_PRECONDITION naming the variable, its value and the fix otherwise.
absl::Status CheckCudaEnvironment();

// For main(), before any CUDA call: sets CUDA_MODULE_LOADING=EAGER when it
// is unset, then CheckCudaEnvironment(). A value the operator set (LAZY,
// or too few connections) is refused, never overridden.
absl::Status PrepareCudaEnvironment();

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_BACKEND_CUDA_ENV_H_
