// Word-vector loads and stores of 4, 8, 16 or 32 bytes (BF16 copy kernels,
// where the alignment of a row is only known at run time). CUDA-only header.
#ifndef KVDEPOT_KERNELS_CUDA_DEVICE_BYTES_CUH_
#define KVDEPOT_KERNELS_CUDA_DEVICE_BYTES_CUH_

#include <cstdint>

#include "kernels/cuda/device_util.cuh"

namespace kvdepot::gpu::internal {

// REQUIRES: p aligned to min(kBytes, 16).
template <int kBytes>
__device__ __forceinline__ void LoadWords(const void* p,
                                          uint32_t (&w)[kBytes / 4]) {
  if constexpr (kBytes == 4) {
    w[0] = __ldg(static_cast<const unsigned int*>(p));
  } else if constexpr (kBytes == 8) {
    const uint2 v = LoadStream8(p);
    w[0] = v.x;
    w[1] = v.y;
  } else {
#pragma unroll
    for (int k = 0; k < kBytes / 16; ++k) {
      const uint4 v = LoadStream16(static_cast<const uint8_t*>(p) + 16 * k);
      w[4 * k] = v.x;
      w[4 * k + 1] = v.y;
      w[4 * k + 2] = v.z;
      w[4 * k + 3] = v.w;
    }
  }
}

template <int kBytes>
__device__ __forceinline__ void StoreWords(void* p,
                                           const uint32_t (&w)[kBytes / 4]) {
  if constexpr (kBytes == 4) {
    StoreStream4(p, w[0]);
  } else if constexpr (kBytes == 8) {
    StoreStream8(p, make_uint2(w[0], w[1]));
  } else {
#pragma unroll
    for (int k = 0; k < kBytes / 16; ++k) {
      StoreStream16(
          static_cast<uint8_t*>(p) + 16 * k,
          make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]));
    }
  }
}

template <int kBytes>
__device__ __forceinline__ void ZeroWords(uint32_t (&w)[kBytes / 4]) {
#pragma unroll
  for (int k = 0; k < kBytes / 4; ++k) w[k] = 0;
}

}  // namespace kvdepot::gpu::internal

#endif  // KVDEPOT_KERNELS_CUDA_DEVICE_BYTES_CUH_
