// Benchmark baseline: the fused store's stages as separate BF16 kernels
// (fused_stages.h). One warp per token, 4 warps per CTA.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/fused_stages.h"
#include "kernels/quant.h"

namespace kvdepot::gpu::stages {
namespace {

using internal::kFullMask;
using internal::kWarp;
constexpr int kThreads = 128;
constexpr int kWarpsPerCta = kThreads / kWarp;

__device__ __forceinline__ int64_t WarpToken() {
  return static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarp;
}

__device__ __forceinline__ float Bf(uint16_t h) { return Bf16ToFloat(h); }

__global__ void __launch_bounds__(kThreads)
    RmsNormKernel(const uint16_t* in, uint16_t* out, int64_t n, int32_t d,
                  int32_t begin, int32_t end, const uint16_t* w, float eps) {
  const int64_t t = WarpToken();
  if (t >= n) return;
  const int lane = threadIdx.x % kWarp;
  const uint16_t* x = in + t * d;
  uint16_t* y = out + t * d;
  float s = 0.0f;
  for (int i = begin + lane; i < end; i += kWarp) s += Bf(x[i]) * Bf(x[i]);
  for (int h = 16; h >= 1; h /= 2) s += __shfl_xor_sync(kFullMask, s, h);
  const float r = rsqrtf(s / static_cast<float>(end - begin) + eps);
  for (int i = lane; i < d; i += kWarp) {
    y[i] = i >= begin && i < end ? FloatToBf16(Bf(x[i]) * r * Bf(w[i - begin]))
                                 : x[i];
  }
}

__global__ void __launch_bounds__(kThreads)
    RopeKernel(uint16_t* x, int64_t n, int32_t d, bool neox, int32_t offset,
               int32_t dim, const int64_t* positions, const float* cos_sin) {
  const int64_t t = WarpToken();
  if (t >= n) return;
  const int lane = threadIdx.x % kWarp;
  const int half = dim / 2;
  const float* cs = cos_sin + positions[t] * dim;
  uint16_t* r = x + t * d + offset;
  for (int k = lane; k < half; k += kWarp) {
    const int ia = neox ? k : 2 * k, ib = neox ? k + half : 2 * k + 1;
    const float a = Bf(r[ia]), b = Bf(r[ib]), c = cs[k], s = cs[half + k];
    r[ia] = FloatToBf16(a * c - b * s);
    r[ib] = FloatToBf16(b * c + a * s);
  }
}

__global__ void __launch_bounds__(kThreads)
    HadamardKernel(uint16_t* x, int64_t n, int32_t d, int32_t begin,
                   int32_t len) {
  __shared__ float buf[kWarpsPerCta][512];
  const int64_t t = WarpToken();
  if (t >= n) return;
  const int lane = threadIdx.x % kWarp;
  float* v = buf[threadIdx.x / kWarp];
  uint16_t* r = x + t * d + begin;
  for (int i = lane; i < len; i += kWarp) v[i] = Bf(r[i]);
  __syncwarp();
  for (int h = 1; h < len; h *= 2) {
    for (int p = lane; p < len / 2; p += kWarp) {
      const int j = (p / h) * 2 * h + p % h;
      const float a = v[j], b = v[j + h];
      v[j] = a + b;
      v[j + h] = a - b;
    }
    __syncwarp();
  }
  const float scale = rsqrtf(static_cast<float>(len));
  for (int i = lane; i < len; i += kWarp) r[i] = FloatToBf16(v[i] * scale);
}

dim3 Grid(int64_t n) {
  return dim3(static_cast<unsigned>((n + kWarpsPerCta - 1) / kWarpsPerCta));
}

}  // namespace

cudaError_t RmsNorm(const uint16_t* in, uint16_t* out, int64_t n, int32_t d,
                    int32_t begin, int32_t end, const uint16_t* weight,
                    float eps, cudaStream_t stream) {
  RmsNormKernel<<<Grid(n), kThreads, 0, stream>>>(in, out, n, d, begin, end,
                                                  weight, eps);
  return cudaGetLastError();
}

cudaError_t Rope(uint16_t* x, int64_t n, int32_t d, RopeStyle style,
                 int32_t offset, int32_t dim, const int64_t* positions,
                 const float* cos_sin, cudaStream_t stream) {
  RopeKernel<<<Grid(n), kThreads, 0, stream>>>(
      x, n, d, style == RopeStyle::kNeox, offset, dim, positions, cos_sin);
  return cudaGetLastError();
}

cudaError_t Hadamard(uint16_t* x, int64_t n, int32_t d, int32_t begin,
                     int32_t len, cudaStream_t stream) {
  HadamardKernel<<<Grid(n), kThreads, 0, stream>>>(x, n, d, begin, len);
  return cudaGetLastError();
}

}  // namespace kvdepot::gpu::stages
