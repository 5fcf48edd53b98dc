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
// meet by xor shuffles. Two stores with the same math and bytes:
// - the warp store (small batches): persistent, kSteps tokens per warp in
//   flight (every load of a round issued before any math), records written
//   by the lanes;
// - the bulk store (large batches, 16-byte aligned layer and block stride;
//   ds_mla_bulk.cuh): persistent CTAs of 16 warps over tiles of 16
//   consecutive tokens, whose rows (contiguous) arrive in shared memory by
//   one bulk copy two tiles ahead; each warp encodes its token from shared
//   memory into a shared record that one bulk store writes to the slot.
//   Measured on the H200 (docs/BENCHMARKS.md): 91 % of copy at 1M tokens
//   where the warp store reaches 82 % (its scattered 656-byte records are
//   written in 8- and 16-byte pieces by every lane); no faster at 64K.
// The load is one CTA per (segment, tile of kWarpsPerCta x kSteps tokens),
// grid-stride in both, each warp issuing the loads of its kSteps tokens
// before decoding any. Record stores keep the default cache policy (see
// DsMlaPutRecordChunks). Measured and not kept: evict-first record stores,
// 4 tokens per warp in the warp store, 2 in the load, 128- and 256-byte L2
// prefetch hints on the loads; the warp store and the load run within 2.5
// points of copy of their no-math traffic ceilings (bench_ceiling.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/cuda/device_quant.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/ds_mla.cuh"
#include "kernels/cuda/ds_mla_bulk.cuh"
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

template <bool kHw>
__global__ void __launch_bounds__(kDsMlaBulkThreads)
    DsMlaStoreBulkKernel(int64_t block_stride, FastDiv div, uint8_t* layer,
                         const uint16_t* kv,    // [n][576] BF16
                         const int32_t* slots,  // [n]; -1 = padding, skip
                         int64_t n) {
  DsMlaBulkStore(
      block_stride, div, layer, kv, slots, n,
      [&](const uint8_t* row, uint8_t* rec, int lane) {
        LaneInput<uint16_t> raw;
        raw.v[0] = *reinterpret_cast<const uint4*>(row + 16 * lane);
        raw.v[1] = *reinterpret_cast<const uint4*>(row + 512 + 16 * lane);
        const uint4 tail =
            lane < 8 ? *reinterpret_cast<const uint4*>(row + 1024 + 16 * lane)
                     : make_uint4(0, 0, 0, 0);
        float x[16];
        ToFloat16(raw, x);
        const uint4 a = raw.v[0], b = raw.v[1];
        const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        const DsMlaChunks c = DsMlaEncodeChunksBf16<kHw>(x, w);
        // rec as slot 0 of a one-record "layer" in shared memory.
        DsMlaPutRecordChunks</*kStreaming=*/false>(rec, 0, div, 0, c, tail,
                                                   lane);
      });
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
cudaError_t StoreWarps(const PoolLayout& layout, uint8_t* layer,
                       const uint16_t* kv, const int32_t* slots, int64_t n,
                       const Launch& launch) {
  constexpr auto kKernel = DsMlaStoreKernel<kHw, kStoreSteps>;
  const FastDiv div = FastDiv::Of(static_cast<int32_t>(layout.block_size));
  const dim3 grid(
      PersistentGrid(n, kWarpsPerCta, ResidentCtas<kKernel, kThreads>()));
  return LaunchKernel(kKernel, grid, dim3(kThreads), launch, layout, div, layer,
                      kv, slots, n);
}

bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Launches the bulk store, or returns cudaErrorNotSupported (launching
// nothing) where it cannot run: a layer or input not 16-byte aligned, a
// block stride not a multiple of 16, a device without the shared memory.
template <bool kHw>
cudaError_t StoreBulk(const PoolLayout& layout, uint8_t* layer,
                      const uint16_t* kv, const int32_t* slots, int64_t n,
                      const Launch& launch) {
  constexpr auto kKernel = DsMlaStoreBulkKernel<kHw>;
  if (!Aligned16(layer) || !Aligned16(kv) || layout.block_stride % 16 != 0) {
    return cudaErrorNotSupported;
  }
  const int resident =
      ResidentCtasSmem<kKernel, kDsMlaBulkThreads, kDsMlaBulkSmem>();
  if (resident == 0) return cudaErrorNotSupported;
  const FastDiv div = FastDiv::Of(static_cast<int32_t>(layout.block_size));
  const dim3 grid(PersistentGrid(n, kDsMlaBulkTile, resident));
  return LaunchKernelSmem(kKernel, grid, dim3(kDsMlaBulkThreads),
                          kDsMlaBulkSmem, launch, layout.block_stride, div,
                          layer, kv, slots, n);
}

template <bool kHw>
cudaError_t Store(const PoolLayout& layout, uint8_t* layer, const uint16_t* kv,
                  const int32_t* slots, int64_t n, DsMlaStorePath path,
                  const Launch& launch) {
  switch (path) {
    case DsMlaStorePath::kWarps:
      return StoreWarps<kHw>(layout, layer, kv, slots, n, launch);
    case DsMlaStorePath::kBulk:
      return StoreBulk<kHw>(layout, layer, kv, slots, n, launch);
    case DsMlaStorePath::kAuto:
      break;
  }
  if (n >= kDsMlaBulkMinTokens) {
    const cudaError_t e = StoreBulk<kHw>(layout, layer, kv, slots, n, launch);
    if (e != cudaErrorNotSupported) return e;
  }
  return StoreWarps<kHw>(layout, layer, kv, slots, n, launch);
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
                             int64_t n, bool hw_cvt, const Launch& launch,
                             DsMlaStorePath path) {
  return hw_cvt ? Store<true>(layout, layer, kv, slots, n, path, launch)
                : Store<false>(layout, layer, kv, slots, n, path, launch);
}

cudaError_t LaunchDsMlaLoad(const PoolLayout& layout, const uint8_t* layer,
                            const int32_t* segments, int64_t num_segments,
                            uint16_t* out, const Launch& launch) {
  return Load(layout, layer, segments, num_segments, out, launch);
}

}  // namespace kvdepot::gpu::internal
