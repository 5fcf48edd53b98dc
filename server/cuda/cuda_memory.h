// Device memory of the CUDA backend: daemon allocations (pools and buffers,
// each its own cudaMalloc exported by IPC handle) and client allocations
// imported by handle. Both register their address ranges (DeviceRanges).
#ifndef KVDEPOT_SERVER_CUDA_CUDA_MEMORY_H_
#define KVDEPOT_SERVER_CUDA_CUDA_MEMORY_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/cuda/cuda_events.h"
#include "common/cuda/cuda_mappings.h"
#include "server/backend/backend.h"
#include "server/cuda/device_ranges.h"

namespace kvdepot {

// A zero-filled cudaMalloc of a pool or buffer, exported with
// cudaIpcGetMemHandle, with the stream its kernels run on and (created on
// first use) the interprocess event recorded after ordered requests.
class CudaAllocation final : public Memory {
 public:
  // `size` > 0 bytes on `device`; the allocation is rounded up to
  // kCudaAllocationGranularity and zero-filled in full.
  static absl::StatusOr<std::unique_ptr<CudaAllocation>> Create(
      int64_t size, int device, std::shared_ptr<DeviceRanges> ranges);

  CudaAllocation(const CudaAllocation&) = delete;
  CudaAllocation& operator=(const CudaAllocation&) = delete;
  // Waits for the device (work on any stream may use it), then frees.
  ~CudaAllocation() override;

  uint8_t* data() const override { return base_; }
  int64_t size() const override { return size_; }
  // cuda_ipc_handle of the base, size() bytes, offset 0, the device.
  void FillHandle(v1::SharedHandle* handle) const override;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }

  // Records this allocation's interprocess event on stream() and returns
  // its cudaIpcEventHandle_t bytes (the same bytes every time: a later
  // record only moves the point it marks forward on the same stream).
  absl::StatusOr<std::string> RecordEvent();

 private:
  CudaAllocation(uint8_t* base, int64_t size, int device,
                 std::shared_ptr<DeviceRanges> ranges)
      : base_(base), size_(size), device_(device), ranges_(std::move(ranges)) {}

  uint8_t* base_ = nullptr;
  int64_t size_ = 0;  // requested bytes (the allocation may be larger)
  int device_ = -1;
  std::shared_ptr<DeviceRanges> ranges_;
  cudaStream_t stream_ = nullptr;  // non-blocking, created with the memory
  std::string ipc_handle_;         // cudaIpcMemHandle_t bytes of base_

  absl::Mutex event_mu_;
  std::optional<CudaIpcEvent> event_ ABSL_GUARDED_BY(event_mu_);
};

// A client's allocation mapped by IPC handle (cached per handle and
// reference-counted by CudaIpcMapping).
class CudaImport final : public Memory {
 public:
  // REQUIRES: the caller rejected handles in ranges->IsExported.
  static absl::StatusOr<std::unique_ptr<CudaImport>> Open(
      const v1::SharedHandle& handle, std::shared_ptr<DeviceRanges> ranges);

  CudaImport(const CudaImport&) = delete;
  CudaImport& operator=(const CudaImport&) = delete;
  ~CudaImport() override;

  uint8_t* data() const override { return mapping_.data(); }
  int64_t size() const override { return mapping_.size(); }
  // Echoes the imported handle.
  void FillHandle(v1::SharedHandle* handle) const override {
    *handle = handle_;
  }

 private:
  CudaImport(CudaIpcMapping mapping, v1::SharedHandle handle,
             std::shared_ptr<DeviceRanges> ranges)
      : mapping_(std::move(mapping)),
        handle_(std::move(handle)),
        ranges_(std::move(ranges)) {}

  CudaIpcMapping mapping_;
  v1::SharedHandle handle_;
  std::shared_ptr<DeviceRanges> ranges_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_CUDA_CUDA_MEMORY_H_
