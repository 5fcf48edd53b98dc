// The CUDA backend's registry of live device memory: the address ranges of
// its allocations and imports, and the IPC handles it exported. It tells
// whether a request pointer is device memory a kernel may use in place or
// host memory (inline request or reply bytes) that must be staged. Plain
// C++ (no CUDA headers), so it is tested in CPU-only builds too.
#ifndef KVDEPOT_SERVER_CUDA_DEVICE_RANGES_H_
#define KVDEPOT_SERVER_CUDA_DEVICE_RANGES_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvdepot {

// Address ranges of the backend's live device memory. Imports of one
// handle share a base: a range counts its Adds and keeps the largest size.
class DeviceRanges {
 public:
  struct Range {
    uintptr_t base = 0;
    int64_t size = 0;
    int device = -1;
    int count = 0;  // Adds not yet Removed
    // What the backend tracks the range's users with (opaque here): the
    // first Add's, shared by later Adds of the same base.
    std::shared_ptr<void> fence;
  };

  // Returns the range's fence: `fence` for a new range, else the one the
  // first Add of `base` gave.
  std::shared_ptr<void> Add(const void* base, int64_t size, int device,
                            std::shared_ptr<void> fence = nullptr);
  void Remove(const void* base);
  // The range holding [p, p + bytes), or nullopt when p is in no range
  // (host memory). INTERNAL when p is in a range that does not hold all
  // the bytes (the service checks every slice against its buffer first).
  absl::StatusOr<std::optional<Range>> Find(const void* p, int64_t bytes) const;

  // Handles this process exported (it cannot import its own).
  void AddExported(const std::string& handle_bytes);
  void RemoveExported(const std::string& handle_bytes);
  bool IsExported(const std::string& handle_bytes) const;

 private:
  mutable absl::Mutex mu_;
  std::map<uintptr_t, Range> ranges_ ABSL_GUARDED_BY(mu_);  // key: base
  absl::flat_hash_set<std::string> exported_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_CUDA_DEVICE_RANGES_H_
