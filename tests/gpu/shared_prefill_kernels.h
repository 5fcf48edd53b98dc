// The worker side of the shared prefill tests (host-only header): a
// stand-in for the source layer's attention that starts late and reads the
// rows a consumer load overwrites in place.
#ifndef KVDEPOT_TESTS_GPU_SHARED_PREFILL_KERNELS_H_
#define KVDEPOT_TESTS_GPU_SHARED_PREFILL_KERNELS_H_

#include <cstdint>

namespace kvdepot::testing {

// Queues on `stream`: one block spinning on the GPU's global timer for
// `delay_ns` nanoseconds (the attention "artificially delayed"), then a
// copy of `bytes` bytes from `rows` (device memory, e.g. prefill buffer
// rows [0, main_kv_offset)) to `snapshot` (what the attention read).
// Returns the first launch's cudaError_t as int (0 = cudaSuccess).
int LaunchDelayedRead(const uint8_t* rows, uint8_t* snapshot, int64_t bytes,
                      int64_t delay_ns, void* stream);

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_GPU_SHARED_PREFILL_KERNELS_H_
