// DS_MLA_FP8 store and load kernels (SPEC §2.1). One warp per token,
// every warp-wide access contiguous (ds_mla.cuh's chunk layout):
//
//   input row (BF16, 1152 B):  lane l: elements [8l, +8) and [256 + 8l, +8)
//                              (16 B each); lanes 0-7 also the tail
//                              elements [512 + 8l, +8)
//   record (656 B, 16-aligned): codes [8l, +8) and [256 + 8l, +8) (8 B
//                              each), scales [512, 528) (lane 0, 16 B),
//                              tail [528 + 16l, +16) (lanes 0-7)
//
// A tile (128 elements) is 16 lanes' chunks; its amax and non-finite flags
// meet by xor shuffles. The store is persistent with kSteps tokens per warp
// in flight (every load of a round issued before any math); the load is one
// CTA per (segment, tile of kWarpsPerCta x kSteps tokens), grid-stride in
// both, each warp issuing the loads of its kSteps tokens before decoding
// any. Record stores keep the default cache policy (see
// DsMlaPutRecordChunks). Measured on the H200 and not kept (docs/
// BENCHMARKS.md): evict-first record stores, 4 tokens per warp in the
// store, 2 in the load, 128- and 256-byte L2 prefetch hints on the loads;
// both kernels run within 2.5 points of copy of their no-math traffic
// ceilings (bench_ceiling.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/cuda/device_quant.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/ds_mla.cuh"
#include "kernels/cuda/launch_internal.h"
#include "kernels/format.h"
#include "kernels/store_load.h"

namespace kvdepot::gpu::internal {
namespace {

constexpr int kThreads = 128;
constexpr int kWarpsPerCta = kThreads / kWarp;
constexpr int kStoreSteps = 2;
constexpr int kLoadSteps = 1;
constexpr unsigned kMaxGridY = 65535;

struct StoreIn {
  uint4 a, b, tail;
  int32_t slot;
};

template <bool kHw, int kSteps>
__global__ void __launch_bounds__(kThreads)
    DsMlaStoreKernel(PoolLayout layout, FastDiv div, uint8_t* layer,
                     const uint16_t* kv,    // [n][576] BF16
                     const int32_t* slots,  // [n]; -1 = padding, skip
                     int64_t n) {
  PdlWait();
  PdlLaunchDependents();
  const int lane = threadIdx.x % kWarp;
  const int64_t warp =
      static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  for (int64_t base = warp; base < n; base += kSteps * warps) {
    StoreIn in[kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int64_t token = base + u * warps;
      in[u].slot = -1;
      if (token < n) {
        const uint16_t* row = kv + token * kDsMlaElems;
        in[u].slot = __ldg(slots + token);
        in[u].a = LoadStream16(row + 8 * lane);
        in[u].b = LoadStream16(row + 256 + 8 * lane);
        if (lane < 8) in[u].tail = LoadStream16(row + 512 + 8 * lane);
      }
    }
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int32_t slot = in[u].slot;  // the same in every lane
      if (slot < 0) continue;
      LaneInput<uint16_t> raw;
      raw.v[0] = in[u].a;
      raw.v[1] = in[u].b;
      float x[16];
      ToFloat16(raw, x);
      const uint32_t w[8] = {in[u].a.x, in[u].a.y, in[u].a.z, in[u].a.w,
                             in[u].b.x, in[u].b.y, in[u].b.z, in[u].b.w};
      const DsMlaChunks c = DsMlaEncodeChunksBf16<kHw>(x, w);
      DsMlaPutRecordChunks</*kStreaming=*/false>(
          layer, layout.block_stride, div, slot, c, in[u].tail, lane);
    }
  }
}

template <int kSteps>
__global__ void __launch_bounds__(kThreads)
    DsMlaLoadKernel(PoolLayout layout, const uint8_t* layer,
                    const int32_t* segments,  // [S][4]; block -1 = zero rows
                    int64_t num_segments,
                    uint16_t* out) {  // [total_k][576] BF16
  PdlWait();
  PdlLaunchDependents();
  const int lane = threadIdx.x % kWarp;
  const int32_t mine = static_cast<int32_t>(blockIdx.y) * kWarpsPerCta +
                       static_cast<int32_t>(threadIdx.x) / kWarp;
  const int64_t step = static_cast<int64_t>(gridDim.y) * kWarpsPerCta;
  for (int64_t s = blockIdx.x; s < num_segments; s += gridDim.x) {
    const int32_t* p = segments + kSegmentFields * s;
    const Segment seg{__ldg(p), __ldg(p + 1), __ldg(p + 2), __ldg(p + 3)};
    for (int64_t i = mine; i < seg.len(); i += kSteps * step) {
      DsMlaChunks c[kSteps];
      uint4 tail[kSteps];
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {  // every load first
        const int64_t k = i + u * step;
        c[u].q0 = c[u].q1 = make_uint2(0, 0);
        c[u].sb0 = c[u].sb1 = 0;
        tail[u] = make_uint4(0, 0, 0, 0);
        if (seg.block >= 0 && k < seg.len()) {
          const uint8_t* rec =
              layer + seg.block * layout.block_stride +
              (seg.begin + k) * static_cast<int64_t>(kDsMlaRecord);
          c[u].q0 = LoadStream8(rec + 8 * lane);
          c[u].q1 = LoadStream8(rec + 256 + 8 * lane);
          const uint4 sf = __ldg(reinterpret_cast<const uint4*>(rec + 512));
          c[u].sb0 = lane < 16 ? sf.x : sf.y;  // tiles 0, 1
          c[u].sb1 = lane < 16 ? sf.z : sf.w;  // tiles 2, 3
          if (lane < 8) {
            tail[u] = LoadStream16(rec + kDsMlaTailOffset + 16 * lane);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        const int64_t k = i + u * step;
        if (k >= seg.len()) break;
        uint16_t* row = out + (static_cast<int64_t>(seg.dst) + k) * kDsMlaElems;
        if (seg.block >= 0) {
          DsMlaPutRowChunks(row, c[u], tail[u], lane);
        } else {  // zero rows
          const uint4 z = make_uint4(0, 0, 0, 0);
          StoreStream16(row + 8 * lane, z);
          StoreStream16(row + 256 + 8 * lane, z);
          if (lane < 8) StoreStream16(row + 512 + 8 * lane, z);
        }
      }
    }
  }
}

template <bool kHw>
cudaError_t Store(const PoolLayout& layout, uint8_t* layer, const uint16_t* kv,
                  const int32_t* slots, int64_t n, const Launch& launch) {
  constexpr auto kKernel = DsMlaStoreKernel<kHw, kStoreSteps>;
  const FastDiv div = FastDiv::Of(static_cast<int32_t>(layout.block_size));
  const dim3 grid(
      PersistentGrid(n, kWarpsPerCta, ResidentCtas<kKernel, kThreads>()));
  return LaunchKernel(kKernel, grid, dim3(kThreads), launch, layout, div, layer,
                      kv, slots, n);
}

cudaError_t Load(const PoolLayout& layout, const uint8_t* layer,
                 const int32_t* segments, int64_t num_segments, uint16_t* out,
                 const Launch& launch) {
  constexpr int64_t kPerCta = kWarpsPerCta * kLoadSteps;
  const int64_t tiles = (layout.block_size + kPerCta - 1) / kPerCta;
  const dim3 grid(
      static_cast<unsigned>(std::min<int64_t>(num_segments, INT32_MAX)),
      static_cast<unsigned>(std::clamp<int64_t>(tiles, 1, kMaxGridY)));
  return LaunchKernel(DsMlaLoadKernel<kLoadSteps>, grid, dim3(kThreads), launch,
                      layout, layer, segments, num_segments, out);
}

}  // namespace

cudaError_t LaunchDsMlaStore(const PoolLayout& layout, uint8_t* layer,
                             const uint16_t* kv, const int32_t* slots,
                             int64_t n, bool hw_cvt, const Launch& launch) {
  return hw_cvt ? Store<true>(layout, layer, kv, slots, n, launch)
                : Store<false>(layout, layer, kv, slots, n, launch);
}

cudaError_t LaunchDsMlaLoad(const PoolLayout& layout, const uint8_t* layer,
                            const int32_t* segments, int64_t num_segments,
                            uint16_t* out, const Launch& launch) {
  return Load(layout, layer, segments, num_segments, out, launch);
}

}  // namespace kvdepot::gpu::internal
