// Staging scratch of the CUDA backend. Request arrays (slot mappings, plan
// segments) and inline K/V live in host memory; a kernel needs them in
// device memory. Each in-flight call takes a Staging (a pinned host buffer
// and a device buffer of the same capacity) from the pool, copies through
// it on its stream, marks it with the call's event (recorded after the
// call's last work) and gives it back. Calls that return without
// synchronizing (GPU ordering by events) leave their Staging in use by the
// GPU: the pool hands out only Stagings whose last call finished, or makes
// a new one, up to a bound per device (256 Stagings or 1 GiB); beyond it a
// worker thread waits for the longest-returned one, and an inline call is
// deferred instead (server/backend/inline_call.h: gRPC's threads never
// wait for the GPU). Buffers only grow: steady-state requests allocate
// nothing.
#ifndef KVDEPOT_SERVER_CUDA_STAGING_H_
#define KVDEPOT_SERVER_CUDA_STAGING_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/cuda/call_events.h"

namespace kvdepot {

// Regions inside a Staging start on this boundary (enough for every kernel
// operand, 16 bytes, and for coalesced copies).
inline constexpr int64_t kStagingAlignment = 256;

class Staging {
 public:
  static absl::StatusOr<std::unique_ptr<Staging>> Create(int device);

  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging();

  int device() const { return device_; }
  uint8_t* host() const { return host_; }
  uint8_t* dev() const { return dev_; }
  int64_t capacity() const { return capacity_; }

  // Whether the previous user's work finished (never blocks).
  bool Ready() const;
  // Waits for the work of the previous user, then grows both buffers to at
  // least `bytes`. In an inline call, where either would wait (growing
  // frees the old buffers, and cudaFree waits for the device), it defers
  // the call instead. REQUIRES: device() is current.
  absl::Status Prepare(int64_t bytes);
  // `done` marks the end of this user's work (its call's event).
  void MarkUsed(CallEvent done) { used_ = std::move(done); }
  // Blocks the calling thread until the work marked by MarkUsed finished
  // (this call's work only, not the rest of its stream). REQUIRES: marked.
  absl::Status WaitUsed();

 private:
  explicit Staging(int device) : device_(device) {}

  int device_ = -1;
  uint8_t* host_ = nullptr;  // cudaHostAlloc, capacity_ bytes
  uint8_t* dev_ = nullptr;   // cudaMalloc, capacity_ bytes
  int64_t capacity_ = 0;
  CallEvent used_;  // the last user's call event; null once waited for
};

class StagingPool {
 public:
  // A Staging held by one call; returned to the pool on destruction.
  class Lease {
   public:
    Lease(StagingPool* pool, std::unique_ptr<Staging> staging)
        : pool_(pool), staging_(std::move(staging)) {}
    Lease(Lease&&) = default;
    Lease& operator=(Lease&&) = delete;
    ~Lease();
    Staging* operator->() const { return staging_.get(); }

   private:
    StagingPool* pool_;
    std::unique_ptr<Staging> staging_;
  };

  // Stagings per device before a call waits (or is deferred) for one in
  // use by the GPU: as many asynchronous calls in flight per device (a
  // 61-layer step of per-layer calls is 183), 64 KiB of pinned and of
  // device memory each at the least.
  static constexpr int kDefaultMaxPerDevice = 256;
  // Pinned (and as much device) memory per device past which no new
  // Staging is made: calls then reuse the longest-returned one, as at the
  // count bound. Without it a client that keeps many large inline calls in
  // flight while the GPU is busy could make the daemon pin up to 256 times
  // its largest request (--max_message_bytes). Growing a reused Staging
  // may still pass it by at most one request's bytes per Staging.
  static constexpr int64_t kDefaultMaxBytesPerDevice = int64_t{1} << 30;

  explicit StagingPool(int max_per_device = kDefaultMaxPerDevice,
                       int64_t max_bytes_per_device = kDefaultMaxBytesPerDevice)
      : max_per_device_(max_per_device),
        max_bytes_per_device_(max_bytes_per_device) {}
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // A Staging of `device` holding at least `bytes`, its previous user's
  // work finished: the longest-returned one if its call finished and it is
  // large enough, else a new one while the device has fewer than
  // max_per_device and less than max_bytes_per_device in Stagings, else
  // the longest-returned one once its call finishes (an inline call:
  // deferred, UNAVAILABLE). REQUIRES: `device` is current.
  absl::StatusOr<Lease> Acquire(int device, int64_t bytes);

 private:
  struct Device {
    std::deque<std::unique_ptr<Staging>> free;  // oldest return first
    int created = 0;
    int64_t bytes = 0;  // capacity of every Staging made, free or leased
  };

  void Return(std::unique_ptr<Staging> staging);

  const int max_per_device_;
  const int64_t max_bytes_per_device_;
  absl::Mutex mu_;
  absl::flat_hash_map<int, Device> devices_ ABSL_GUARDED_BY(mu_);  // ordinal
};

// Bytes rounded up to kStagingAlignment.
inline int64_t StagingRound(int64_t bytes) {
  return (bytes + kStagingAlignment - 1) / kStagingAlignment *
         kStagingAlignment;
}

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_CUDA_STAGING_H_
