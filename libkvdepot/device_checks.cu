// Device-side checks of library mode (device_checks.h): one thread per item,
// grid-stride, one atomic per invalid item (invalid input is the rare,
// hostile case; the valid path does no atomics).
#include <cuda_runtime.h>

#include <cstdint>

#include "libkvdepot/device_checks.h"

namespace kvdepot::capi::device {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;

dim3 GridFor(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return dim3(static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks));
}

__device__ void Count(unsigned long long* invalid) {
  if (invalid != nullptr) atomicAdd(invalid, 1ull);
}

__global__ void CheckIndicesKernel(const int32_t* in, int64_t n, int64_t hi,
                                   int32_t* out, unsigned long long* invalid) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * kThreads) {
    const int32_t v = in[i];
    const bool ok = v >= -1 && static_cast<int64_t>(v) < hi;
    if (!ok) Count(invalid);
    out[i] = ok ? v : -1;
  }
}

__global__ void CheckSegmentsKernel(const int32_t* in, int64_t s,
                                    int64_t num_blocks, int64_t block_size,
                                    int64_t total_k, int32_t* out,
                                    unsigned long long* invalid) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < s;
       i += int64_t{gridDim.x} * kThreads) {
    const int64_t block = in[4 * i], begin = in[4 * i + 1], end = in[4 * i + 2],
                  dst = in[4 * i + 3];
    const bool ok = block >= -1 && block < num_blocks && begin >= 0 &&
                    begin <= end && end <= block_size && dst >= 0 &&
                    dst + (end - begin) <= total_k;
    if (!ok) Count(invalid);
    out[4 * i] = ok ? static_cast<int32_t>(block) : -1;
    out[4 * i + 1] = ok ? static_cast<int32_t>(begin) : 0;
    out[4 * i + 2] = ok ? static_cast<int32_t>(end) : 0;
    out[4 * i + 3] = ok ? static_cast<int32_t>(dst) : 0;
  }
}

__global__ void CheckFusedKernel(const int32_t* slots, const int64_t* positions,
                                 int64_t n, int64_t num_slots,
                                 int64_t max_position, int32_t* slots_out,
                                 int64_t* positions_out,
                                 unsigned long long* invalid) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * kThreads) {
    const int32_t slot = slots[i];
    bool ok = slot >= -1 && static_cast<int64_t>(slot) < num_slots;
    int64_t p = 0;
    if (positions != nullptr) {
      p = positions[i];
      if (p < 0 || p >= max_position) ok = false;
      positions_out[i] = ok ? p : 0;
    }
    if (!ok) Count(invalid);
    slots_out[i] = ok ? slot : -1;
  }
}

__global__ void CheckSwaQueriesKernel(const int32_t* state_ids,
                                      const int32_t* starts,
                                      const int32_t* valid_lens, int64_t n,
                                      int64_t num_states, int32_t window,
                                      int32_t* out,
                                      unsigned long long* invalid) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * kThreads) {
    const int32_t state = state_ids[i], start = starts[i], len = valid_lens[i];
    const bool ok = state >= 0 && state < num_states && start >= 0 &&
                    len >= 0 && len <= window;
    if (!ok) Count(invalid);
    out[i] = ok ? state : 0;
    out[n + i] = ok ? start : 0;
    out[2 * n + i] = ok ? len : 0;
  }
}

__device__ bool RangeOk(int64_t off, int64_t len, int64_t limit) {
  return len == 0 || (off >= 0 && off + len <= limit);
}

__global__ void CheckPivotsKernel(const int32_t* in, int64_t rows,
                                  int32_t width, int32_t num_kv_rows,
                                  int32_t* out, unsigned long long* invalid) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < rows;
       i += int64_t{gridDim.x} * kThreads) {
    const int64_t off1 = in[4 * i], len1 = in[4 * i + 1], off2 = in[4 * i + 2],
                  len2 = in[4 * i + 3];
    const bool ok = len1 >= 0 && len2 >= 0 && len1 + len2 <= width &&
                    RangeOk(off1, len1, num_kv_rows) &&
                    RangeOk(off2, len2, num_kv_rows);
    if (!ok) Count(invalid);
    for (int f = 0; f < 4; ++f) out[4 * i + f] = ok ? in[4 * i + f] : 0;
  }
}

// Returns the launch's own error (never an earlier one of the caller's).
template <typename... Params, typename... Args>
int LaunchOn(void (*kernel)(Params...), int64_t n, void* stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = GridFor(n);
  config.blockDim = dim3(kThreads);
  config.stream = static_cast<cudaStream_t>(stream);
  return cudaLaunchKernelEx(&config, kernel, args...);
}

}  // namespace

int CheckIndices(const int32_t* in, int64_t n, int64_t hi, int32_t* out,
                 unsigned long long* invalid, void* stream) {
  if (n == 0) return cudaSuccess;
  return LaunchOn(CheckIndicesKernel, n, stream, in, n, hi, out, invalid);
}

int CheckSegments(const int32_t* in, int64_t num_segments, int64_t num_blocks,
                  int64_t block_size, int64_t total_k, int32_t* out,
                  unsigned long long* invalid, void* stream) {
  if (num_segments == 0) return cudaSuccess;
  return LaunchOn(CheckSegmentsKernel, num_segments, stream, in, num_segments,
                  num_blocks, block_size, total_k, out, invalid);
}

int CheckFusedInputs(const int32_t* slots, const int64_t* positions, int64_t n,
                     int64_t num_slots, int64_t max_position,
                     int32_t* slots_out, int64_t* positions_out,
                     unsigned long long* invalid, void* stream) {
  if (n == 0) return cudaSuccess;
  return LaunchOn(CheckFusedKernel, n, stream, slots, positions, n, num_slots,
                  max_position, slots_out, positions_out, invalid);
}

int CheckSwaQueries(const int32_t* state_ids, const int32_t* starts,
                    const int32_t* valid_lens, int64_t n, int64_t num_states,
                    int32_t window, int32_t* out, unsigned long long* invalid,
                    void* stream) {
  if (n == 0) return cudaSuccess;
  return LaunchOn(CheckSwaQueriesKernel, n, stream, state_ids, starts,
                  valid_lens, n, num_states, window, out, invalid);
}

int CheckPivots(const int32_t* in, int64_t rows, int32_t width,
                int32_t num_kv_rows, int32_t* out, unsigned long long* invalid,
                void* stream) {
  if (rows == 0) return cudaSuccess;
  return LaunchOn(CheckPivotsKernel, rows, stream, in, rows, width, num_kv_rows,
                  out, invalid);
}

}  // namespace kvdepot::capi::device
