// Device memory of the CUDA backend: daemon allocations (pools and buffers,
// each its own VMM allocation handed over as a POSIX descriptor, or with
// --legacy_cuda_ipc its own cudaMalloc exported by IPC handle) and client
// allocations imported by descriptor (VMM) or by handle (legacy). All
// register their address ranges (DeviceRanges).
#ifndef KVDEPOT_SERVER_CUDA_CUDA_MEMORY_H_
#define KVDEPOT_SERVER_CUDA_CUDA_MEMORY_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/cuda/cuda_events.h"
#include "common/cuda/cuda_mappings.h"
#include "common/cuda/vmm.h"
#include "server/backend/backend.h"
#include "server/cuda/call_events.h"
#include "server/cuda/device_ranges.h"

namespace kvdepot {

// The streams whose queued work uses one piece of memory: a request that
// returns before its work finished (record_event) notes here the event that
// marks the end of its work on its stream (a CallEvent), and whoever must
// not race that work (CopyBytes, the memory's release, a call on another
// stream) waits for exactly those points, not for the device. Thread-safe.
class UseFence {
 public:
  UseFence() = default;
  UseFence(const UseFence&) = delete;
  UseFence& operator=(const UseFence&) = delete;

  // `done` was recorded on `stream` after a call's work on this memory;
  // it replaces the stream's earlier point (a stream runs in order).
  void Note(cudaStream_t stream, CallEvent done);
  // Waits for every noted point.
  absl::Status Wait();
  // Makes `stream` wait (on the GPU) for every point noted on the other
  // streams: daemon streams only, whose work never waits on a client, so
  // such a wait always ends.
  absl::Status OrderAfter(cudaStream_t stream);

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<cudaStream_t, CallEvent> points_ ABSL_GUARDED_BY(mu_);
};

// The UseFence of a range from DeviceRanges::Find (null for none).
inline UseFence* FenceOf(const DeviceRanges::Range& r) {
  return static_cast<UseFence*>(r.fence.get());
}

// A zero-filled pool or buffer: a VMM allocation handed over by descriptor
// (ExportFd), or with `legacy_ipc` a cudaMalloc exported with
// cudaIpcGetMemHandle; with the stream its kernels run on and (created on
// first use) the interprocess event recorded after ordered requests.
class CudaAllocation final : public Memory {
 public:
  // `size` > 0 bytes on `device`; the allocation is rounded up to
  // kCudaAllocationGranularity (legacy) or the VMM granularity and
  // zero-filled in full.
  static absl::StatusOr<std::unique_ptr<CudaAllocation>> Create(
      int64_t size, int device, std::shared_ptr<DeviceRanges> ranges,
      bool legacy_ipc);

  CudaAllocation(const CudaAllocation&) = delete;
  CudaAllocation& operator=(const CudaAllocation&) = delete;
  // Waits for its stream and for the work recorded on its UseFence, then
  // frees.
  ~CudaAllocation() override;

  uint8_t* data() const override { return base_; }
  int64_t size() const override { return size_; }
  // A new descriptor of the VMM allocation; FAILED_PRECONDITION for a
  // legacy one.
  absl::StatusOr<UniqueFd> ExportFd() const override;
  int64_t fd_size() const override {
    return vmm_.valid() ? vmm_.size() : size_;
  }
  std::string device() const override;
  // cuda_ipc_handle of the base, size() bytes, offset 0, the device
  // (legacy only; nothing for a VMM allocation).
  void FillHandle(v1::SharedHandle* handle) const override;

  int device_ordinal() const { return device_; }
  // Keeps `token` (a DeviceBudget reservation) until after the memory is
  // freed.
  void HoldBudget(std::shared_ptr<void> token) { budget_ = std::move(token); }
  cudaStream_t stream() const { return stream_; }
  const std::shared_ptr<void>& fence() const { return fence_; }

  // Records this allocation's interprocess event on stream() and returns
  // its cudaIpcEventHandle_t bytes (the same bytes every time: a later
  // record only moves the point it marks forward on the same stream).
  absl::StatusOr<std::string> RecordEvent();

 private:
  CudaAllocation(uint8_t* base, int64_t size, int device,
                 std::shared_ptr<DeviceRanges> ranges)
      : base_(base), size_(size), device_(device), ranges_(std::move(ranges)) {}

  std::shared_ptr<void> budget_;  // destroyed last: after the free
  uint8_t* base_ = nullptr;
  int64_t size_ = 0;  // requested bytes (the allocation may be larger)
  int device_ = -1;
  std::shared_ptr<DeviceRanges> ranges_;
  cudaStream_t stream_ = nullptr;  // non-blocking, created with the memory
  std::string ipc_handle_;         // cudaIpcMemHandle_t bytes of base_
  gpu::VmmAllocation vmm_;         // valid unless legacy
  bool registered_ = false;        // in ranges_
  std::shared_ptr<void> fence_;    // UseFence, shared with ranges_

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
  std::shared_ptr<void> fence_;  // UseFence, shared with ranges_
};

// A client's VMM allocation imported from its descriptor and mapped in the
// daemon (gpu::VmmAllocation::Import validates it).
class CudaVmmImport final : public Memory {
 public:
  // INVALID_ARGUMENT when `fd` is not a VMM export of at least `size`
  // bytes, `size` a multiple of the granularity, on a device of this
  // daemon (< device_count).
  static absl::StatusOr<std::unique_ptr<CudaVmmImport>> Open(
      UniqueFd fd, int64_t size, int device_count,
      std::shared_ptr<DeviceRanges> ranges);

  CudaVmmImport(const CudaVmmImport&) = delete;
  CudaVmmImport& operator=(const CudaVmmImport&) = delete;
  // Waits for the work recorded on its UseFence, then unmaps.
  ~CudaVmmImport() override;

  uint8_t* data() const override { return vmm_.data(); }
  int64_t size() const override { return vmm_.size(); }
  std::string device() const override;

 private:
  CudaVmmImport(gpu::VmmAllocation vmm, std::shared_ptr<DeviceRanges> ranges)
      : vmm_(std::move(vmm)), ranges_(std::move(ranges)) {}

  gpu::VmmAllocation vmm_;
  std::shared_ptr<DeviceRanges> ranges_;
  std::shared_ptr<void> fence_;  // UseFence, shared with ranges_
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_CUDA_CUDA_MEMORY_H_
