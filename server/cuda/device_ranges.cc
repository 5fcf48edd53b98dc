#include "server/cuda/device_ranges.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvdepot {

std::shared_ptr<void> DeviceRanges::Add(const void* base, int64_t size,
                                        int device,
                                        std::shared_ptr<void> fence) {
  const uintptr_t key = reinterpret_cast<uintptr_t>(base);
  absl::MutexLock lock(&mu_);
  Range& r = ranges_[key];
  r.base = key;
  r.size = std::max(r.size, size);
  r.device = device;
  if (r.count++ == 0) r.fence = std::move(fence);
  return r.fence;
}

void DeviceRanges::Remove(const void* base) {
  absl::MutexLock lock(&mu_);
  auto it = ranges_.find(reinterpret_cast<uintptr_t>(base));
  if (it != ranges_.end() && --it->second.count <= 0) ranges_.erase(it);
}

absl::StatusOr<std::optional<DeviceRanges::Range>> DeviceRanges::Find(
    const void* p, int64_t bytes) const {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  absl::MutexLock lock(&mu_);
  auto it = ranges_.upper_bound(a);
  if (it == ranges_.begin()) return std::optional<Range>();
  --it;
  const Range& r = it->second;
  if (a - r.base >= static_cast<uint64_t>(r.size)) {
    return std::optional<Range>();
  }
  if (bytes < 0 || static_cast<uint64_t>(bytes) >
                       static_cast<uint64_t>(r.size) - (a - r.base)) {
    return absl::InternalError(absl::StrCat(
        "a request range of ", bytes, " bytes at offset ", a - r.base,
        " runs past its device allocation of ", r.size, " bytes"));
  }
  return std::optional<Range>(r);
}

void DeviceRanges::AddExported(const std::string& handle_bytes) {
  absl::MutexLock lock(&mu_);
  exported_.insert(handle_bytes);
}

void DeviceRanges::RemoveExported(const std::string& handle_bytes) {
  absl::MutexLock lock(&mu_);
  exported_.erase(handle_bytes);
}

bool DeviceRanges::IsExported(const std::string& handle_bytes) const {
  absl::MutexLock lock(&mu_);
  return exported_.contains(handle_bytes);
}

}  // namespace kvdepot
