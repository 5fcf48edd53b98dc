// Device-side plumbing shared by the kernels: Programmatic Dependent Launch,
// streaming 16-byte memory access and the launch helper. CUDA-only header.
#ifndef KVCACHED_KERNELS_CUDA_DEVICE_UTIL_CUH_
#define KVCACHED_KERNELS_CUDA_DEVICE_UTIL_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "kernels/cuda/launch_internal.h"

namespace kvcache::gpu::internal {

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

// Launches `kernel` on the caller's stream, with the PDL attribute when
// requested (the kernel then overlaps the previous one's tail and syncs in
// PdlWait).
template <typename... Params, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block,
                         const Launch& launch, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
  config.stream = launch.stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = launch.pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace kvcache::gpu::internal

#endif  // KVCACHED_KERNELS_CUDA_DEVICE_UTIL_CUH_
