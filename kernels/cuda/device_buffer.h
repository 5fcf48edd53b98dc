// A move-only owner of device memory for the GPU tests and the benchmark.
#ifndef KVDEPOT_KERNELS_CUDA_DEVICE_BUFFER_H_
#define KVDEPOT_KERNELS_CUDA_DEVICE_BUFFER_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/cuda/cuda_status.h"

namespace kvdepot::gpu {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(o.bytes_) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }

  // Allocates `bytes` (at least 1) of uninitialized device memory.
  static absl::StatusOr<DeviceBuffer> Open(size_t bytes) {
    DeviceBuffer b;
    RETURN_IF_CUDA_ERROR(cudaMalloc(&b.ptr_, bytes == 0 ? 1 : bytes),
                         "cudaMalloc");
    b.bytes_ = bytes;
    return b;
  }

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

  absl::Status CopyFrom(const void* host, size_t bytes, size_t offset = 0) {
    if (bytes == 0) return absl::OkStatus();
    RETURN_IF_CUDA_ERROR(cudaMemcpy(static_cast<uint8_t*>(ptr_) + offset, host,
                                    bytes, cudaMemcpyHostToDevice),
                         "copying to the device");
    return absl::OkStatus();
  }
  absl::Status CopyTo(void* host, size_t bytes, size_t offset = 0) const {
    if (bytes == 0) return absl::OkStatus();
    RETURN_IF_CUDA_ERROR(cudaMemcpy(host, static_cast<uint8_t*>(ptr_) + offset,
                                    bytes, cudaMemcpyDeviceToHost),
                         "copying from the device");
    return absl::OkStatus();
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace kvdepot::gpu

#endif  // KVDEPOT_KERNELS_CUDA_DEVICE_BUFFER_H_
