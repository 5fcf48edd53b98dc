// The empty kernel (launch-overhead baseline of the benchmark) and the
// exhaustive encoder check of the tests: every fp32 bit pattern through the
// fast device encoders (device_quant.cuh) and through quant.h, and every
// finite amax through DS_MLA_FP8's scale exponent (ds_mla.cuh) and the
// UE8M0 group scales (device_quant.cuh's ScaleOf).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_quant.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/ds_mla.cuh"
#include "kernels/cuda/launch_internal.h"
#include "kernels/quant.h"

namespace kvdepot::gpu::internal {
namespace {

__global__ void EmptyKernel() {
  PdlWait();
  PdlLaunchDependents();
}

constexpr int kCheckThreads = 256;
constexpr int kCheckBlocks = 4096;

__global__ void __launch_bounds__(kCheckThreads)
    EncodeCheckKernel(unsigned long long* mismatches,  // [4]
                      uint32_t* first,                 // [4]
                      float one) {  // 1.0f, not foldable: x * one is GPU
                                    // arithmetic (canonical NaN) like the
                                    // store's x * multiplier
  const uint64_t stride = static_cast<uint64_t>(kCheckBlocks) * kCheckThreads;
  unsigned long long bad_e4m3 = 0, bad_e2m1 = 0;
  for (uint64_t i =
           static_cast<uint64_t>(blockIdx.x) * kCheckThreads + threadIdx.x;
       i < (uint64_t{1} << 32); i += stride) {
    const uint32_t u = static_cast<uint32_t>(i);
    const float x = BitsToFloat(u);
    if ((HwE4M3x2(x, 0.0f) & 0xFFu) != EncodeE4M3(x) ||
        (HwE4M3x2(0.0f, x) >> 8) != EncodeE4M3(x)) {
      ++bad_e4m3;
      atomicMin(first, u);
    }
    if (MagicE2M1(x * one) != EncodeE2M1(x)) {
      ++bad_e2m1;
      atomicMin(first + 1, u);
    }
  }
  // DS_MLA_FP8's division-free scale exponent, every finite amax >= 0.
  unsigned long long bad_scale = 0;
  for (uint32_t u = blockIdx.x * kCheckThreads + threadIdx.x; u < 0x7F800000u;
       u += static_cast<uint32_t>(stride)) {
    if (DsMlaScaleExponentOfBits(u) != DsMlaScaleExponent(BitsToFloat(u))) {
      ++bad_scale;
      atomicMin(first + 2, u);
    }
  }
  // The UE8M0 group scales (e4m3 and e2m1 data), every finite amax >= 0
  // and +Inf: stored byte and multiplier bits.
  unsigned long long bad_ue8m0 = 0;
  for (uint32_t u = blockIdx.x * kCheckThreads + threadIdx.x; u <= 0x7F800000u;
       u += static_cast<uint32_t>(stride)) {
    const float amax = BitsToFloat(u);
    const GroupScale a = ScaleOf<V41Format>(amax);
    const GroupScale b = ScaleOf<Fp4IndexFormat>(amax);
    const GroupScale ra = Ue8m0Scale(amax, kE4M3Max);
    const GroupScale rb = Ue8m0Scale(amax, kE2M1Max);
    if (a.stored != ra.stored ||
        FloatBits(a.multiplier) != FloatBits(ra.multiplier) ||
        b.stored != rb.stored ||
        FloatBits(b.multiplier) != FloatBits(rb.multiplier)) {
      ++bad_ue8m0;
      atomicMin(first + 3, u);
    }
  }
  if (bad_e4m3 != 0) atomicAdd(mismatches, bad_e4m3);
  if (bad_e2m1 != 0) atomicAdd(mismatches + 1, bad_e2m1);
  if (bad_scale != 0) atomicAdd(mismatches + 2, bad_scale);
  if (bad_ue8m0 != 0) atomicAdd(mismatches + 3, bad_ue8m0);
}

}  // namespace

cudaError_t LaunchEmpty(const Launch& launch) {
  return LaunchKernel(EmptyKernel, dim3(1), dim3(32), launch);
}

cudaError_t LaunchEncodeCheck(unsigned long long* mismatches, uint32_t* first,
                              const Launch& launch) {
  return LaunchKernel(EncodeCheckKernel, dim3(kCheckBlocks),
                      dim3(kCheckThreads), launch, mismatches, first, 1.0f);
}

}  // namespace kvdepot::gpu::internal
