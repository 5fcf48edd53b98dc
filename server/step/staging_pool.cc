#include "server/step/staging_pool.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvdepot::step {

StagingPool::StagingPool(std::string what, int64_t cap_bytes, Alloc alloc)
    : what_(std::move(what)), cap_bytes_(cap_bytes), alloc_(std::move(alloc)) {}

size_t StagingPool::BucketBytes(size_t bytes) {
  size_t b = size_t{4} << 10;
  while (b < bytes) b <<= 1;
  return b;
}

absl::StatusOr<StagingPool::Area> StagingPool::Take(size_t bytes) {
  if (bytes == 0 || bytes > static_cast<size_t>(cap_bytes_)) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what_, ": ", bytes, " bytes asked for, at most ",
                     cap_bytes_, " may ever be allocated"));
  }
  const size_t bucket = BucketBytes(bytes);
  absl::MutexLock lock(&mu_);
  auto it = free_.lower_bound(bytes);
  if (it != free_.end()) {
    Area a{it->second, it->first};
    free_.erase(it);
    free_bytes_ -= static_cast<int64_t>(a.bytes);
    return a;
  }
  if (allocated_ + static_cast<int64_t>(bucket) > cap_bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what_, ": ", bucket, " more bytes would pass the ",
                     cap_bytes_, " the step path may allocate (", allocated_,
                     " allocated, ", free_bytes_,
                     " of them free in smaller areas); unregister workers "
                     "or register smaller maxima (max_tokens, max_seqs, "
                     "max_blocks_per_seq)"));
  }
  // Allocating under the lock keeps the cap exact; registrations are rare.
  absl::StatusOr<void*> p = alloc_(bucket);
  if (!p.ok()) return p.status();
  allocated_ += static_cast<int64_t>(bucket);
  return Area{*p, bucket};
}

void StagingPool::Give(Area area) {
  if (area.ptr == nullptr) return;
  absl::MutexLock lock(&mu_);
  free_.emplace(area.bytes, area.ptr);
  free_bytes_ += static_cast<int64_t>(area.bytes);
}

int64_t StagingPool::allocated() const {
  absl::MutexLock lock(&mu_);
  return allocated_;
}

int64_t StagingPool::free_bytes() const {
  absl::MutexLock lock(&mu_);
  return free_bytes_;
}

}  // namespace kvdepot::step
