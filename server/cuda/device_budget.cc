#include "server/cuda/device_budget.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvdepot {

void DeviceBudget::SetDevice(int device, int64_t free_at_start,
                             int64_t reserve) {
  absl::MutexLock lock(&mu_);
  Device& d = devices_[device];
  d.free_at_start = free_at_start;
  d.reserve = reserve;
  d.total = std::max<int64_t>(0, free_at_start - std::max<int64_t>(reserve, 0));
}

absl::StatusOr<std::shared_ptr<void>> DeviceBudget::Reserve(int device,
                                                            int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device budget: ", bytes, " bytes is not > 0"));
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = devices_.find(device);
    if (it == devices_.end()) return std::shared_ptr<void>();
    Device& d = it->second;
    const int64_t available = d.total - d.used;
    if (bytes > available) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cuda:", device, " has ", available, " bytes available to kvdepot (",
          d.free_at_start, " free at start minus --cuda_memory_reserve_bytes ",
          d.reserve, ", minus ", d.used,
          " held by pools and buffers); this allocation needs ", bytes));
    }
    d.used += bytes;
  }
  std::weak_ptr<DeviceBudget> self = weak_from_this();
  return std::shared_ptr<void>(
      static_cast<void*>(nullptr), [self, device, bytes](void*) {
        if (std::shared_ptr<DeviceBudget> b = self.lock()) {
          b->Release(device, bytes);
        }
      });
}

void DeviceBudget::Release(int device, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  auto it = devices_.find(device);
  if (it != devices_.end()) it->second.used -= bytes;
}

int64_t DeviceBudget::used(int device) const {
  absl::MutexLock lock(&mu_);
  auto it = devices_.find(device);
  return it == devices_.end() ? 0 : it->second.used;
}

int64_t DeviceBudget::total(int device) const {
  absl::MutexLock lock(&mu_);
  auto it = devices_.find(device);
  return it == devices_.end() ? 0 : it->second.total;
}

}  // namespace kvdepot
