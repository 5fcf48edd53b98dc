#include <cuda_runtime.h>

#include "tests/gpu/step_worker_kernels.h"

namespace kvdepot::testing {
namespace {

constexpr int kThreads = 256;

int Blocks(int64_t count) {
  const int64_t b = (count + kThreads - 1) / kThreads;
  return static_cast<int>(b < 4096 ? (b > 0 ? b : 1) : 4096);
}

__global__ void FillBf16(uint16_t* out, int64_t count, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = StepValueBf16(seed, static_cast<uint64_t>(i));
  }
}

__global__ void FillTopk(int32_t* out, int64_t count, uint64_t seed,
                         int32_t limit) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = StepValueTopk(seed, static_cast<uint64_t>(i), limit);
  }
}

// One warp per token; the lanes compare the record's bytes.
__global__ void CompareSlots(PoolLayout layout, const uint8_t* pool,
                             const uint8_t* scratch, const int32_t* slots,
                             int32_t n, unsigned long long* mismatches) {
  const int64_t t = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (t >= n) return;
  const int32_t slot = slots[t];
  if (slot < 0) return;
  const KVCacheFormat& f = layout.format;
  bool differs = false;
  // Interleaved: one record of bytes_per_token; else data, then scales.
  const int64_t data = layout.slot_data_offset(slot);
  const int64_t data_bytes =
      f.token_interleaved ? f.bytes_per_token() : f.data_bytes();
  for (int64_t b = lane; b < data_bytes; b += 32) {
    differs |= pool[data + b] != scratch[data + b];
  }
  if (!f.token_interleaved) {
    const int64_t sf = layout.slot_scale_offset(slot);
    for (int64_t b = lane; b < f.sf_bytes(); b += 32) {
      differs |= pool[sf + b] != scratch[sf + b];
    }
  }
  if (__any_sync(0xFFFFFFFFu, differs) && lane == 0) {
    atomicAdd(mismatches, 1ull);
  }
}

}  // namespace

int LaunchFillBf16(uint16_t* out, int64_t count, uint64_t seed, void* stream) {
  if (count <= 0) return 0;
  FillBf16<<<Blocks(count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      out, count, seed);
  return static_cast<int>(cudaGetLastError());
}

int LaunchFillTopk(int32_t* out, int64_t count, uint64_t seed, int32_t limit,
                   void* stream) {
  if (count <= 0) return 0;
  FillTopk<<<Blocks(count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      out, count, seed, limit);
  return static_cast<int>(cudaGetLastError());
}

int LaunchCompareSlots(const PoolLayout& layout, const uint8_t* pool_layer,
                       const uint8_t* scratch_layer, const int32_t* slots,
                       int32_t n, unsigned long long* mismatches,
                       void* stream) {
  if (n <= 0) return 0;
  const int64_t threads = int64_t{n} * 32;
  CompareSlots<<<static_cast<int>((threads + kThreads - 1) / kThreads),
                 kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      layout, pool_layer, scratch_layer, slots, n, mismatches);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kvdepot::testing
