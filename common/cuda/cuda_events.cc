#include "common/cuda/cuda_events.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/cuda/cuda_mappings.h"
#include "common/cuda/cuda_status.h"
#include "common/status_macros.h"

namespace kvdepot {

absl::Status ValidateEventHandle(absl::string_view field,
                                 absl::string_view bytes) {
  if (bytes.size() != sizeof(cudaIpcEventHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " holds ", bytes.size(), " bytes; a cudaIpcEventHandle_t has ",
        sizeof(cudaIpcEventHandle_t)));
  }
  return absl::OkStatus();
}

absl::StatusOr<CudaIpcEvent> CudaIpcEvent::Create(int device) {
  absl::StatusOr<ScopedCudaDevice> scoped = ScopedCudaDevice::Enter(device);
  if (!scoped.ok()) return scoped.status();
  cudaEvent_t event = nullptr;
  RETURN_IF_CUDA_ERROR(
      cudaEventCreateWithFlags(&event,
                               cudaEventInterprocess | cudaEventDisableTiming),
      "cudaEventCreateWithFlags(cudaEventInterprocess)");
  cudaIpcEventHandle_t h;
  if (const cudaError_t e = cudaIpcGetEventHandle(&h, event);
      e != cudaSuccess) {
    (void)cudaEventDestroy(event);
    return gpu::ToStatus(e, "cudaIpcGetEventHandle");
  }
  return CudaIpcEvent(
      event, device, std::string(reinterpret_cast<const char*>(&h), sizeof(h)));
}

absl::StatusOr<CudaIpcEvent> CudaIpcEvent::Open(absl::string_view field,
                                                absl::string_view handle_bytes,
                                                int device) {
  RETURN_IF_ERROR(ValidateEventHandle(field, handle_bytes));
  absl::StatusOr<ScopedCudaDevice> scoped = ScopedCudaDevice::Enter(device);
  if (!scoped.ok()) return scoped.status();
  cudaIpcEventHandle_t h;
  std::memcpy(&h, handle_bytes.data(), sizeof(h));
  cudaEvent_t event = nullptr;
  if (const cudaError_t e = cudaIpcOpenEventHandle(&event, h);
      e != cudaSuccess) {
    (void)cudaGetLastError();  // a bad handle must not linger as last error
    return gpu::ToStatus(e,
                         absl::StrCat("cudaIpcOpenEventHandle(", field, ")"));
  }
  return CudaIpcEvent(event, device, std::string(handle_bytes));
}

CudaIpcEvent::CudaIpcEvent(CudaIpcEvent&& other) noexcept
    : event_(std::exchange(other.event_, nullptr)),
      device_(other.device_),
      handle_(std::move(other.handle_)) {}

CudaIpcEvent& CudaIpcEvent::operator=(CudaIpcEvent&& other) noexcept {
  if (this != &other) {
    Reset();
    event_ = std::exchange(other.event_, nullptr);
    device_ = other.device_;
    handle_ = std::move(other.handle_);
  }
  return *this;
}

CudaIpcEvent::~CudaIpcEvent() { Reset(); }

void CudaIpcEvent::Reset() {
  if (event_ == nullptr) return;
  absl::StatusOr<ScopedCudaDevice> scoped = ScopedCudaDevice::Enter(device_);
  (void)cudaEventDestroy(event_);
  event_ = nullptr;
}

absl::Status CudaIpcEvent::Record(cudaStream_t stream) {
  RETURN_IF_CUDA_ERROR(cudaEventRecord(event_, stream),
                       "cudaEventRecord(interprocess event)");
  return absl::OkStatus();
}

absl::Status CudaIpcEvent::Wait(cudaStream_t stream) const {
  RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(stream, event_, 0),
                       "cudaStreamWaitEvent(interprocess event)");
  return absl::OkStatus();
}

absl::Status CudaIpcEvent::AwaitOnHost(absl::string_view field,
                                       absl::Time deadline) const {
  // Short sleeps first (a ready event costs one query), then up to 200 us
  // between polls: a wait is normally a kernel or two of the client.
  absl::Duration pause = absl::Microseconds(2);
  const absl::Time start = absl::Now();
  for (;;) {
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) {
      return gpu::ToStatus(e, absl::StrCat(field, ": cudaEventQuery"));
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          field, ": the client's event did not complete within ",
          absl::FormatDuration(now - start),
          " (the request's deadline or the daemon's watchdog, "
          "--cuda_wait_timeout_ms); nothing of this request was queued or "
          "written"));
    }
    absl::SleepFor(std::min(pause, deadline - now));
    pause = std::min(pause * 2, absl::Microseconds(200));
  }
}

absl::Status CudaIpcEvent::Synchronize() const {
  RETURN_IF_CUDA_ERROR(cudaEventSynchronize(event_),
                       "cudaEventSynchronize(interprocess event)");
  return absl::OkStatus();
}

}  // namespace kvdepot
