// Hopper's bulk asynchronous copies (the TMA unit without a tensor map,
// sm_90): global -> shared completing on an mbarrier, shared -> global
// completing per thread in bulk groups. Addresses and sizes are multiples of
// 16 bytes. Used by the DS_MLA_FP8 bulk store (ds_mla.cu) and its ceiling
// (bench_ceiling.cu).
#ifndef KVDEPOT_KERNELS_CUDA_DEVICE_BULK_CUH_
#define KVDEPOT_KERNELS_CUDA_DEVICE_BULK_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace kvdepot::gpu::internal {

__device__ __forceinline__ uint32_t SharedAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One arrival per phase (the thread that issues the loads); then
// __syncthreads before anyone waits on it.
__device__ __forceinline__ void BarrierInit(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SharedAddr(bar))
               : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// bytes from global src to shared dst; the barrier's phase completes when
// they have landed.
__device__ __forceinline__ void BulkLoad(void* dst, const void* src,
                                         uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                   SharedAddr(bar)),
               "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1], %2, [%3];" ::"r"(SharedAddr(dst)),
      "l"(src), "r"(bytes), "r"(SharedAddr(bar))
      : "memory");
}

// Until the barrier's phase of this parity has completed.
__device__ __forceinline__ void BarrierWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}" ::"r"(SharedAddr(bar)),
      "r"(parity)
      : "memory");
}

// Makes this thread's (and, after a __syncwarp / barrier, its peers')
// ordinary shared-memory writes visible to the bulk copies issued next.
__device__ __forceinline__ void FenceSharedForBulk() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// bytes from shared src to global dst as one bulk group of this thread.
__device__ __forceinline__ void BulkStore(void* dst, const void* src,
                                          uint32_t bytes) {
  asm volatile(
      "cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
      "r"(SharedAddr(src)), "r"(bytes)
      : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// An empty bulk group (keeps one group per iteration for BulkStoresRead).
__device__ __forceinline__ void BulkCommitEmpty() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Until at most kPending of this thread's bulk groups still read shared
// memory (the older ones' sources may be rewritten).
template <int kPending>
__device__ __forceinline__ void BulkStoresRead() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Until all of this thread's bulk groups have completed.
__device__ __forceinline__ void BulkStoresDone() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

}  // namespace kvdepot::gpu::internal

#endif  // KVDEPOT_KERNELS_CUDA_DEVICE_BULK_CUH_
