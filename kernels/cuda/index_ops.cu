// Index kernels (SPEC §7): one thread per output entry, coalesced int32
// reads and writes; grid x = row, y = 256-column tile (no divisions). Semantics
// are the planner's CPU versions (planner/decode_index.h, planner/index_ops.h),
// which the GPU tests compare against entry by entry.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_internal.h"

namespace kvdepot::gpu::internal {
namespace {

constexpr int kThreads = 256;

dim3 GridFor(int64_t rows, int64_t width) {
  return dim3(static_cast<unsigned>(rows),
              static_cast<unsigned>((width + kThreads - 1) / kThreads));
}

__global__ void __launch_bounds__(kThreads)
    ConvertTopkKernel(int32_t* topk,  // [num_seqs][k] in/out
                      int64_t num_seqs, int32_t k,
                      const int32_t* valid_count,  // [num_seqs] in [0, k]
                      const int32_t* num_tokens,   // [num_seqs] >= 0
                      const int32_t* block_table,  // [num_seqs][row_stride]
                      const int32_t* row_lens,     // [num_seqs] or null
                      int32_t num_cols, int64_t row_stride, int32_t block_size,
                      int32_t num_blocks,
                      unsigned long long* invalid_count) {  // may be null
  PdlWait();
  PdlLaunchDependents();
  const int64_t b = blockIdx.x;
  const int32_t c = static_cast<int32_t>(blockIdx.y) * kThreads + threadIdx.x;
  const int64_t item = b * k + c;
  bool invalid = false;
  if (c < k) {
    // The independent loads first; only the table lookup depends on x.
    const int32_t x = topk[item];
    const int32_t count = __ldg(valid_count + b);
    const int32_t tokens = __ldg(num_tokens + b);
    const int32_t len = row_lens != nullptr ? __ldg(row_lens + b) : num_cols;
    int32_t out = -1;
    if (c < count) {
      const int64_t limit = min(static_cast<int64_t>(tokens),
                                static_cast<int64_t>(len) * block_size);
      if (x < 0 || x >= limit) {
        invalid = true;
      } else {
        const int32_t id = __ldg(block_table + b * row_stride + x / block_size);
        if (id < 0 || id >= num_blocks) {
          invalid = true;
        } else {
          out = id * block_size + x % block_size;
        }
      }
    }
    topk[item] = out;
  }
  // One atomic per CTA, none when the CTA saw no invalid entry. (Every
  // thread reaches the barrier: nothing above returns.)
  if (invalid_count == nullptr) return;
  const int count = __syncthreads_count(invalid);
  if (threadIdx.x == 0 && count != 0) {
    atomicAdd(invalid_count, static_cast<unsigned long long>(count));
  }
}

__global__ void __launch_bounds__(kThreads)
    SwaDecodeIndexKernel(const int32_t* state_ids,   // [n]
                         const int32_t* starts,      // [n] >= 0
                         const int32_t* valid_lens,  // [n] in [0, window]
                         int64_t n, int32_t window, int32_t ring_size,
                         int32_t* out) {  // [n][window]; -1 past valid_len
  PdlWait();
  PdlLaunchDependents();
  const int64_t i = blockIdx.x;
  const int32_t c = static_cast<int32_t>(blockIdx.y) * kThreads + threadIdx.x;
  if (c >= window) return;
  const int64_t item = i * window + c;
  int32_t v = -1;
  if (c < __ldg(valid_lens + i)) {
    const int64_t pos = static_cast<int64_t>(__ldg(starts + i)) + c;
    v = __ldg(state_ids + i) * ring_size +
        static_cast<int32_t>(pos % ring_size);
  }
  __stcs(out + item, v);
}

__global__ void __launch_bounds__(kThreads) ExpandSwaIndexKernel(
    const int32_t* pivots,  // [rows][4] off1 len1 off2 len2
    int64_t rows, int32_t width,
    int32_t* out) {  // [rows][width]; -1 after len1+len2
  PdlWait();
  PdlLaunchDependents();
  const int64_t r = blockIdx.x;
  const int32_t c = static_cast<int32_t>(blockIdx.y) * kThreads + threadIdx.x;
  if (c >= width) return;
  const int64_t item = r * width + c;
  const int4 p = __ldg(reinterpret_cast<const int4*>(pivots) + r);
  int32_t v = -1;
  if (c < p.y) {
    v = p.x + c;
  } else if (c < p.y + p.w) {
    v = p.z + (c - p.y);
  }
  __stcs(out + item, v);
}

// kChecked: `compressed` is untrusted (a worker's device memory): an entry
// outside [-1, compressed_rows) becomes -1 and is counted into
// invalid_count (never shifted into a row outside the prefill buffer).
template <bool kChecked>
__global__ void __launch_bounds__(kThreads)
    KvIndexCatKernel(const int32_t* swa,  // [rows][swa_width]
                     int32_t swa_width,
                     const int32_t* compressed,  // [rows][compressed_width]
                     int32_t compressed_width, int64_t rows,
                     int32_t main_kv_offset,
                     int32_t compressed_rows,  // kChecked only
                     int32_t* out,  // [rows][swa_width + compressed_width]
                     unsigned long long* invalid_count) {  // kChecked only
  PdlWait();
  PdlLaunchDependents();
  const int32_t width = swa_width + compressed_width;
  const int64_t r = blockIdx.x;
  const int32_t c = static_cast<int32_t>(blockIdx.y) * kThreads + threadIdx.x;
  bool invalid = false;
  if (c < width) {
    const int64_t item = r * width + c;
    int32_t v;
    if (c < swa_width) {
      v = __ldg(swa + r * swa_width + c);
    } else {
      v = __ldg(compressed + r * compressed_width + (c - swa_width));
      if (kChecked && (v < -1 || v >= compressed_rows)) {
        invalid = true;
        v = -1;
      }
      if (v != -1) v += main_kv_offset;
    }
    __stcs(out + item, v);
  }
  if constexpr (kChecked) {
    // Every thread reaches the barrier: nothing above returns.
    const int count = __syncthreads_count(invalid);
    if (threadIdx.x == 0 && count != 0) {
      atomicAdd(invalid_count, static_cast<unsigned long long>(count));
    }
  }
}

}  // namespace

cudaError_t LaunchConvertTopk(
    int32_t* topk, int64_t num_seqs, int32_t k, const int32_t* valid_count,
    const int32_t* num_tokens, const int32_t* block_table,
    const int32_t* row_lens, int32_t num_cols, int64_t row_stride,
    int32_t block_size, int32_t num_blocks, unsigned long long* invalid_count,
    const Launch& launch) {
  return LaunchKernel(ConvertTopkKernel, GridFor(num_seqs, k), dim3(kThreads),
                      launch, topk, num_seqs, k, valid_count, num_tokens,
                      block_table, row_lens, num_cols, row_stride, block_size,
                      num_blocks, invalid_count);
}

cudaError_t LaunchSwaDecodeIndex(const int32_t* state_ids,
                                 const int32_t* starts,
                                 const int32_t* valid_lens, int64_t n,
                                 int32_t window, int32_t ring_size,
                                 int32_t* out, const Launch& launch) {
  return LaunchKernel(SwaDecodeIndexKernel, GridFor(n, window), dim3(kThreads),
                      launch, state_ids, starts, valid_lens, n, window,
                      ring_size, out);
}

cudaError_t LaunchExpandSwaIndex(const int32_t* pivots, int64_t rows,
                                 int32_t width, int32_t* out,
                                 const Launch& launch) {
  return LaunchKernel(ExpandSwaIndexKernel, GridFor(rows, width),
                      dim3(kThreads), launch, pivots, rows, width, out);
}

cudaError_t LaunchKvIndexCat(const int32_t* swa, int32_t swa_width,
                             const int32_t* compressed,
                             int32_t compressed_width, int64_t rows,
                             int32_t main_kv_offset, int32_t* out,
                             const Launch& launch) {
  return LaunchKernel(KvIndexCatKernel<false>,
                      GridFor(rows, swa_width + compressed_width),
                      dim3(kThreads), launch, swa, swa_width, compressed,
                      compressed_width, rows, main_kv_offset, int32_t{0}, out,
                      static_cast<unsigned long long*>(nullptr));
}

cudaError_t LaunchKvIndexCatChecked(const int32_t* swa, int32_t swa_width,
                                    const int32_t* compressed,
                                    int32_t compressed_width, int64_t rows,
                                    int32_t main_kv_offset,
                                    int32_t compressed_rows, int32_t* out,
                                    unsigned long long* invalid_count,
                                    const Launch& launch) {
  return LaunchKernel(
      KvIndexCatKernel<true>, GridFor(rows, swa_width + compressed_width),
      dim3(kThreads), launch, swa, swa_width, compressed, compressed_width,
      rows, main_kv_offset, compressed_rows, out, invalid_count);
}

}  // namespace kvdepot::gpu::internal
