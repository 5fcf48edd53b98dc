// The daemon's step-path kernels: the phase gate, the import of the
// worker's device-resident slot mappings, convert_topk from the worker's
// rows into its index rows, the SWA decode index.
#include <cuda_runtime.h>

#include <cstdint>

#include "proto/step_doorbell.h"
#include "server/step/step_kernels.h"

namespace kvdepot::step::device {
namespace {

namespace db = ::kvdepot::doorbell;

// Waits for the grids this one depends on under PDL to finish and their
// writes to be visible; a no-op without the launch attribute.
__device__ __forceinline__ void PdlWait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

template <typename... Params, typename... Args>
int Launch(void (*kernel)(Params...), dim3 grid, dim3 block, void* stream,
           bool pdl, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  return static_cast<int>(cudaLaunchKernelEx(&config, kernel, args...));
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Sums the block's out-of-range entries (`bad` per thread; *total a
// zeroed __shared__ word) into the doorbell's out-of-range word and sets
// kStatusOutOfRange when any. Every thread of the block calls it.
__device__ void AddOutOfRange(unsigned long long bad, unsigned long long* total,
                              uint64_t* doorbell) {
  if (bad != 0) atomicAdd(total, bad);
  __syncthreads();
  if (threadIdx.x == 0 && *total != 0) {
    atomicAdd(reinterpret_cast<unsigned long long*>(doorbell + db::kOutOfRange),
              *total);
    atomicOr(reinterpret_cast<unsigned long long*>(doorbell + db::kStatusWord),
             static_cast<unsigned long long>(db::kStatusOutOfRange));
  }
}

__global__ void GateKernel(uint64_t* doorbell, uint64_t expected, int32_t* gate,
                           int32_t* s0, int32_t* s1, int32_t* s2, int32_t n,
                           int64_t n1, uint64_t* stamp) {
  __shared__ int open;
  if (threadIdx.x == 0) {
    if (stamp != nullptr) *stamp = GlobalTimerNs();
    const volatile uint64_t* words = doorbell;
    const uint64_t step = words[db::kStepIdWord];
    const uint64_t cancel = words[db::kCancelWord];
    uint64_t bits = 0;
    if (step != expected) bits |= db::kStatusStepMismatch;
    if (cancel != 0) bits |= db::kStatusCancelled;
    if (bits != 0) {
      atomicOr(
          reinterpret_cast<unsigned long long*>(doorbell + db::kStatusWord),
          static_cast<unsigned long long>(bits));
    }
    open = (bits == 0 && gate[0] == 1) ? 1 : 0;
    gate[0] = open;
  }
  __syncthreads();
  if (open) return;
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (s0 != nullptr) s0[i] = -1;
    if (s2 != nullptr) s2[i] = -1;
  }
  if (s1 == nullptr) return;
  for (int64_t i = threadIdx.x; i < n1; i += blockDim.x) s1[i] = -1;
}

__global__ void ConvertTopkKernel(const int32_t* gate, const int32_t* topk,
                                  int64_t topk_stride, int32_t* out,
                                  int64_t out_stride, int32_t rows, int32_t k,
                                  const int32_t* row_seq,
                                  const int32_t* seq_lens, int32_t ratio,
                                  const int32_t* tables, int64_t table_stride,
                                  int32_t cols, int32_t block_size,
                                  int32_t num_blocks, uint64_t* doorbell) {
  PdlWait();
  if (gate[0] != 1) return;
  __shared__ unsigned long long bad_total;
  if (threadIdx.x == 0) bad_total = 0;
  __syncthreads();
  const int32_t row = blockIdx.x;
  unsigned long long bad = 0;
  if (row < rows) {
    const int32_t seq = row_seq[row];
    const int32_t n = seq_lens[seq] / ratio;
    const int32_t valid = n < k ? n : k;
    const int32_t* in = topk + row * topk_stride;
    int32_t* o = out + row * out_stride;
    const int32_t* table = tables + static_cast<int64_t>(seq) * table_stride;
    for (int32_t c = threadIdx.x; c < k; c += blockDim.x) {
      int32_t slot = -1;
      if (c < valid) {
        const int32_t x = in[c];
        const int32_t b = x >= 0 ? x / block_size : -1;
        const int32_t block = (x >= 0 && x < n && b < cols) ? table[b] : -1;
        if (block >= 0 && block < num_blocks) {
          slot = block * block_size + x % block_size;
        } else {
          ++bad;
        }
      }
      o[c] = slot;
    }
  }
  AddOutOfRange(bad, &bad_total, doorbell);
}

__global__ void SlotImportKernel(const int32_t* gate, SlotImport im,
                                 uint64_t* doorbell) {
  PdlWait();
  __shared__ unsigned long long bad_total;
  if (threadIdx.x == 0) bad_total = 0;
  __syncthreads();
  const int32_t row = blockIdx.x;
  const bool open = gate[0] == 1;
  const int64_t capacity = im.capacity[row];
  const int32_t* src = im.src + row * im.src_stride;
  int32_t* dst =
      row == 0 ? im.main : im.compressed + (row - 1) * im.compressed_stride;
  unsigned long long bad = 0;
  for (int32_t i = blockIdx.y * blockDim.x + threadIdx.x; i < im.n;
       i += gridDim.y * blockDim.x) {
    int32_t slot = -1;
    if (open && capacity > 0) {
      slot = src[i];
      if (slot < -1 || slot >= capacity) {
        slot = -1;
        ++bad;
      }
    }
    dst[i] = slot;
  }
  AddOutOfRange(bad, &bad_total, doorbell);
}

__global__ void StampKernel(uint64_t* at) { *at = GlobalTimerNs(); }

__global__ void SwaIndexKernel(const int32_t* gate, const int32_t* state,
                               const int32_t* start, const int32_t* valid,
                               int32_t rows, int32_t window, int32_t ring,
                               int32_t* out, int64_t out_stride) {
  PdlWait();
  if (gate[0] != 1) return;
  const int32_t row = blockIdx.x;
  if (row >= rows) return;
  int32_t* o = out + row * out_stride;
  const int64_t base = static_cast<int64_t>(state[row]) * ring;
  for (int32_t i = threadIdx.x; i < window; i += blockDim.x) {
    o[i] = i < valid[row] ? static_cast<int32_t>(base + (start[row] + i) % ring)
                          : -1;
  }
}

}  // namespace

int LaunchGate(uint64_t* doorbell, uint64_t expected_step, int32_t* gate,
               int32_t* slots0, int32_t* slots1, int32_t* slots2, int32_t n,
               int64_t n1, uint64_t* stamp, void* stream) {
  GateKernel<<<1, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      doorbell, expected_step, gate, slots0, slots1, slots2, n, n1, stamp);
  return static_cast<int>(cudaGetLastError());
}

int LaunchStamp(uint64_t* at, void* stream) {
  StampKernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(at);
  return static_cast<int>(cudaGetLastError());
}

int LaunchConvertTopk(const int32_t* gate, const int32_t* topk,
                      int64_t topk_stride, int32_t* out, int64_t out_stride,
                      int32_t rows, int32_t k, const int32_t* row_seq,
                      const int32_t* seq_lens, int32_t ratio,
                      const int32_t* block_tables, int64_t table_stride,
                      int32_t cols, int32_t block_size, int32_t num_blocks,
                      uint64_t* doorbell, void* stream, bool pdl) {
  if (rows <= 0 || k <= 0) return 0;
  const int threads = k >= 256 ? 256 : 32 * ((k + 31) / 32);
  return Launch(ConvertTopkKernel, dim3(rows), dim3(threads), stream, pdl, gate,
                topk, topk_stride, out, out_stride, rows, k, row_seq, seq_lens,
                ratio, block_tables, table_stride, cols, block_size, num_blocks,
                doorbell);
}

int LaunchSlotImport(const int32_t* gate, const SlotImport& import,
                     uint64_t* doorbell, void* stream, bool pdl) {
  if (import.rows <= 0 || import.rows > kMaxSlotRows || import.n <= 0) {
    return 0;
  }
  constexpr int kThreads = 256;
  const int chunks = (import.n + kThreads - 1) / kThreads;
  return Launch(SlotImportKernel, dim3(import.rows, chunks < 32 ? chunks : 32),
                dim3(kThreads), stream, pdl, gate, import, doorbell);
}

int LaunchSwaIndex(const int32_t* gate, const int32_t* state,
                   const int32_t* start, const int32_t* valid, int32_t rows,
                   int32_t window, int32_t ring, int32_t* out,
                   int64_t out_stride, void* stream, bool pdl) {
  if (rows <= 0 || window <= 0) return 0;
  const int threads = window >= 256 ? 256 : 32 * ((window + 31) / 32);
  return Launch(SwaIndexKernel, dim3(rows), dim3(threads), stream, pdl, gate,
                state, start, valid, rows, window, ring, out, out_stride);
}

}  // namespace kvdepot::step::device
