// Keeping freed memory for reuse instead of handing it back to the kernel
// after every request.
//
// glibc's allocator, by default, returns an arena's free top to the kernel
// (madvise(MADV_DONTNEED)) once it passes M_TRIM_THRESHOLD (128 KiB at
// first) and serves blocks from M_MMAP_THRESHOLD (128 KiB, then adjusted
// upwards) with mmap/munmap. A process that decodes and frees a request's
// arrays of tens to hundreds of KiB on every call (kvdepotd per Step; a
// scheduler per reply) then pays on every request for the madvise or
// munmap, which flushes the TLB of every CPU running one of its threads
// (inter-processor interrupts, costly on a VM), and for the page faults of
// touching that memory again. On the development VM a B = 256 Step cost
// 450-1500 us of process CPU that way instead of 130-150 us
// (docs/BENCHMARKS.md, 2026-12-02 ~10:25).
#ifndef KVDEPOT_COMMON_MALLOC_TUNING_H_
#define KVDEPOT_COMMON_MALLOC_TUNING_H_

#include <cstdint>

#include "absl/status/status.h"

namespace kvdepot {

// Lets each glibc arena keep up to `limit_bytes` of freed memory for reuse
// (M_TRIM_THRESHOLD) and serves blocks below min(limit_bytes / 2, 32 MiB)
// from the arenas (M_MMAP_THRESHOLD; 32 MiB is glibc's ceiling), which also
// ends glibc's dynamic adjustment of both. Process-wide: call it from
// main(), early. InvalidArgument outside [1 MiB, 2 GiB); Unimplemented
// without glibc; Internal if mallopt refuses a value (nothing is undone;
// ASan's allocator, for one, refuses every mallopt). Callers treat a
// failure as a missed optimization, not as an error.
absl::Status KeepFreedMemory(int64_t limit_bytes);

}  // namespace kvdepot

#endif  // KVDEPOT_COMMON_MALLOC_TUNING_H_
