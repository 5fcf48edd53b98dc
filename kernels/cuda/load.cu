// Segment-load kernels (SPEC §5). Grid: x = segment, y = token tiles of the
// segment (grid-stride in both, so any plan fits). The quantized formats'
// index loads run a persistent grid (x at most the resident CTAs, see
// ForEachToken), the do_cast and BF16 loads one x per segment. A segment
// {src_block_id, src_begin, src_end, dst_offset} copies tokens
// [src_begin, src_end) of the block to rows dst_offset...; block -1 writes
// zero rows. Rows no segment covers are never touched.
//
// Outputs per row:
//   V41, V41_FP4: BF16[512], 16 elements (32 bytes) per lane, 32 lanes/token.
//   index formats: raw data (4 or 8 lanes of 16 bytes) + one int32 of scales
//                  (four UE8M0 bytes, or the fp32 bits), written by lane 0.
//   BF16(N): one thread per chunk of 4, 8 or 16 bytes of the row.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/cuda/device_bytes.cuh"
#include "kernels/cuda/device_quant.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_internal.h"
#include "kernels/format.h"
#include "kernels/named_formats.h"
#include "kernels/quant.h"
#include "kernels/store_load.h"

namespace kvdepot::gpu::internal {
namespace {

constexpr int kThreads = 128;
constexpr unsigned kMaxGridY = 65535;

// Segment `index` of the plan (rows of four int32, 4-byte aligned), read
// through the read-only cache.
__device__ __forceinline__ Segment ReadSegment(const int32_t* segments,
                                               int64_t index) {
  const int32_t* s = segments + kSegmentFields * index;
  return {__ldg(s), __ldg(s + 1), __ldg(s + 2), __ldg(s + 3)};
}

__device__ __forceinline__ uint8_t LoadByte(const uint8_t* p) {
  return __ldg(p);
}

// Dequantizes the 16 codes of one lane with its scale byte `sf` into 16
// BF16 (8 words), equal to FloatToBf16(Decode(q) * Decode(sf)) of quant.h.
// Hardware e4m3 -> f16x2 (exact, a NaN code to a NaN), fp32 multiply,
// hardware RNE bf16x2; when the products can be NaN (a NaN code, the 0xFF
// scale: Inf times zero), whose bits the hardware does not make canonical,
// the rounding replaces NaN halves by quant.h's 0x7FC0.
template <class F>
__device__ __forceinline__ void Dequant16(uint4 q, uint8_t sf,
                                          uint32_t (&out)[8]) {
  if constexpr (F::kDtype == QuantDtype::kE4M3) {
    const float scale = Ue8m0ToFloat(sf);
    const uint32_t nan = (((q.x & 0x7F7F7F7Fu) + 0x01010101u) |
                          ((q.y & 0x7F7F7F7Fu) + 0x01010101u) |
                          ((q.z & 0x7F7F7F7Fu) + 0x01010101u) |
                          ((q.w & 0x7F7F7F7Fu) + 0x01010101u)) &
                         0x80808080u;
    if (nan != 0 || sf == 0xFF) {  // products may be NaN: canonical bits
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float2 f = HwE4M3x2ToFloat2((&q.x)[i / 2] >> (16 * (i % 2)));
        out[i] = HwBf16x2Canonical(f.x * scale, f.y * scale);
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 f = HwE4M3x2ToFloat2((&q.x)[i / 2] >> (16 * (i % 2)));
      out[i] = HwBf16x2(f.x * scale, f.y * scale);
    }
  } else {
    if ((sf & 0x7Fu) == 0x7Fu) {  // NaN scale: every value is NaN
#pragma unroll
      for (int i = 0; i < 8; ++i)
        out[i] = (uint32_t{kBf16NaN} << 16) | kBf16NaN;
      return;
    }
    // An e2m1 nibble SEEM placed as f16 bits S00000EEM000000000 reads as its
    // value times 2^-14 (subnormal codes included); the 2^14 goes into the
    // scale. Products have at most 6 significant bits: exact.
    const float scale = DecodeE4M3(sf) * 16384.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t b = ((&q.x)[i / 4] >> (8 * (i % 4))) & 0xFFu;
      const uint32_t h = ((b & 0x7u) << 9) | ((b & 0x8u) << 12) |
                         ((b & 0x70u) << 21) | ((b & 0x80u) << 24);
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
      out[i] = HwBf16x2(f.x * scale, f.y * scale);
    }
  }
}

// The quantized formats' loops. A CTA step is kThreads / kLpt consecutive
// tokens (each warp kWarp / kLpt of them); CTA (x, y) takes segments
// blockIdx.x, + gridDim.x, ... (the next one's header is read while the
// current one is copied) and in each the CTA steps y, y + gridDim.y, ...,
// kSteps at a time: a warp issues the loads of its kSteps steps before the
// first store. load(seg, i, sub) reads token i's share of lane `sub`;
// finish(seg, i, sub, result) writes it.
template <int kLpt, int kSteps, class Load, class Finish>
__device__ __forceinline__ void ForEachToken(const int32_t* segments,
                                             int64_t num_segments, Load load,
                                             Finish finish) {
  constexpr int kTokensPerStep = kThreads / kLpt;
  const int sub = threadIdx.x % kLpt;
  const int32_t mine =  // token offset of this lane within its CTA step
      static_cast<int32_t>(blockIdx.y) * kTokensPerStep +
      static_cast<int32_t>(threadIdx.x) / kLpt;
  const int64_t grid_step = static_cast<int64_t>(gridDim.y) * kTokensPerStep;
  int64_t s = blockIdx.x;
  if (s >= num_segments) return;
  Segment next = ReadSegment(segments, s);
  for (; s < num_segments; s += gridDim.x) {
    const Segment seg = next;
    if (s + gridDim.x < num_segments) {
      next = ReadSegment(segments, s + gridDim.x);
    }
    // int64: block sizes near 2^31 must not wrap.
    for (int64_t base = mine; base < seg.len(); base += kSteps * grid_step) {
      typename Load::Result r[kSteps];
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        const int64_t i = base + u * grid_step;
        if (i < seg.len()) r[u] = load(seg, static_cast<int32_t>(i), sub);
      }
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        const int64_t i = base + u * grid_step;
        if (i < seg.len()) finish(seg, static_cast<int32_t>(i), sub, r[u]);
      }
    }
  }
}

// One lane's share of a do_cast record: 16 codes and their scale byte.
struct CastPart {
  uint4 q;
  uint32_t sf;
};

template <class F>
struct CastLoad {
  using Result = CastPart;
  PoolLayout layout;
  const uint8_t* layer;
  __device__ __forceinline__ Result operator()(const Segment& seg, int32_t i,
                                               int sub) const {
    Result r{make_uint4(0, 0, 0, 0), 0};
    if (seg.block < 0) return r;
    const uint8_t* src = layer +
                         DataOffset<F>(layout, seg.block, seg.begin + i) +
                         sub * F::kDataBytesPerLane;
    if constexpr (F::kDataBytesPerLane == 16) {
      r.q = LoadStream16(src);
    } else {
      const uint2 h = LoadStream8(src);
      r.q = make_uint4(h.x, h.y, 0, 0);
    }
    r.sf = LoadByte(layer + ScaleOffset<F>(layout, seg.block, seg.begin + i) +
                    sub / F::kLanesPerGroup);
    return r;
  }
};

template <class F, int kSteps>
__global__ void __launch_bounds__(kThreads)
    LoadCastKernel(PoolLayout layout, const uint8_t* layer,
                   const int32_t* segments,  // [S][4]; block -1 = zero rows
                   int64_t num_segments,
                   uint16_t* out) {  // [total_k][F::kElems] BF16
  PdlWait();
  PdlLaunchDependents();
  ForEachToken<F::kLanesPerToken, kSteps>(
      segments, num_segments, CastLoad<F>{layout, layer},
      [&](const Segment& seg, int32_t i, int sub, const CastPart& part) {
        uint32_t w[8];
        if (seg.block < 0) {
          ZeroWords<32>(w);
        } else {
          Dequant16<F>(part.q, static_cast<uint8_t>(part.sf), w);
        }
        StoreWords<32>(
            out + (static_cast<int64_t>(seg.dst) + i) * F::kElems + sub * 16,
            w);
      });
}

template <class F>
struct IndexLoad {
  using Result = CastPart;  // 16 data bytes; the scale word (lane 0)
  PoolLayout layout;
  const uint8_t* layer;
  __device__ __forceinline__ Result operator()(const Segment& seg, int32_t i,
                                               int sub) const {
    Result r{make_uint4(0, 0, 0, 0), 0};
    if (seg.block < 0) return r;
    r.q = LoadStream16(layer + DataOffset<F>(layout, seg.block, seg.begin + i) +
                       sub * 16);
    if (sub == 0) {
      r.sf = __ldg(reinterpret_cast<const unsigned int*>(
          layer + ScaleOffset<F>(layout, seg.block, seg.begin + i)));
    }
    return r;
  }
};

template <class F, int kSteps>
__global__ void __launch_bounds__(kThreads)
    LoadIndexKernel(PoolLayout layout, const uint8_t* layer,
                    const int32_t* segments,  // [S][4]; block -1 = zero rows
                    int64_t num_segments,
                    uint8_t* data,       // [total_k][data bytes]
                    uint32_t* scales) {  // [total_k] packed scales
  PdlWait();
  PdlLaunchDependents();
  constexpr int kRowBytes = F::kDataBytes;
  ForEachToken<kRowBytes / 16, kSteps>(
      segments, num_segments, IndexLoad<F>{layout, layer},
      [&](const Segment& seg, int32_t i, int sub, const CastPart& part) {
        const int64_t row = static_cast<int64_t>(seg.dst) + i;
        StoreStream16(data + row * kRowBytes + sub * 16, part.q);
        if (sub == 0) StoreStream4(scales + row, part.sf);
      });
}

template <int kVec>
__global__ void __launch_bounds__(kThreads)
    LoadBf16Kernel(PoolLayout layout, const uint8_t* layer,
                   const int32_t* segments,  // [S][4]; block -1 = zero rows
                   uint8_t* out,             // [total_k][2N]
                   int32_t chunks_per_row) {
  PdlWait();
  PdlLaunchDependents();
  const Segment seg = ReadSegment(segments, blockIdx.x);
  const int64_t items = static_cast<int64_t>(seg.len()) * chunks_per_row;
  const int64_t row_bytes = static_cast<int64_t>(chunks_per_row) * kVec;
  for (int64_t item = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x;
       item < items; item += static_cast<int64_t>(gridDim.y) * kThreads) {
    const int32_t i = static_cast<int32_t>(item / chunks_per_row);
    const int32_t chunk =
        static_cast<int32_t>(item - int64_t{i} * chunks_per_row);
    uint32_t w[kVec / 4];
    if (seg.block < 0) {
      ZeroWords<kVec>(w);
    } else {
      LoadWords<kVec>(
          layer + layout.data_offset(seg.block, seg.begin + i) + chunk * kVec,
          w);
    }
    StoreWords<kVec>(
        out + (static_cast<int64_t>(seg.dst) + i) * row_bytes + chunk * kVec,
        w);
  }
}

unsigned GridY(int64_t work_per_segment, int64_t work_per_round) {
  const int64_t per_tile = work_per_round;
  const int64_t tiles = (work_per_segment + per_tile - 1) / per_tile;
  return static_cast<unsigned>(std::clamp<int64_t>(tiles, 1, kMaxGridY));
}

// Grid of the quantized formats' loads. kSteps == 1: one CTA per segment
// and CTA step (short-lived CTAs); else x over segments (at most the
// resident CTAs), y over a segment's steps while x leaves CTAs idle.
template <auto kKernel, int kSteps>
dim3 QuantLoadGrid(const PoolLayout& layout, int64_t s, int lanes_per_token) {
  const int64_t steps =
      (layout.block_size * lanes_per_token + kThreads - 1) / kThreads;
  if constexpr (kSteps == 1) {  // the loops cover what the caps leave
    return dim3(static_cast<unsigned>(std::min<int64_t>(s, INT32_MAX)),
                static_cast<unsigned>(std::min<int64_t>(steps, kMaxGridY)));
  }
  const int resident = ResidentCtas<kKernel, kThreads>();
  const unsigned x = PersistentGrid(s, 1, resident);
  const int64_t y = std::clamp<int64_t>(resident / static_cast<int64_t>(x), 1,
                                        std::min<int64_t>(steps, kMaxGridY));
  return dim3(x, static_cast<unsigned>(y));
}

// Steps per warp (measured on the H200, docs/BENCHMARKS.md): the do_cast
// loads run best as short-lived CTAs of one step each (their dequantization
// keeps enough warps busy), the index copies persistent with 4 steps.
constexpr int kCastLoadSteps = 1;
constexpr int kIndexLoadSteps = 4;

template <class F, int kSteps = kCastLoadSteps>
cudaError_t LoadCast(const PoolLayout& layout, const uint8_t* layer,
                     const int32_t* segments, int64_t s, void* data,
                     const Launch& launch) {
  constexpr auto kKernel = LoadCastKernel<F, kSteps>;
  return LaunchKernel(
      kKernel, QuantLoadGrid<kKernel, kSteps>(layout, s, F::kLanesPerToken),
      dim3(kThreads), launch, layout, layer, segments, s,
      static_cast<uint16_t*>(data));
}

template <class F, int kSteps = kIndexLoadSteps>
cudaError_t LoadIndex(const PoolLayout& layout, const uint8_t* layer,
                      const int32_t* segments, int64_t s, void* data,
                      void* scales, const Launch& launch) {
  constexpr auto kKernel = LoadIndexKernel<F, kSteps>;
  return LaunchKernel(
      kKernel, QuantLoadGrid<kKernel, kSteps>(layout, s, F::kDataBytes / 16),
      dim3(kThreads), launch, layout, layer, segments, s,
      static_cast<uint8_t*>(data), static_cast<uint32_t*>(scales));
}

cudaError_t LoadBf16(const PoolLayout& layout, const uint8_t* layer,
                     const int32_t* segments, int64_t s, void* data,
                     const Launch& launch) {
  const int32_t row_bytes = layout.format.data_bytes();
  const int vec = row_bytes % 16 == 0 ? 16 : (row_bytes % 8 == 0 ? 8 : 4);
  const int32_t chunks = row_bytes / vec;
  const dim3 grid(static_cast<unsigned>(s),
                  GridY(layout.block_size * chunks, kThreads));
  uint8_t* out = static_cast<uint8_t*>(data);
  switch (vec) {
    case 16:
      return LaunchKernel(LoadBf16Kernel<16>, grid, dim3(kThreads), launch,
                          layout, layer, segments, out, chunks);
    case 8:
      return LaunchKernel(LoadBf16Kernel<8>, grid, dim3(kThreads), launch,
                          layout, layer, segments, out, chunks);
    default:
      return LaunchKernel(LoadBf16Kernel<4>, grid, dim3(kThreads), launch,
                          layout, layer, segments, out, chunks);
  }
}

}  // namespace

cudaError_t LaunchLoad(FormatId id, const PoolLayout& layout,
                       const uint8_t* layer, const int32_t* segments,
                       int64_t num_segments, void* data, void* scales,
                       const Launch& launch) {
  switch (id) {
    case FormatId::kV41:
      return LoadCast<V41Format>(layout, layer, segments, num_segments, data,
                                 launch);
    case FormatId::kV41Fp4:
      return LoadCast<V41Fp4Format>(layout, layer, segments, num_segments, data,
                                    launch);
    case FormatId::kFp4Index:
      return LoadIndex<Fp4IndexFormat>(layout, layer, segments, num_segments,
                                       data, scales, launch);
    case FormatId::kFp8Fp32SfIndex:
      return LoadIndex<Fp8Fp32SfFormat>(layout, layer, segments, num_segments,
                                        data, scales, launch);
    case FormatId::kMxfp8Index:
      return LoadIndex<Mxfp8IndexFormat>(layout, layer, segments, num_segments,
                                         data, scales, launch);
    case FormatId::kBf16:
      return LoadBf16(layout, layer, segments, num_segments, data, launch);
    case FormatId::kDsMlaFp8:
      return LaunchDsMlaLoad(layout, layer, segments, num_segments,
                             static_cast<uint16_t*>(data), launch);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kvdepot::gpu::internal
