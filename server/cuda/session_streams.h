// Streams per session (SPEC §11, §10): the CUDA backend queues each
// session's work on a stream of its own, never on one stream per pool, so
// one client's work never waits behind another's. A device has
// kStreamsPerDevice non-blocking streams, created on first use; session
// number s uses stream s mod kStreamsPerDevice (session numbers are
// sequential, so up to that many live sessions never share one); calls
// without a session use stream 0. Each stream has its interprocess event,
// recorded after the work of a call that asked for one (record_event).
//
// No daemon stream ever waits on a client's event (the backend awaits
// those on the host first, GPU_HOST.md), so a stream only ever waits for
// the daemon's own kernels and copies.
#ifndef KVDEPOT_SERVER_CUDA_SESSION_STREAMS_H_
#define KVDEPOT_SERVER_CUDA_SESSION_STREAMS_H_

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/cuda/cuda_events.h"

namespace kvdepot {

inline constexpr int kStreamsPerDevice = 64;

// One stream and its interprocess event.
class SessionStream {
 public:
  SessionStream(int device, cudaStream_t stream)
      : device_(device), stream_(stream) {}
  SessionStream(const SessionStream&) = delete;
  SessionStream& operator=(const SessionStream&) = delete;
  // Waits for this stream's own work (nobody else's), then destroys it.
  ~SessionStream();

  cudaStream_t stream() const { return stream_; }
  // Records the stream's interprocess event after the work queued so far
  // and returns its cudaIpcEventHandle_t bytes.
  absl::StatusOr<std::string> RecordEvent();

 private:
  const int device_;
  cudaStream_t stream_;
  absl::Mutex mu_;
  std::optional<CudaIpcEvent> event_ ABSL_GUARDED_BY(mu_);
};

class SessionStreams {
 public:
  SessionStreams() = default;
  SessionStreams(const SessionStreams&) = delete;
  SessionStreams& operator=(const SessionStreams&) = delete;

  // The stream of `session` on `device`. REQUIRES: `device` is current.
  absl::StatusOr<SessionStream*> For(int device, uint64_t session);

  static int SlotOf(uint64_t session) {
    return static_cast<int>(session % kStreamsPerDevice);
  }

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<
      int, std::array<std::unique_ptr<SessionStream>, kStreamsPerDevice>>
      devices_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_CUDA_SESSION_STREAMS_H_
