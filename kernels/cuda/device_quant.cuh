// Per-lane quantization of 16 consecutive elements, built on quant.h so the
// math is written once (NaNs are canonical there, so GPU arithmetic, which
// loses NaN signs and payloads, stays bit-exact with the x86 reference).
// For speed, e4m3 encoding may use Hopper's cvt.rn.satfinite.e4m3x2.f32 and
// e2m1 encoding uses seven exact threshold compares (the RNE boundaries);
// the test suite checks both against quant.h over all 2^32 fp32 inputs.
#ifndef KVCACHED_KERNELS_CUDA_DEVICE_QUANT_CUH_
#define KVCACHED_KERNELS_CUDA_DEVICE_QUANT_CUH_

#include <cuda_fp16.h>
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

// Two fp32 -> two e4m3 codes (lo in bits 0-7) by the hardware. satfinite
// never yields 0x7F/0xFF for a number, so a NaN result of either sign is
// made quant.h's canonical 0x7F by clearing the sign of such bytes.
__device__ __forceinline__ uint32_t FixE4M3NaNs(uint32_t w) {
  const uint32_t nan = ((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
  return w & ~nan;
}

__device__ __forceinline__ uint32_t HwE4M3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return FixE4M3NaNs(r);
}

template <bool kHw>
__device__ __forceinline__ uint32_t E4M3x2(float lo, float hi) {
  if constexpr (kHw) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;  // NaN bytes are fixed per word by the caller
  } else {
    return EncodeE4M3(lo) | (static_cast<uint32_t>(EncodeE4M3(hi)) << 8);
  }
}

// Two fp32 -> one byte of two e2m1 codes (lo in the low nibble), equal to
// EncodeE2M1 for each. The RNE boundaries of the grid 0 .5 1 1.5 2 3 4 6 are
// .25 .75 1.25 1.75 2.5 3.5 5 and ties go to the even code, so the code is
// the number of boundaries |x| passes: strictly below an even code, >= below
// an odd one. The compares run on f16x2 pairs: |x| > t holds iff
// round-up-to-f16(|x|) > t, and |x| >= t iff round-to-zero(|x|) >= t, since
// every t is an f16. NaN fails every compare (code 0, sign dropped).
__device__ __forceinline__ uint32_t FastE2M1x2(float lo, float hi) {
  const float alo = fabsf(lo), ahi = fabsf(hi);
  uint16_t ulo, uhi;
  uint32_t dn;
  asm("cvt.rp.f16.f32 %0, %1;" : "=h"(ulo) : "f"(alo));
  asm("cvt.rp.f16.f32 %0, %1;" : "=h"(uhi) : "f"(ahi));
  asm("cvt.rz.f16x2.f32 %0, %1, %2;" : "=r"(dn) : "f"(ahi), "f"(alo));
  const uint32_t up = ulo | (static_cast<uint32_t>(uhi) << 16);
  uint32_t acc = 0x64006400u;  // f16 1024 per half: 1024 + code is exact
  uint32_t hit;
#define KV_E2M1_STEP(op, v, t)                                            \
  asm("set." op ".f16x2.f16x2 %0, %1, %2;" : "=r"(hit) : "r"(v), "r"(t)); \
  asm("add.rn.f16x2 %0, %0, %1;" : "+r"(acc) : "r"(hit));
  KV_E2M1_STEP("gt", up, 0x34003400u)  // 0.25
  KV_E2M1_STEP("ge", dn, 0x3A003A00u)  // 0.75
  KV_E2M1_STEP("gt", up, 0x3D003D00u)  // 1.25
  KV_E2M1_STEP("ge", dn, 0x3F003F00u)  // 1.75
  KV_E2M1_STEP("gt", up, 0x41004100u)  // 2.5
  KV_E2M1_STEP("ge", dn, 0x43004300u)  // 3.5
  KV_E2M1_STEP("gt", up, 0x45004500u)  // 5
#undef KV_E2M1_STEP
  const uint32_t slo = alo == alo ? (FloatBits(lo) >> 28) & 0x8u : 0u;
  const uint32_t shi = ahi == ahi ? (FloatBits(hi) >> 24) & 0x80u : 0u;
  return (acc & 0x7u) | slo | ((acc >> 12) & 0x70u) | shi;
}

// Single-value form (tests).
__device__ __forceinline__ uint32_t FastE2M1(float x) {
  return FastE2M1x2(x, 0.0f) & 0xFu;
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
    if constexpr (kHw) {
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = FixE4M3NaNs(w[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      w[i / 4] |= FastE2M1x2(x[2 * i] * mult, x[2 * i + 1] * mult)
                  << (8 * (i % 4));
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// BF16 pair (lo in bits 0-15) of two fp32 by the hardware (RNE, like
// FloatToBf16 for every number; the caller handles NaN).
__device__ __forceinline__ uint32_t HwBf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Two e4m3 codes (lo in bits 0-7) -> two exact fp32 by the hardware.
__device__ __forceinline__ float2 HwE4M3x2ToFloat2(uint32_t codes) {
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;"
      : "=r"(h)
      : "h"(static_cast<uint16_t>(codes)));
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

}  // namespace kvcache::gpu::internal

#endif  // KVCACHED_KERNELS_CUDA_DEVICE_QUANT_CUH_
