// Device-side plumbing shared by the kernels: Programmatic Dependent Launch,
// streaming 16-byte memory access and the launch helper. CUDA-only header.
#ifndef KVDEPOT_KERNELS_CUDA_DEVICE_UTIL_CUH_
#define KVDEPOT_KERNELS_CUDA_DEVICE_UTIL_CUH_

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <utility>

#include "kernels/cuda/launch_internal.h"

namespace kvdepot::gpu::internal {

inline constexpr unsigned kFullMask = 0xFFFFFFFFu;
inline constexpr int kWarp = 32;

// Waits until the grids this one depends on (PDL) have finished and their
// writes are visible. A no-op without the PDL launch attribute. Every kernel
// calls it before reading anything a previous kernel may have written
// (slot mappings, plans, K/V).
__device__ __forceinline__ void PdlWait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// Lets the next PDL kernel in the stream start its prologue; it still waits
// in PdlWait for this grid to finish, so triggering early is safe.
__device__ __forceinline__ void PdlLaunchDependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Read-only input, read once: non-coherent path, no L1 allocation.
__device__ __forceinline__ uint4 LoadStream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint2 LoadStream8(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
               : "=r"(v.x), "=r"(v.y)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t LoadStream4(const void* p) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// Streaming (evict-first) stores for outputs nobody reads back soon.
__device__ __forceinline__ void StoreStream16(void* p, uint4 v) {
  __stcs(reinterpret_cast<uint4*>(p), v);
}
__device__ __forceinline__ void StoreStream8(void* p, uint2 v) {
  __stcs(reinterpret_cast<uint2*>(p), v);
}
__device__ __forceinline__ void StoreStream4(void* p, uint32_t v) {
  __stcs(reinterpret_cast<unsigned int*>(p), v);
}

// A 16-byte store with the default policy: for outputs read again soon
// (the fused store's cast-back rows, which the prefill attention reads
// next), kept in L2.
__device__ __forceinline__ void Store16(void* p, uint4 v) {
  *reinterpret_cast<uint4*>(p) = v;
}

// Division by a positive int32 divisor d fixed per launch (the block size)
// without a divide instruction: for 0 <= x < 2^31,
// x / d = (umulhi(magic, x) + x) >> shift with shift = ceil(log2 d) and
// magic = floor(2^32 * (2^shift - d) / d) + 1 (Granlund and Montgomery;
// the sum stays below 2^32 because x < 2^31).
struct FastDiv {
  uint32_t magic = 1;
  uint32_t shift = 0;
  int32_t d = 1;

  static FastDiv Of(int32_t divisor) {  // REQUIRES: divisor >= 1
    FastDiv f;
    f.d = divisor;
    while ((uint64_t{1} << f.shift) < static_cast<uint64_t>(divisor)) {
      ++f.shift;
    }
    f.magic = static_cast<uint32_t>(
        ((uint64_t{1} << 32) * ((uint64_t{1} << f.shift) - divisor)) /
            static_cast<uint64_t>(divisor) +
        1);
    return f;
  }
  // REQUIRES: 0 <= x < 2^31.
  __device__ __forceinline__ int32_t Div(int32_t x) const {
    const uint32_t u = static_cast<uint32_t>(x);
    return static_cast<int32_t>((__umulhi(magic, u) + u) >> shift);
  }
};

// The most CTAs of `kKernel` (kThreads threads, no dynamic shared memory)
// resident on the current device at once: the grid of a persistent,
// grid-stride kernel. Computed once per kernel (devices of one process are
// assumed alike; a wrong guess changes the speed, never the result).
template <auto kKernel, int kThreads>
int ResidentCtas() {
  static const int ctas = [] {
    int device = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) !=
            cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &per_sm, kKernel, kThreads, 0) != cudaSuccess) {
      cudaGetLastError();  // clear; fall back to a generous guess
      return 132 * 8;
    }
    return sms * (per_sm > 0 ? per_sm : 1);
  }();
  return ctas;
}

// The same for a kernel with kSmem bytes of dynamic shared memory, which
// may exceed the default 48 KiB: the allowance is a per-device attribute
// of the kernel, set here on the current device before its first launch
// there (kMaxDevices at most). Returns 0 if the device cannot run it (the
// launch must not be attempted).
inline constexpr int kMaxDevices = 64;
template <auto kKernel, int kThreads, int kSmem>
int ResidentCtasSmem() {
  static std::atomic<int> known[kMaxDevices];  // 0: not yet asked
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 ||
      device >= kMaxDevices) {
    cudaGetLastError();
    return 0;
  }
  const int cached = known[device].load(std::memory_order_relaxed);
  if (cached != 0) return cached > 0 ? cached : 0;
  int sms = 0, per_sm = 0;
  int ctas = -1;
  if (cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           kSmem) == cudaSuccess &&
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) ==
          cudaSuccess &&
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads,
                                                    kSmem) == cudaSuccess &&
      per_sm > 0) {
    ctas = sms * per_sm;
  } else {
    cudaGetLastError();
  }
  known[device].store(ctas, std::memory_order_relaxed);
  return ctas > 0 ? ctas : 0;
}

// Grid of a grid-stride kernel: enough CTAs for `work` items at
// `per_cta` items each, at most the resident CTAs.
inline unsigned PersistentGrid(int64_t work, int64_t per_cta, int resident) {
  const int64_t want = (work + per_cta - 1) / per_cta;
  return static_cast<unsigned>(want < resident ? (want > 0 ? want : 1)
                                               : resident);
}

// Launches `kernel` with smem bytes of dynamic shared memory on the
// caller's stream, with the PDL attribute when requested (the kernel then
// overlaps the previous one's tail and syncs in PdlWait).
template <typename... Params, typename... Args>
cudaError_t LaunchKernelSmem(void (*kernel)(Params...), dim3 grid, dim3 block,
                             size_t smem, const Launch& launch,
                             Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = launch.stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = launch.pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

template <typename... Params, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block,
                         const Launch& launch, Args&&... args) {
  return LaunchKernelSmem(kernel, grid, block, 0, launch,
                          std::forward<Args>(args)...);
}

// The Hadamard stages s = kS, 2 kS, ... < kN on a lane's registers: each
// pairs (j, j + s) for every j with bit s clear, a + b low, a - b high.
// Recursion on the stage, a fixed trip count inside: every index is a
// constant, so v stays in registers (loops stepping by s *= 2 were left
// rolled for kN = 16 and put v in local memory).
template <int kS, int kN>
__device__ __forceinline__ void RegisterButterflies(float (&v)[kN]) {
  if constexpr (kS < kN) {
#pragma unroll
    for (int p = 0; p < kN / 2; ++p) {
      const int j = (p / kS) * 2 * kS + p % kS;
      const float a = v[j], b = v[j + kS];
      v[j] = __fadd_rn(a, b);
      v[j + kS] = __fsub_rn(a, b);
    }
    RegisterButterflies<2 * kS, kN>(v);
  }
}

}  // namespace kvdepot::gpu::internal

#endif  // KVDEPOT_KERNELS_CUDA_DEVICE_UTIL_CUH_
