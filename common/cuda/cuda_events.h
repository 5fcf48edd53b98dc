// Interprocess CUDA events (SPEC §9, GPU ordering): one process creates an
// event with cudaEventInterprocess | cudaEventDisableTiming, records it on a
// stream and sends its cudaIpcEventHandle_t bytes (kvdepot.proto
// wait_event_ipc_handle / recorded_event_ipc_handle); the other process
// opens those bytes and makes a stream wait on the event (or waits on the
// host) before it touches the data.
#ifndef KVDEPOT_COMMON_CUDA_CUDA_EVENTS_H_
#define KVDEPOT_COMMON_CUDA_CUDA_EVENTS_H_

#include <cuda_runtime_api.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvdepot {

// INVALID_ARGUMENT unless `bytes` has the size of a cudaIpcEventHandle_t;
// the message names `field`.
absl::Status ValidateEventHandle(absl::string_view field,
                                 absl::string_view bytes);

// An interprocess event, created here or opened from another process's
// handle. Destroyed (cudaEventDestroy) with the object; a destroyed event
// that was still pending is released by the driver once it completes, so
// an enqueued wait stays valid. Move-only RAII.
class CudaIpcEvent {
 public:
  // A new interprocess event on `device`.
  static absl::StatusOr<CudaIpcEvent> Create(int device);
  // Opens another process's event from its handle bytes (`field` names them
  // in messages), on `device`.
  static absl::StatusOr<CudaIpcEvent> Open(absl::string_view field,
                                           absl::string_view handle_bytes,
                                           int device);

  CudaIpcEvent(CudaIpcEvent&& other) noexcept;
  CudaIpcEvent& operator=(CudaIpcEvent&& other) noexcept;
  CudaIpcEvent(const CudaIpcEvent&) = delete;
  CudaIpcEvent& operator=(const CudaIpcEvent&) = delete;
  ~CudaIpcEvent();

  cudaEvent_t get() const { return event_; }
  int device() const { return device_; }
  // The handle bytes to send to another process (events from Create; an
  // opened event returns the bytes it was opened from).
  const std::string& handle() const { return handle_; }

  // Records the event on `stream` (a stream of device()).
  absl::Status Record(cudaStream_t stream);
  // Makes `stream` wait for the event's most recent record. Never for a
  // client's event in the daemon: a GPU-side wait on another process's
  // event cannot be released if it never fires (GPU_HOST.md); use
  // AwaitOnHost there.
  absl::Status Wait(cudaStream_t stream) const;
  // Polls the event on the host (cudaEventQuery; the calling thread
  // sleeps between polls, nothing is queued on any stream) until its most
  // recent record completed: OK, or DEADLINE_EXCEEDED naming `field` when
  // `deadline` passed first.
  absl::Status AwaitOnHost(absl::string_view field, absl::Time deadline) const;
  // Blocks the calling thread until the most recent record completed.
  absl::Status Synchronize() const;

 private:
  CudaIpcEvent(cudaEvent_t event, int device, std::string handle)
      : event_(event), device_(device), handle_(std::move(handle)) {}
  void Reset();

  cudaEvent_t event_ = nullptr;
  int device_ = -1;
  std::string handle_;  // cudaIpcEventHandle_t bytes
};

}  // namespace kvdepot

#endif  // KVDEPOT_COMMON_CUDA_CUDA_EVENTS_H_
