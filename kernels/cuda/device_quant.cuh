// Per-lane quantization of 16 consecutive elements, built on quant.h so the
// math is written once (NaNs are canonical there, so GPU arithmetic, which
// loses NaN signs and payloads, stays bit-exact with the x86 reference).
// For speed, e4m3 encoding may use Hopper's cvt.rn.satfinite.e4m3x2.f32 and
// e2m1 encoding uses seven exact threshold compares (the RNE boundaries);
// the test suite checks both against quant.h over all 2^32 fp32 inputs.
#ifndef KVCACHED_KERNELS_CUDA_DEVICE_QUANT_CUH_
#define KVCACHED_KERNELS_CUDA_DEVICE_QUANT_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_util.cuh"
#include "kernels/format.h"
#include "kernels/quant.h"

namespace kvcache::gpu::internal {

// Compile-time description of a quantized format (one per Kind).
template <QuantDtype D, int kE, int kG, ScaleFormat S>
struct QFormat {
  static constexpr QuantDtype kDtype = D;
  static constexpr int kElems = kE;  // elements per token
  static constexpr int kGroup = kG;  // elements per scale
  static constexpr ScaleFormat kSf = S;
  static constexpr int kLanesPerToken = kE / 16;  // 16 elements per lane
  static constexpr int kLanesPerGroup = kG / 16;
  static constexpr int kDataBytesPerLane = D == QuantDtype::kE2M1 ? 8 : 16;
  static constexpr int kScaleBytes =
      (kE / kG) * (S == ScaleFormat::kFP32 ? 4 : 1);
  static constexpr int kScaleWords = kScaleBytes / 4;  // 4-byte scale words
  static_assert(kE % 16 == 0 && kG % 16 == 0 && kScaleBytes % 4 == 0);
};

using V41Format = QFormat<QuantDtype::kE4M3, 512, 32, ScaleFormat::kUE8M0>;
using V41Fp4Format = QFormat<QuantDtype::kE2M1, 512, 16, ScaleFormat::kE4M3>;
using Fp4IndexFormat = QFormat<QuantDtype::kE2M1, 128, 32, ScaleFormat::kUE8M0>;
using Fp8Fp32SfFormat =
    QFormat<QuantDtype::kE4M3, 128, 128, ScaleFormat::kFP32>;
using Mxfp8IndexFormat =
    QFormat<QuantDtype::kE4M3, 128, 32, ScaleFormat::kUE8M0>;

// Two fp32 -> two e4m3 codes (lo in bits 0-7) by the hardware; NaN inputs
// are forced to EncodeE4M3's canonical 0x7F.
__device__ __forceinline__ uint32_t HwE4M3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  uint32_t v = r;
  if (IsNan(lo)) v = (v & 0xFF00u) | kE4M3NaN;
  if (IsNan(hi)) v = (v & 0x00FFu) | (uint32_t{kE4M3NaN} << 8);
  return v;
}

template <bool kHw>
__device__ __forceinline__ uint32_t E4M3x2(float lo, float hi) {
  if constexpr (kHw) {
    return HwE4M3x2(lo, hi);
  } else {
    return EncodeE4M3(lo) | (static_cast<uint32_t>(EncodeE4M3(hi)) << 8);
  }
}

// fp32 -> e2m1 nibble, equal to EncodeE2M1: the RNE boundaries of the grid
// 0 .5 1 1.5 2 3 4 6 are .25 .75 1.25 1.75 2.5 3.5 5, ties go to the even
// code, so the comparison is strict below an even code and >= above it.
__device__ __forceinline__ uint32_t FastE2M1(float x) {
  const uint32_t u = FloatBits(x);
  const float a = BitsToFloat(u & 0x7FFFFFFFu);
  const uint32_t code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) +
                        (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  const uint32_t sign = (a == a) ? (u >> 28) & 0x8u : 0u;  // NaN encodes 0
  return code | sign;
}

// 16 input elements of one lane -> fp32.
__device__ __forceinline__ void LoadInput16(const uint16_t* p, float (&x)[16]) {
  const uint4 a = LoadStream16(p);
  const uint4 b = LoadStream16(p + 8);
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    x[2 * i] = BitsToFloat(w[i] << 16);
    x[2 * i + 1] = BitsToFloat(w[i] & 0xFFFF0000u);
  }
}

__device__ __forceinline__ void LoadInput16(const float* p, float (&x)[16]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 v = LoadStream16(p + 4 * i);
    x[4 * i] = BitsToFloat(v.x);
    x[4 * i + 1] = BitsToFloat(v.y);
    x[4 * i + 2] = BitsToFloat(v.z);
    x[4 * i + 3] = BitsToFloat(v.w);
  }
}

// The group scale of format F from the group's amax (quant.h).
template <class F>
__device__ __forceinline__ GroupScale ScaleOf(float amax) {
  if constexpr (F::kSf == ScaleFormat::kUE8M0) {
    return Ue8m0Scale(amax,
                      F::kDtype == QuantDtype::kE4M3 ? kE4M3Max : kE2M1Max);
  } else if constexpr (F::kSf == ScaleFormat::kE4M3) {
    return E4m3Scale(amax);
  } else {
    return Fp32Scale(amax);
  }
}

// Quantizes x * multiplier: e4m3 -> 16 bytes, e2m1 -> 8 bytes (low nibble =
// even element), returned in a uint4 (e2m1 uses .x and .y).
template <class F, bool kHw>
__device__ __forceinline__ uint4 Encode16(const float (&x)[16], float mult) {
  uint32_t w[4] = {0, 0, 0, 0};
  if constexpr (F::kDtype == QuantDtype::kE4M3) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t pair = E4M3x2<kHw>(x[2 * i] * mult, x[2 * i + 1] * mult);
      w[i / 2] |= pair << (16 * (i % 2));
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      w[i / 8] |= FastE2M1(x[i] * mult) << (4 * (i % 8));
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

}  // namespace kvcache::gpu::internal

#endif  // KVCACHED_KERNELS_CUDA_DEVICE_QUANT_CUH_
