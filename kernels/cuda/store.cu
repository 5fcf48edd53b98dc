// Store kernels (SPEC §4): quantize kv[n][elements] per group and scatter each
// token, data and scales, into its slot; -1 slots are skipped.
//
// Quantized formats: 16 elements per lane, so a token is 32 lanes (V41,
// V41_FP4: 512 elements) or 8 lanes (index formats: 128), and a group of G
// elements is G / 16 neighbouring lanes whose amax meets by xor shuffles.
// The grid is persistent (at most the resident CTAs); each warp loads all
// its steps of tokens (StoreSteps) before quantizing any.
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
#include "kernels/named_formats.h"
#include "kernels/quant.h"

namespace kvdepot::gpu::internal {
namespace {

constexpr int kThreads = 128;

// Quantizes one lane's 16 elements of a token and writes its share of the
// record. Warp-collective (shuffles): every lane of the warp calls it.
template <class F, bool kHw, typename In>
__device__ __forceinline__ void StoreLane(const PoolLayout& layout,
                                          uint8_t* layer, const FastDiv& div,
                                          const LaneInput<In>& raw,
                                          int32_t slot, int lane) {
  constexpr int kLpt = F::kLanesPerToken;
  const int sub = lane % kLpt;  // lane within its token
  if (__all_sync(kFullMask, slot < 0)) return;
  float x[16];
  ToFloat16(raw, x);
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(x[i]));  // no NaN
#pragma unroll
  for (int off = 1; off < F::kLanesPerGroup; off *= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
  }
  // V41 (the 512-element UE8M0 format; V41_FP4's scales are e4m3) keeps
  // the division: its store measured 84.3 -> 81.9-82.2 % of copy at 1M
  // tokens on the H200 with the exponent from the bits (four runs), while
  // MXFP8_INDEX rose 64.9 -> 66.6-68.9 % at 64K (docs/BENCHMARKS.md,
  // 2026-12-02 ~16:25-17:25).
  constexpr Ue8m0By kBy =
      F::kElems == 512 ? Ue8m0By::kDivision : Ue8m0By::kBits;
  const GroupScale scale = ScaleOf<F, kBy>(amax);
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

  const int32_t block = div.Div(slot);
  const int32_t t = slot - block * div.d;
  uint8_t* data =
      layer + DataOffset<F>(layout, block, t) + sub * F::kDataBytesPerLane;
  if constexpr (F::kDataBytesPerLane == 16) {
    StoreStream16(data, q);
  } else {
    StoreStream8(data, make_uint2(q.x, q.y));
  }
  if (sub < F::kScaleWords) {
    StoreStream4(layer + ScaleOffset<F>(layout, block, t) + 4 * sub, word);
  }
}

// Grid steps a warp keeps in flight (measured on the H200, BF16 input,
// docs/BENCHMARKS.md): V41 gains from 4, V41_FP4 from 2, and the index
// formats (a warp step is already 4 tokens) lose at 64K tokens with more
// than 1. fp32 input carries twice the bytes per step: half as many.
template <class F, typename In>
constexpr int StoreSteps() {
  constexpr int kBf16 = F::kLanesPerToken < kWarp        ? 1
                        : F::kDtype == QuantDtype::kE4M3 ? 4
                                                         : 2;
  return sizeof(In) == 2 ? kBf16 : (kBf16 > 1 ? kBf16 / 2 : 1);
}

// Persistent: the grid (at most the resident CTAs) strides over rounds of
// kSteps grid steps; a grid step gives each warp kWarp / kLanesPerToken
// consecutive tokens. A warp issues every K/V and slot load of its round,
// then quantizes and writes token by token. Small batches fill one step, so
// each warp has at most one token group (latency as without the loop).
template <class F, typename In, bool kHw>
__global__ void __launch_bounds__(kThreads)
    StoreQuantKernel(PoolLayout layout, FastDiv div,  // by block_size
                     uint8_t* layer,
                     const In* kv,          // [n][F::kElems]
                     const int32_t* slots,  // [n]; -1 = padding, skip
                     int64_t n) {
  PdlWait();
  PdlLaunchDependents();
  constexpr int kLpt = F::kLanesPerToken;
  constexpr int kSteps = StoreSteps<F, In>();
  const int lane = threadIdx.x % kWarp;
  const int sub = lane % kLpt;
  const int64_t mine =  // this lane's token within a grid step
      static_cast<int64_t>(blockIdx.x) * (kThreads / kLpt) + threadIdx.x / kLpt;
  const int64_t grid_step = static_cast<int64_t>(gridDim.x) * (kThreads / kLpt);
  for (int64_t base = 0; base < n; base += kSteps * grid_step) {
    LaneInput<In> raw[kSteps];
    int32_t slot[kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int64_t token = base + u * grid_step + mine;
      if (token < n) {
        LoadLane(kv + token * F::kElems + sub * 16, raw[u]);
        slot[u] = __ldg(slots + token);
      } else {
        ZeroLane(raw[u]);
        slot[u] = -1;
      }
    }
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      StoreLane<F, kHw>(layout, layer, div, raw[u], slot[u], lane);
    }
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

template <class F, typename In, bool kHw>
cudaError_t StoreQuantHw(const PoolLayout& layout, uint8_t* layer, const In* in,
                         const int32_t* slots, int64_t n,
                         const Launch& launch) {
  constexpr int64_t kTokensPerCta = kThreads / F::kLanesPerToken;  // a step
  constexpr auto kKernel = StoreQuantKernel<F, In, kHw>;
  const FastDiv div = FastDiv::Of(static_cast<int32_t>(layout.block_size));
  const dim3 grid(
      PersistentGrid(n, kTokensPerCta, ResidentCtas<kKernel, kThreads>()));
  return LaunchKernel(kKernel, grid, dim3(kThreads), launch, layout, div, layer,
                      in, slots, n);
}

template <class F, typename In>
cudaError_t StoreQuant(const PoolLayout& layout, uint8_t* layer, const void* kv,
                       const int32_t* slots, int64_t n, bool hw_cvt,
                       const Launch& launch) {
  const In* in = static_cast<const In*>(kv);
  if (hw_cvt) {
    return StoreQuantHw<F, In, true>(layout, layer, in, slots, n, launch);
  }
  return StoreQuantHw<F, In, false>(layout, layer, in, slots, n, launch);
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
cudaError_t StoreDispatch(FormatId id, const PoolLayout& layout, uint8_t* layer,
                          const void* kv, const int32_t* slots, int64_t n,
                          bool hw, const Launch& launch) {
  switch (id) {
    case FormatId::kV41:
      return StoreQuant<V41Format, In>(layout, layer, kv, slots, n, hw, launch);
    case FormatId::kV41Fp4:
      return StoreQuant<V41Fp4Format, In>(layout, layer, kv, slots, n, hw,
                                          launch);
    case FormatId::kFp4Index:
      return StoreQuant<Fp4IndexFormat, In>(layout, layer, kv, slots, n, hw,
                                            launch);
    case FormatId::kFp8Fp32SfIndex:
      return StoreQuant<Fp8Fp32SfFormat, In>(layout, layer, kv, slots, n, hw,
                                             launch);
    case FormatId::kMxfp8Index:
      return StoreQuant<Mxfp8IndexFormat, In>(layout, layer, kv, slots, n, hw,
                                              launch);
    case FormatId::kBf16:
      return StoreBf16<In>(layout, layer, kv, slots, n, launch);
    case FormatId::kDsMlaFp8:  // BF16 input only (ValidateInputDtype)
      if constexpr (sizeof(In) == 2) {
        return LaunchDsMlaStore(layout, layer, static_cast<const In*>(kv),
                                slots, n, hw, launch);
      }
      return cudaErrorInvalidValue;
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchStore(FormatId id, const PoolLayout& layout, uint8_t* layer,
                        const void* kv, bool fp32_input, const int32_t* slots,
                        int64_t n, bool hw_cvt, const Launch& launch) {
  if (fp32_input) {
    return StoreDispatch<float>(id, layout, layer, kv, slots, n, hw_cvt,
                                launch);
  }
  return StoreDispatch<uint16_t>(id, layout, layer, kv, slots, n, hw_cvt,
                                 launch);
}

}  // namespace kvdepot::gpu::internal
