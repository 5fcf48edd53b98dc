#include "server/cuda/cuda_memory.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_status.h"
#include "common/status_macros.h"
#include "server/cuda/devices.h"

namespace kvdepot {

void UseFence::Note(cudaStream_t stream, CallEvent done) {
  absl::MutexLock lock(&mu_);
  points_[stream] = std::move(done);
}

absl::Status UseFence::Wait() {
  // The points as they are now, waited for without the lock: Note and
  // OrderAfter run on gRPC's threads (inline calls), which must never wait
  // for the GPU, not even behind this lock.
  std::vector<CallEvent> points;
  {
    absl::MutexLock lock(&mu_);
    points.reserve(points_.size());
    for (const auto& [stream, event] : points_) points.push_back(event);
  }
  for (const CallEvent& event : points) {
    RETURN_IF_CUDA_ERROR(cudaEventSynchronize(event.get()),
                         "waiting for work queued on the memory");
  }
  return absl::OkStatus();
}

absl::Status UseFence::OrderAfter(cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  for (auto& [other, event] : points_) {
    if (other == stream) continue;  // a stream runs in order anyway
    RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(stream, event.get(), 0),
                         "ordering after earlier work on the memory");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CudaAllocation>> CudaAllocation::Create(
    int64_t size, int device, std::shared_ptr<DeviceRanges> ranges,
    bool legacy_ipc) {
  absl::StatusOr<int64_t> bytes = RoundUpAllocation(size);
  if (!bytes.ok()) return bytes.status();
  absl::StatusOr<ScopedCudaDevice> scoped = ScopedCudaDevice::Enter(device);
  if (!scoped.ok()) return scoped.status();
  std::unique_ptr<CudaAllocation> m;
  if (legacy_ipc) {
    void* base = nullptr;
    RETURN_IF_CUDA_ERROR(
        cudaMalloc(&base, static_cast<size_t>(*bytes)),
        absl::StrCat("cudaMalloc(", *bytes, " bytes) on cuda:", device));
    // From here the destructor frees whatever was created.
    m.reset(new CudaAllocation(static_cast<uint8_t*>(base), size, device,
                               std::move(ranges)));
  } else {
    ASSIGN_OR_RETURN(gpu::VmmAllocation vmm,
                     gpu::VmmAllocation::Create(device, *bytes));
    *bytes = vmm.size();
    uint8_t* base = vmm.data();
    m.reset(new CudaAllocation(base, size, device, std::move(ranges)));
    m->vmm_ = std::move(vmm);
  }
  RETURN_IF_CUDA_ERROR(
      cudaStreamCreateWithFlags(&m->stream_, cudaStreamNonBlocking),
      "cudaStreamCreateWithFlags");
  RETURN_IF_CUDA_ERROR(
      cudaMemsetAsync(m->base_, 0, static_cast<size_t>(*bytes), m->stream_),
      "zero-filling a new allocation");
  RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(m->stream_),
                       "zero-filling a new allocation");
  if (legacy_ipc) {
    cudaIpcMemHandle_t h;
    RETURN_IF_CUDA_ERROR(cudaIpcGetMemHandle(&h, m->base_),
                         "cudaIpcGetMemHandle");
    m->ipc_handle_.assign(reinterpret_cast<const char*>(&h), sizeof(h));
    m->ranges_->AddExported(m->ipc_handle_);
  }
  m->fence_ =
      m->ranges_->Add(m->base_, *bytes, device, std::make_shared<UseFence>());
  m->registered_ = true;
  return m;
}

CudaAllocation::~CudaAllocation() {
  absl::StatusOr<ScopedCudaDevice> scoped = ScopedCudaDevice::Enter(device_);
  // A buffer may still be read or written by work on a pool's stream (a
  // request that returned with a recorded event): wait for exactly that.
  if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
  if (fence_ != nullptr) (void)static_cast<UseFence*>(fence_.get())->Wait();
  {
    absl::MutexLock lock(&event_mu_);
    event_.reset();
  }
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  if (registered_) ranges_->Remove(base_);
  if (!ipc_handle_.empty()) ranges_->RemoveExported(ipc_handle_);
  if (vmm_.valid()) {
    vmm_ = gpu::VmmAllocation();  // unmap, free the range, release
  } else {
    (void)cudaFree(base_);
  }
}

absl::StatusOr<UniqueFd> CudaAllocation::ExportFd() const {
  if (!vmm_.valid()) return Memory::ExportFd();
  return vmm_.ExportFd();
}

std::string CudaAllocation::device() const { return CudaDeviceName(device_); }

void CudaAllocation::FillHandle(v1::SharedHandle* handle) const {
  handle->set_cuda_ipc_handle(ipc_handle_);
  handle->set_size(size_);
  handle->set_offset(0);
  handle->set_device_ordinal(device_);
}

absl::StatusOr<std::string> CudaAllocation::RecordEvent() {
  absl::MutexLock lock(&event_mu_);
  if (!event_.has_value()) {
    absl::StatusOr<CudaIpcEvent> e = CudaIpcEvent::Create(device_);
    if (!e.ok()) return e.status();
    event_.emplace(*std::move(e));
  }
  RETURN_IF_ERROR(event_->Record(stream_));
  return event_->handle();
}

absl::StatusOr<std::unique_ptr<CudaImport>> CudaImport::Open(
    const v1::SharedHandle& handle, std::shared_ptr<DeviceRanges> ranges) {
  absl::StatusOr<CudaIpcMapping> mapping = CudaIpcMapping::Open(handle);
  if (!mapping.ok()) return mapping.status();
  // Keyed by the mapping base: every import of one handle shares it.
  std::shared_ptr<void> fence = ranges->Add(
      mapping->base(), (mapping->data() - mapping->base()) + mapping->size(),
      mapping->device(), std::make_shared<UseFence>());
  std::unique_ptr<CudaImport> m(
      new CudaImport(*std::move(mapping), handle, std::move(ranges)));
  m->fence_ = std::move(fence);
  return m;
}

CudaImport::~CudaImport() {
  // Work queued on it (a request that returned with a recorded event) must
  // finish before the mapping may close.
  if (absl::StatusOr<ScopedCudaDevice> scoped =
          ScopedCudaDevice::Enter(mapping_.device());
      scoped.ok() && fence_ != nullptr) {
    (void)static_cast<UseFence*>(fence_.get())->Wait();
  }
  ranges_->Remove(mapping_.base());
}

absl::StatusOr<std::unique_ptr<CudaVmmImport>> CudaVmmImport::Open(
    UniqueFd fd, int64_t size, int device_count,
    std::shared_ptr<DeviceRanges> ranges) {
  // The driver keeps its own reference: `fd` is closed on return.
  ASSIGN_OR_RETURN(gpu::VmmAllocation vmm,
                   gpu::VmmAllocation::Import(fd.get(), size, -1));
  if (vmm.device() >= device_count) {
    return absl::InvalidArgumentError(
        absl::StrCat("the imported allocation is on cuda:", vmm.device(),
                     ", a device this daemon does not use"));
  }
  std::shared_ptr<void> fence = ranges->Add(
      vmm.data(), vmm.size(), vmm.device(), std::make_shared<UseFence>());
  std::unique_ptr<CudaVmmImport> m(
      new CudaVmmImport(std::move(vmm), std::move(ranges)));
  m->fence_ = std::move(fence);
  return m;
}

CudaVmmImport::~CudaVmmImport() {
  // Work queued on it (a request that returned with a recorded event) must
  // finish before the mapping goes.
  if (absl::StatusOr<ScopedCudaDevice> scoped =
          ScopedCudaDevice::Enter(vmm_.device());
      scoped.ok() && fence_ != nullptr) {
    (void)static_cast<UseFence*>(fence_.get())->Wait();
  }
  ranges_->Remove(vmm_.data());
}

std::string CudaVmmImport::device() const {
  return CudaDeviceName(vmm_.device());
}

}  // namespace kvdepot
