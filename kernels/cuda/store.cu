// Store kernels (SPEC §4): quantize kv[n][elements] per group and scatter each
// token, data and scales, into its slot; -1 slots are skipped.
//
// Quantized formats: 16 elements per lane, so a token is 32 lanes (V41,
// V41_FP4: 512 elements) or 8 lanes (index formats: 128), and a group of G
// elements is G / 16 neighbouring lanes whose amax meets by xor shuffles.
// Data leaves as one 16-byte (e4m3) or 8-byte (e2m1) streaming store per
// lane; the scale bytes are gathered by shuffles into 4-byte words, one store
// per word:
//
//   lane:      0        1        2  ...  31           (V41, one token)
//   elements:  0..15    16..31   32..47  496..511
//   group:     0        0        1       15
//   data:      [0,16)   [16,32)  ...     [496,512)    e4m3 bytes of record
//   scales:    word 0 = groups 0-3 (lanes 0,2,4,6), word 1 = 4-7, ...
//
// BF16(N): one thread per row chunk of kVec bytes (4, 8 or 16: the largest
// that divides 2N), a plain copy (BF16 input) or an RNE cast (fp32 input).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/device_bytes.cuh"
#include "kernels/cuda/device_quant.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_internal.h"
#include "kernels/format.h"
#include "kernels/quant.h"

namespace kvcache::gpu::internal {
namespace {

constexpr int kThreads = 128;

template <class F, typename In, bool kHw>
__global__ void __launch_bounds__(kThreads)
    StoreQuantKernel(PoolLayout layout, uint8_t* layer,
                     const In* kv,          // [n][F::kElems]
                     const int32_t* slots,  // [n]; -1 = padding, skip
                     int64_t n) {
  PdlWait();
  PdlLaunchDependents();
  constexpr int kLpt = F::kLanesPerToken;
  constexpr int kTokensPerWarp = kWarp / kLpt;
  const int lane = threadIdx.x % kWarp;
  const int sub = lane % kLpt;  // lane within its token
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (kThreads / kWarp) +
                       threadIdx.x / kWarp;
  const int64_t token = warp * kTokensPerWarp + lane / kLpt;
  // The K/V load does not wait for the slot: both are in flight at once.
  float x[16];
  if (token < n) {
    LoadInput16(kv + token * F::kElems + sub * 16, x);
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = 0.0f;
  }
  const int32_t slot = token < n ? __ldg(slots + token) : -1;
  if (__all_sync(kFullMask, slot < 0)) return;
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = AmaxUpdate(amax, x[i]);
#pragma unroll
  for (int off = 1; off < F::kLanesPerGroup; off *= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
  }
  const GroupScale scale = ScaleOf<F>(amax);
  const uint4 q = Encode16<F, kHw>(x, scale.multiplier);

  // Scale word `sub` of the token: four 1-byte scales, or one fp32.
  uint32_t word = scale.stored;
  if constexpr (F::kSf != ScaleFormat::kFP32) {
    const int base = lane - sub;
    word = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int src = base + ((4 * sub + i) * F::kLanesPerGroup) % kLpt;
      word |= (__shfl_sync(kFullMask, scale.stored, src) & 0xFFu) << (8 * i);
    }
  }
  if (slot < 0) return;

  const int32_t block = slot / static_cast<int32_t>(layout.block_size);
  const int32_t t = slot - block * static_cast<int32_t>(layout.block_size);
  uint8_t* data =
      layer + layout.data_offset(block, t) + sub * F::kDataBytesPerLane;
  if constexpr (F::kDataBytesPerLane == 16) {
    StoreStream16(data, q);
  } else {
    StoreStream8(data, make_uint2(q.x, q.y));
  }
  if (sub < F::kScaleWords) {
    StoreStream4(layer + layout.scale_offset(block, t) + 4 * sub, word);
  }
}

template <int kVec, typename In>
__global__ void __launch_bounds__(kThreads)
    StoreBf16Kernel(PoolLayout layout, uint8_t* layer,
                    const In* kv,          // [n][N]
                    const int32_t* slots,  // [n]; -1 = padding, skip
                    int64_t n, int32_t chunks_per_row) {
  PdlWait();
  PdlLaunchDependents();
  const int64_t item =
      static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (item >= n * chunks_per_row) return;
  const int64_t token = item / chunks_per_row;
  const int32_t chunk = static_cast<int32_t>(item - token * chunks_per_row);
  constexpr int kElemsPerChunk = kVec / 2;
  const int64_t elem =
      token * (static_cast<int64_t>(chunks_per_row) * kElemsPerChunk) +
      static_cast<int64_t>(chunk) * kElemsPerChunk;
  uint32_t w[kVec / 4];
  if constexpr (sizeof(In) == 2) {
    LoadWords<kVec>(kv + elem, w);
  } else {
    uint32_t f[kVec / 2];
    LoadWords<2 * kVec>(kv + elem, f);
#pragma unroll
    for (int k = 0; k < kVec / 4; ++k) {
      w[k] =
          FloatToBf16(BitsToFloat(f[2 * k])) |
          (static_cast<uint32_t>(FloatToBf16(BitsToFloat(f[2 * k + 1]))) << 16);
    }
  }
  const int32_t slot = __ldg(slots + token);
  if (slot < 0) return;
  const int32_t block = slot / static_cast<int32_t>(layout.block_size);
  const int32_t t = slot - block * static_cast<int32_t>(layout.block_size);
  StoreWords<kVec>(layer + layout.data_offset(block, t) + chunk * kVec, w);
}

template <class F, typename In>
cudaError_t StoreQuant(const PoolLayout& layout, uint8_t* layer, const void* kv,
                       const int32_t* slots, int64_t n, bool hw_cvt,
                       const Launch& launch) {
  constexpr int64_t kTokensPerCta =
      (kThreads / kWarp) * (kWarp / F::kLanesPerToken);
  const dim3 grid(
      static_cast<unsigned>((n + kTokensPerCta - 1) / kTokensPerCta));
  const In* in = static_cast<const In*>(kv);
  if (hw_cvt) {
    return LaunchKernel(StoreQuantKernel<F, In, true>, grid, dim3(kThreads),
                        launch, layout, layer, in, slots, n);
  }
  return LaunchKernel(StoreQuantKernel<F, In, false>, grid, dim3(kThreads),
                      launch, layout, layer, in, slots, n);
}

template <typename In>
cudaError_t StoreBf16(const PoolLayout& layout, uint8_t* layer, const void* kv,
                      const int32_t* slots, int64_t n, const Launch& launch) {
  const int32_t row_bytes = layout.format.data_bytes();
  const int vec = row_bytes % 16 == 0 ? 16 : (row_bytes % 8 == 0 ? 8 : 4);
  const int32_t chunks = row_bytes / vec;
  const int64_t items = n * chunks;
  const dim3 grid(static_cast<unsigned>((items + kThreads - 1) / kThreads));
  const In* in = static_cast<const In*>(kv);
  switch (vec) {
    case 16:
      return LaunchKernel(StoreBf16Kernel<16, In>, grid, dim3(kThreads), launch,
                          layout, layer, in, slots, n, chunks);
    case 8:
      return LaunchKernel(StoreBf16Kernel<8, In>, grid, dim3(kThreads), launch,
                          layout, layer, in, slots, n, chunks);
    default:
      return LaunchKernel(StoreBf16Kernel<4, In>, grid, dim3(kThreads), launch,
                          layout, layer, in, slots, n, chunks);
  }
}

template <typename In>
cudaError_t StoreDispatch(Kind kind, const PoolLayout& layout, uint8_t* layer,
                          const void* kv, const int32_t* slots, int64_t n,
                          bool hw, const Launch& launch) {
  switch (kind) {
    case Kind::kV41:
      return StoreQuant<V41Format, In>(layout, layer, kv, slots, n, hw, launch);
    case Kind::kV41Fp4:
      return StoreQuant<V41Fp4Format, In>(layout, layer, kv, slots, n, hw,
                                          launch);
    case Kind::kFp4Index:
      return StoreQuant<Fp4IndexFormat, In>(layout, layer, kv, slots, n, hw,
                                            launch);
    case Kind::kFp8Fp32Sf:
      return StoreQuant<Fp8Fp32SfFormat, In>(layout, layer, kv, slots, n, hw,
                                             launch);
    case Kind::kMxfp8Index:
      return StoreQuant<Mxfp8IndexFormat, In>(layout, layer, kv, slots, n, hw,
                                              launch);
    case Kind::kBf16:
      return StoreBf16<In>(layout, layer, kv, slots, n, launch);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchStore(Kind kind, const PoolLayout& layout, uint8_t* layer,
                        const void* kv, bool fp32_input, const int32_t* slots,
                        int64_t n, bool hw_cvt, const Launch& launch) {
  if (fp32_input) {
    return StoreDispatch<float>(kind, layout, layer, kv, slots, n, hw_cvt,
                                launch);
  }
  return StoreDispatch<uint16_t>(kind, layout, layer, kv, slots, n, hw_cvt,
                                 launch);
}

}  // namespace kvcache::gpu::internal
