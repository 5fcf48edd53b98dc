// DS_MLA_FP8 store and load kernels (SPEC §2.1). One warp per token, 16-byte
// accesses only:
//
//   input row (BF16, 1152 B):  lane l: elements [16l, 16l + 16) (2 x 16 B);
//                              lanes 0-7 also tail elements [512 + 8l, +8)
//   record (656 B, 16-aligned): codes [16l, 16l + 16)   one 16 B per lane
//                               scales [512, 528)       lane 0, one 16 B
//                               tail [528 + 16l, +16)   lanes 0-7
//
// A tile (128 elements) is lanes 8k..8k+7; its amax and non-finite flags
// meet by xor shuffles (ds_mla.cuh). The store is persistent with kSteps
// tokens per warp in flight (every load of a round issued before any math);
// the load is one CTA per (segment, tile of kWarpsPerCta x kSteps tokens),
// grid-stride in both, each warp issuing the loads of its kSteps tokens
// before decoding any. Round 1 runs store kSteps 2 and load kSteps 1 (the
// default); round 2 (LaunchOptions::ds_mla_round2: store 4, load 4 steps,
// more bytes in flight per warp) measured no better for the store and worse
// for the load on the H200 (load 61.8% vs 68.2% of copy at 64K tokens,
// 69.7% vs 75.2% at 1M, same run), so it stays an option for the
// benchmark. Same bytes either way.
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
constexpr int kStoreSteps = 2, kRound2StoreSteps = 4;
constexpr int kLoadSteps = 1, kRound2LoadSteps = 4;
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
        in[u].a = LoadStream16(row + 16 * lane);
        in[u].b = LoadStream16(row + 16 * lane + 8);
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
      uint32_t sb;
      const uint4 q = DsMlaEncode16<kHw>(x, &sb);
      DsMlaPutRecord(layer, layout.block_stride, div, slot, q, sb, in[u].tail,
                     lane);
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
      uint4 q[kSteps], tail[kSteps];
      uint32_t sb[kSteps];
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {  // every load first
        const int64_t k = i + u * step;
        q[u] = tail[u] = make_uint4(0, 0, 0, 0);
        sb[u] = 0;
        if (seg.block >= 0 && k < seg.len()) {
          const uint8_t* rec =
              layer + seg.block * layout.block_stride +
              (seg.begin + k) * static_cast<int64_t>(kDsMlaRecord);
          q[u] = LoadStream16(rec + 16 * lane);
          sb[u] = __ldg(reinterpret_cast<const unsigned int*>(rec + 512) +
                        lane / 8);
          if (lane < 8) {
            tail[u] = LoadStream16(rec + kDsMlaTailOffset + 16 * lane);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        const int64_t k = i + u * step;
        if (k >= seg.len()) break;
        uint32_t w[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (seg.block >= 0) DsMlaDecode16(q[u], sb[u], w);
        uint16_t* row = out + (static_cast<int64_t>(seg.dst) + k) * kDsMlaElems;
        StoreStream16(row + 16 * lane, make_uint4(w[0], w[1], w[2], w[3]));
        StoreStream16(row + 16 * lane + 8, make_uint4(w[4], w[5], w[6], w[7]));
        if (lane < 8) StoreStream16(row + 512 + 8 * lane, tail[u]);
      }
    }
  }
}

template <bool kHw, int kSteps>
cudaError_t Store(const PoolLayout& layout, uint8_t* layer, const uint16_t* kv,
                  const int32_t* slots, int64_t n, const Launch& launch) {
  constexpr auto kKernel = DsMlaStoreKernel<kHw, kSteps>;
  const FastDiv div = FastDiv::Of(static_cast<int32_t>(layout.block_size));
  const dim3 grid(
      PersistentGrid(n, kWarpsPerCta, ResidentCtas<kKernel, kThreads>()));
  return LaunchKernel(kKernel, grid, dim3(kThreads), launch, layout, div, layer,
                      kv, slots, n);
}

template <int kSteps>
cudaError_t Load(const PoolLayout& layout, const uint8_t* layer,
                 const int32_t* segments, int64_t num_segments, uint16_t* out,
                 const Launch& launch) {
  constexpr int64_t kPerCta = kWarpsPerCta * kSteps;
  const int64_t tiles = (layout.block_size + kPerCta - 1) / kPerCta;
  const dim3 grid(
      static_cast<unsigned>(std::min<int64_t>(num_segments, INT32_MAX)),
      static_cast<unsigned>(std::clamp<int64_t>(tiles, 1, kMaxGridY)));
  return LaunchKernel(DsMlaLoadKernel<kSteps>, grid, dim3(kThreads), launch,
                      layout, layer, segments, num_segments, out);
}

}  // namespace

cudaError_t LaunchDsMlaStore(const PoolLayout& layout, uint8_t* layer,
                             const uint16_t* kv, const int32_t* slots,
                             int64_t n, bool hw_cvt, const Launch& launch) {
  if (launch.ds_mla_round2) {
    return hw_cvt ? Store<true, kRound2StoreSteps>(layout, layer, kv, slots, n,
                                                   launch)
                  : Store<false, kRound2StoreSteps>(layout, layer, kv, slots, n,
                                                    launch);
  }
  return hw_cvt
             ? Store<true, kStoreSteps>(layout, layer, kv, slots, n, launch)
             : Store<false, kStoreSteps>(layout, layer, kv, slots, n, launch);
}

cudaError_t LaunchDsMlaLoad(const PoolLayout& layout, const uint8_t* layer,
                            const int32_t* segments, int64_t num_segments,
                            uint16_t* out, const Launch& launch) {
  if (launch.ds_mla_round2) {
    return Load<kRound2LoadSteps>(layout, layer, segments, num_segments, out,
                                  launch);
  }
  return Load<kLoadSteps>(layout, layer, segments, num_segments, out, launch);
}

}  // namespace kvdepot::gpu::internal
