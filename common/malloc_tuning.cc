#include "common/malloc_tuning.h"

#include <malloc.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvdepot {

absl::Status KeepFreedMemory(int64_t limit_bytes) {
  constexpr int64_t kMin = int64_t{1} << 20;
  constexpr int64_t kMax = int64_t{1} << 31;  // mallopt takes an int
  if (limit_bytes < kMin || limit_bytes >= kMax) {
    return absl::InvalidArgumentError(
        absl::StrCat("freed-memory limit = ", limit_bytes,
                     " bytes is outside [1 MiB, 2 GiB)"));
  }
#if defined(__GLIBC__)
  // glibc caps M_MMAP_THRESHOLD at 32 MiB on 64-bit (HEAP_MAX_SIZE / 2).
  const int64_t mmap_threshold =
      std::min<int64_t>(limit_bytes / 2, int64_t{32} << 20);
  if (mallopt(M_MMAP_THRESHOLD, static_cast<int>(mmap_threshold)) != 1) {
    return absl::InternalError(
        absl::StrCat("mallopt(M_MMAP_THRESHOLD, ", mmap_threshold, ") failed"));
  }
  if (mallopt(M_TRIM_THRESHOLD, static_cast<int>(limit_bytes)) != 1) {
    return absl::InternalError(
        absl::StrCat("mallopt(M_TRIM_THRESHOLD, ", limit_bytes, ") failed"));
  }
  return absl::OkStatus();
#else
  return absl::UnimplementedError(
      "keeping freed memory needs glibc's mallopt; this is another C library");
#endif
}

}  // namespace kvdepot
