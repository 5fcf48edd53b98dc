#include "common/cuda/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace kvdepot::gpu {

absl::Status ToStatus(cudaError_t error, absl::string_view detail) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message =
      absl::StrCat(detail, ": CUDA error ", static_cast<int>(error), " (",
                   cudaGetErrorName(error), "): ", cudaGetErrorString(error));
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidConfiguration:
      return absl::InvalidArgumentError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorInvalidDevice:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace kvdepot::gpu
