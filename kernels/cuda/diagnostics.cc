#include "kernels/cuda/diagnostics.h"

#include <cuda_runtime_api.h>

#include "common/cuda/cuda_status.h"
#include "kernels/cuda/launch_internal.h"

namespace kvdepot::gpu {

absl::Status LaunchEmptyKernel(const LaunchOptions& options) {
  RETURN_IF_CUDA_ERROR(
      internal::LaunchEmpty(
          {static_cast<cudaStream_t>(options.stream), options.pdl}),
      "launching the empty kernel");
  return absl::OkStatus();
}

absl::StatusOr<EncoderCheck> CheckEncoders() {
  unsigned long long* counts = nullptr;
  uint32_t* first = nullptr;
  RETURN_IF_CUDA_ERROR(
      cudaMalloc(reinterpret_cast<void**>(&counts), 4 * sizeof(*counts)),
      "allocating counters");
  RETURN_IF_CUDA_ERROR(
      cudaMalloc(reinterpret_cast<void**>(&first), 4 * sizeof(*first)),
      "allocating counters");
  EncoderCheck check;
  unsigned long long host_counts[4] = {0, 0, 0, 0};
  uint32_t host_first[4] = {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu};
  cudaError_t e = cudaMemcpy(counts, host_counts, sizeof(host_counts),
                             cudaMemcpyHostToDevice);
  if (e == cudaSuccess) {
    e = cudaMemcpy(first, host_first, sizeof(host_first),
                   cudaMemcpyHostToDevice);
  }
  if (e == cudaSuccess) e = internal::LaunchEncodeCheck(counts, first, {});
  if (e == cudaSuccess) {
    e = cudaMemcpy(host_counts, counts, sizeof(host_counts),
                   cudaMemcpyDeviceToHost);
  }
  if (e == cudaSuccess) {
    e = cudaMemcpy(host_first, first, sizeof(host_first),
                   cudaMemcpyDeviceToHost);
  }
  cudaFree(counts);
  cudaFree(first);
  RETURN_IF_CUDA_ERROR(e, "running the encoder check");
  check.e4m3_mismatches = host_counts[0];
  check.e2m1_mismatches = host_counts[1];
  check.first_e4m3 = host_first[0];
  check.first_e2m1 = host_first[1];
  check.ds_mla_scale_mismatches = host_counts[2];
  check.first_ds_mla_scale = host_first[2];
  check.ue8m0_scale_mismatches = host_counts[3];
  check.first_ue8m0_scale = host_first[3];
  return check;
}

}  // namespace kvdepot::gpu
