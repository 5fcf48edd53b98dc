#include "server/thread_scratch.h"

#include <atomic>

namespace kvdepot {
namespace {

std::atomic<int64_t> kept_total{0};

}  // namespace

int64_t ScratchKeptBytes() {
  return kept_total.load(std::memory_order_relaxed);
}

namespace scratch_internal {

bool Keep(int64_t* kept, int64_t bytes) {
  if (bytes <= kScratchKeptPerThreadBytes) {
    int64_t total = kept_total.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t next = total - *kept + bytes;
      if (next > kScratchKeptBytes) break;
      if (kept_total.compare_exchange_weak(total, next,
                                           std::memory_order_relaxed)) {
        *kept = bytes;
        return true;
      }
    }
  }
  Drop(kept);
  return false;
}

void Drop(int64_t* kept) {
  kept_total.fetch_sub(*kept, std::memory_order_relaxed);
  *kept = 0;
}

}  // namespace scratch_internal
}  // namespace kvdepot
