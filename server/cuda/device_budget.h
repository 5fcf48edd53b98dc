// The CUDA backend's device-memory budget (SPEC §11): per device, the
// memory free when the daemon started minus a reserve the operator keeps
// for others (--cuda_memory_reserve_bytes). A pool or buffer that does not
// fit fails at creation with RESOURCE_EXHAUSTED saying how much is
// available, instead of failing later or starving the device's other
// users. Thread-safe; no CUDA headers.
#ifndef KVDEPOT_SERVER_CUDA_DEVICE_BUDGET_H_
#define KVDEPOT_SERVER_CUDA_DEVICE_BUDGET_H_

#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvdepot {

class DeviceBudget : public std::enable_shared_from_this<DeviceBudget> {
 public:
  // Device `device` may hold `total` bytes (free at start, minus the
  // reserve, floored at 0); `free_at_start` and `reserve` appear in
  // messages.
  void SetDevice(int device, int64_t free_at_start, int64_t reserve);

  // Takes `bytes` (> 0) of `device`'s budget until the returned token is
  // destroyed. RESOURCE_EXHAUSTED when they do not fit; a device never
  // set is not budgeted (the token is null).
  absl::StatusOr<std::shared_ptr<void>> Reserve(int device, int64_t bytes);

  int64_t used(int device) const;
  int64_t total(int device) const;

 private:
  struct Device {
    int64_t free_at_start = 0;
    int64_t reserve = 0;
    int64_t total = 0;
    int64_t used = 0;
  };
  void Release(int device, int64_t bytes);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<int, Device> devices_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_CUDA_DEVICE_BUDGET_H_
