// Kernels of the step path's test workers (step_two_workers_test): K/V and
// top-k rows produced on the worker's stream from a seed, and a check of
// the slots a step stored. The values are a function of (seed, index),
// computed the same way on the host (StepValueBf16 / StepValueTopk), so the
// CPU reference sees what the worker's kernels wrote.
#ifndef KVDEPOT_TESTS_GPU_STEP_WORKER_KERNELS_H_
#define KVDEPOT_TESTS_GPU_STEP_WORKER_KERNELS_H_

#include <cstdint>

#include "kernels/format.h"
#include "kernels/host_device.h"

namespace kvdepot::testing {

KV_HD inline uint64_t StepHash(uint64_t seed, uint64_t i) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + i + 1;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A finite BF16 in (-4, 4): sign, exponent 0x7C..0x80, random mantissa.
KV_HD inline uint16_t StepValueBf16(uint64_t seed, uint64_t i) {
  const uint64_t h = StepHash(seed, i);
  const uint16_t sign = static_cast<uint16_t>((h & 1) << 15);
  const uint16_t exponent = static_cast<uint16_t>(0x7C + (h >> 1) % 5);
  const uint16_t mantissa = static_cast<uint16_t>((h >> 8) & 0x7F);
  return static_cast<uint16_t>(sign | (exponent << 7) | mantissa);
}

// A top-k entry in [-1, limit + 2): some -1, some past the sequence.
KV_HD inline int32_t StepValueTopk(uint64_t seed, uint64_t i, int32_t limit) {
  return static_cast<int32_t>(StepHash(seed, i) %
                              static_cast<uint64_t>(limit + 3)) -
         1;
}

// out[i] = StepValueBf16(seed, i), i < count. Returns a cudaError_t as int.
int LaunchFillBf16(uint16_t* out, int64_t count, uint64_t seed, void* stream);
// out[i] = StepValueTopk(seed, i, limit), i < count.
int LaunchFillTopk(int32_t* out, int64_t count, uint64_t seed, int32_t limit,
                   void* stream);
// For each of the n tokens with slots[t] >= 0: the record at that slot in
// `pool_layer` (the shared pool, as the daemon stored it) equals the one in
// `scratch_layer` (the worker's own store of the same rows, same layout);
// every differing record adds 1 to *mismatches.
int LaunchCompareSlots(const PoolLayout& layout, const uint8_t* pool_layer,
                       const uint8_t* scratch_layer, const int32_t* slots,
                       int32_t n, unsigned long long* mismatches, void* stream);

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_GPU_STEP_WORKER_KERNELS_H_
