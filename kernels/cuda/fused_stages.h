// The fused store's stages as separate kernels (benchmark baseline only,
// not bit-exact with SPEC §8: each stage rounds its output to BF16 as an
// unfused pipeline does). x is BF16 [n][d] in device memory, 16-byte
// aligned rows; every launch is one warp per token on `stream`.
#ifndef KVDEPOT_KERNELS_CUDA_FUSED_STAGES_H_
#define KVDEPOT_KERNELS_CUDA_FUSED_STAGES_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/fused.h"

namespace kvdepot::gpu::stages {

// out = RMSNorm(in) on [begin, end) (multiples of 8), copied elsewhere.
cudaError_t RmsNorm(const uint16_t* in, uint16_t* out, int64_t n, int32_t d,
                    int32_t begin, int32_t end, const uint16_t* weight,
                    float eps, cudaStream_t stream);
// RoPE in place on [offset, offset + dim).
cudaError_t Rope(uint16_t* x, int64_t n, int32_t d, RopeStyle style,
                 int32_t offset, int32_t dim, const int64_t* positions,
                 const float* cos_sin, cudaStream_t stream);
// Walsh-Hadamard in place on [begin, begin + len), len in 64...512.
cudaError_t Hadamard(uint16_t* x, int64_t n, int32_t d, int32_t begin,
                     int32_t len, cudaStream_t stream);

}  // namespace kvdepot::gpu::stages

#endif  // KVDEPOT_KERNELS_CUDA_FUSED_STAGES_H_
