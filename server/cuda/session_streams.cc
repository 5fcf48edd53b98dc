#include "server/cuda/session_streams.h"

#include <utility>

#include "common/cuda/cuda_mappings.h"
#include "common/cuda/cuda_status.h"
#include "common/status_macros.h"

namespace kvdepot {

SessionStream::~SessionStream() {
  absl::StatusOr<ScopedCudaDevice> scoped = ScopedCudaDevice::Enter(device_);
  {
    absl::MutexLock lock(&mu_);
    event_.reset();
  }
  if (stream_ != nullptr) {
    // Only this stream's own work (the daemon's kernels and copies).
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
  }
}

absl::StatusOr<std::string> SessionStream::RecordEvent() {
  absl::MutexLock lock(&mu_);
  if (!event_.has_value()) {
    absl::StatusOr<CudaIpcEvent> e = CudaIpcEvent::Create(device_);
    if (!e.ok()) return e.status();
    event_.emplace(*std::move(e));
  }
  RETURN_IF_ERROR(event_->Record(stream_));
  return event_->handle();
}

absl::StatusOr<SessionStream*> SessionStreams::For(int device,
                                                   uint64_t session) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<SessionStream>& slot = devices_[device][SlotOf(session)];
  if (slot == nullptr) {
    cudaStream_t stream = nullptr;
    RETURN_IF_CUDA_ERROR(
        cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
        "cudaStreamCreateWithFlags (a session's stream)");
    slot = std::make_unique<SessionStream>(device, stream);
  }
  return slot.get();
}

}  // namespace kvdepot
