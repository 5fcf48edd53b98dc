// One conversion from CUDA runtime errors to absl::Status, plus a
// return-if-error macro, so every CUDA call site reports the same way:
//   RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(...), "copying slot_mapping");
#ifndef KVDEPOT_COMMON_CUDA_CUDA_STATUS_H_
#define KVDEPOT_COMMON_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvdepot::gpu {

// OK for cudaSuccess; otherwise a status whose message names `detail`, the
// error's symbol and its description. Out-of-memory becomes
// RESOURCE_EXHAUSTED, bad arguments INVALID_ARGUMENT, a missing or
// unusable device FAILED_PRECONDITION, everything else INTERNAL.
absl::Status ToStatus(cudaError_t error, absl::string_view detail);

}  // namespace kvdepot::gpu

#define RETURN_IF_CUDA_ERROR(expr, detail)                       \
  do {                                                           \
    const cudaError_t kv_cuda_error_ = (expr);                   \
    if (kv_cuda_error_ != cudaSuccess) {                         \
      return ::kvdepot::gpu::ToStatus(kv_cuda_error_, (detail)); \
    }                                                            \
  } while (false)

#endif  // KVDEPOT_COMMON_CUDA_CUDA_STATUS_H_
