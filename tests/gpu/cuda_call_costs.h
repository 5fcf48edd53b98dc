// The host cost of each CUDA runtime call the CUDA backend makes for one
// Store with record_event (server/cuda/cuda_backend.cc), measured in this
// process with the same shapes: the staging event's synchronize, the 1 KB
// slot-mapping copy from pinned memory, the store kernel's launch with
// PDL, event records (plain and interprocess). Each call is timed alone;
// with `idle_us` > 0 the thread sleeps that long before each sequence, as
// the daemon's gRPC thread idles between requests (cold caches), so the
// figures explain rpc_device_benchmark's "backend call" row.
#ifndef KVDEPOT_TESTS_GPU_CUDA_CALL_COSTS_H_
#define KVDEPOT_TESTS_GPU_CUDA_CALL_COSTS_H_

#include <vector>

#include "absl/status/statusor.h"
#include "kernels/format.h"
#include "tests/rpc_timing.h"

namespace kvdepot::testing {

// One Timing per call kind and one for the whole sequence; `tokens` slots
// of a V41-like `layout` (one layer), the kernel's inputs in device memory.
absl::StatusOr<std::vector<Timing>> MeasureCudaCallCosts(
    const PoolLayout& layout, int tokens, int iterations, int idle_us);

// CudaBackend::StoreOrdered itself in this process (the daemon's backend
// call without the daemon): `tokens` slots from a backend-allocated device
// buffer, record_event, session 1, each call timed alone after `idle_us`.
// With `threads` > 0 the calls take turns on that many threads, each asleep
// on a condition variable until its call (as gRPC's threads hand requests
// around); 0 = the calling thread. REQUIRES: CUDA_MODULE_LOADING=EAGER in
// the environment (the backend refuses to start otherwise).
absl::StatusOr<Timing> MeasureBackendStore(const PoolLayout& layout, int tokens,
                                           int iterations, int idle_us,
                                           int threads);

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_GPU_CUDA_CALL_COSTS_H_
