// The step engine's staging areas (per registration and in-flight slot: the
// step's metadata on the device and in pinned host memory; the fused-store
// arrays), allocated by the daemon on a client's say-so (RegisterWorker).
//
// They are never freed: cudaFree and cudaFreeHost synchronize the whole
// device, and a stream parked on another registration's doorbell would
// hold them until that registration's watchdog released it (GPU_HOST.md),
// from the very thread that runs the watchdog. So a released area goes to
// a free list and serves a later request of at most its size. Without more
// than that, registrations of ever new sizes would each leave an area
// behind and grow the daemon (and the host's pinned memory) without end.
// Here sizes are rounded up to powers of two (from 4 KiB), a request takes
// the smallest free area that fits, and the bytes ever allocated are
// capped: past the cap a request is RESOURCE_EXHAUSTED.
#ifndef KVDEPOT_SERVER_STEP_STAGING_POOL_H_
#define KVDEPOT_SERVER_STEP_STAGING_POOL_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvdepot::step {

class StagingPool {
 public:
  // Allocates `bytes` (never freed); an error is passed on.
  using Alloc = std::function<absl::StatusOr<void*>(size_t bytes)>;

  struct Area {
    void* ptr = nullptr;
    size_t bytes = 0;  // what it holds: BucketBytes of the first request
  };

  // `what` names the pool in messages ("pinned host staging on cuda:0").
  StagingPool(std::string what, int64_t cap_bytes, Alloc alloc);
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // An area of at least `bytes` (> 0): the smallest free one that fits,
  // else a new one of BucketBytes(bytes) while the bytes allocated stay
  // within the cap; RESOURCE_EXHAUSTED beyond it.
  absl::StatusOr<Area> Take(size_t bytes);
  // Back to the free list. REQUIRES: from Take, no queued work uses it.
  void Give(Area area);

  int64_t allocated() const;
  int64_t free_bytes() const;

  // The power of two >= bytes, at least 4 KiB.
  static size_t BucketBytes(size_t bytes);

 private:
  const std::string what_;
  const int64_t cap_bytes_;
  const Alloc alloc_;
  mutable absl::Mutex mu_;
  std::multimap<size_t, void*> free_ ABSL_GUARDED_BY(mu_);
  int64_t allocated_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t free_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_STAGING_POOL_H_
