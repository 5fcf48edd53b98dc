// bench_ceiling.h: ds_mla.cu's store and load with the math taken out.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/cuda/bench_ceiling.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_internal.h"
#include "kernels/store_load.h"

namespace kvdepot::gpu::ceiling {
namespace {

using internal::FastDiv;
using internal::kWarp;
constexpr int kThreads = 128;
constexpr int kWarpsPerCta = kThreads / kWarp;
constexpr int kStoreSteps = 2;  // as ds_mla.cu
constexpr int kRecord = 656, kElems = 576, kTail = 528;
constexpr unsigned kMaxGridY = 65535;

struct In {
  uint4 a, b, tail;
  int32_t slot;
};

__global__ void __launch_bounds__(kThreads)
    StoreTrafficKernel(int64_t block_stride, FastDiv div, uint8_t* layer,
                       const uint16_t* kv, const int32_t* slots, int64_t n) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warp =
      static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  for (int64_t base = warp; base < n; base += kStoreSteps * warps) {
    In in[kStoreSteps];
#pragma unroll
    for (int u = 0; u < kStoreSteps; ++u) {
      const int64_t token = base + u * warps;
      in[u].slot = -1;
      if (token < n) {
        const uint16_t* row = kv + token * kElems;
        in[u].slot = slots == nullptr ? static_cast<int32_t>(token)
                                      : __ldg(slots + token);
        in[u].a = internal::LoadStream16(row + 8 * lane);
        in[u].b = internal::LoadStream16(row + 256 + 8 * lane);
        if (lane < 8) in[u].tail = internal::LoadStream16(row + 512 + 8 * lane);
      }
    }
#pragma unroll
    for (int u = 0; u < kStoreSteps; ++u) {
      const int32_t slot = in[u].slot;
      if (slot < 0) continue;
      const int32_t block = div.Div(slot);
      uint8_t* rec = layer + block * block_stride +
                     static_cast<int64_t>(slot - block * div.d) * kRecord;
      const uint4 a = in[u].a, b = in[u].b;
      *reinterpret_cast<uint2*>(rec + 8 * lane) =
          make_uint2(a.x ^ a.y, a.z ^ a.w);
      *reinterpret_cast<uint2*>(rec + 256 + 8 * lane) =
          make_uint2(b.x ^ b.y, b.z ^ b.w);
      if (lane == 0) {
        *reinterpret_cast<uint4*>(rec + 512) = make_uint4(a.x, b.x, a.y, b.y);
      }
      if (lane < 8)
        *reinterpret_cast<uint4*>(rec + kTail + 16 * lane) = in[u].tail;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    LoadTrafficKernel(int64_t block_stride, const uint8_t* layer,
                      const int32_t* segments, int64_t num_segments,
                      uint16_t* out) {
  const int lane = threadIdx.x % kWarp;
  const int32_t mine = static_cast<int32_t>(blockIdx.y) * kWarpsPerCta +
                       static_cast<int32_t>(threadIdx.x) / kWarp;
  const int64_t step = static_cast<int64_t>(gridDim.y) * kWarpsPerCta;
  for (int64_t s = blockIdx.x; s < num_segments; s += gridDim.x) {
    const int32_t* p = segments + kSegmentFields * s;
    const Segment seg{__ldg(p), __ldg(p + 1), __ldg(p + 2), __ldg(p + 3)};
    for (int64_t i = mine; i < seg.len(); i += step) {
      uint2 q0 = make_uint2(0, 0), q1 = q0;
      uint4 sf = make_uint4(0, 0, 0, 0), tail = sf;
      if (seg.block >= 0) {
        const uint8_t* rec = layer + seg.block * block_stride +
                             (seg.begin + i) * static_cast<int64_t>(kRecord);
        q0 = internal::LoadStream8(rec + 8 * lane);
        q1 = internal::LoadStream8(rec + 256 + 8 * lane);
        sf = __ldg(reinterpret_cast<const uint4*>(rec + 512));
        if (lane < 8) tail = internal::LoadStream16(rec + kTail + 16 * lane);
      }
      uint16_t* row = out + (static_cast<int64_t>(seg.dst) + i) * kElems;
      const uint32_t s0 = lane < 16 ? sf.x : sf.y, s1 = lane < 16 ? sf.z : sf.w;
      internal::StoreStream16(row + 8 * lane,
                              make_uint4(q0.x, q0.y ^ s0, q0.x ^ s0, q0.y));
      internal::StoreStream16(row + 256 + 8 * lane,
                              make_uint4(q1.x, q1.y ^ s1, q1.x ^ s1, q1.y));
      if (lane < 8) internal::StoreStream16(row + 512 + 8 * lane, tail);
    }
  }
}

}  // namespace

cudaError_t DsMlaStoreTraffic(const PoolLayout& layout, uint8_t* layer,
                              const uint16_t* kv, const int32_t* slots,
                              int64_t n, cudaStream_t stream) {
  const FastDiv div = FastDiv::Of(static_cast<int32_t>(layout.block_size));
  const dim3 grid(internal::PersistentGrid(
      n, kWarpsPerCta, internal::ResidentCtas<StoreTrafficKernel, kThreads>()));
  StoreTrafficKernel<<<grid, kThreads, 0, stream>>>(layout.block_stride, div,
                                                    layer, kv, slots, n);
  return cudaGetLastError();
}

cudaError_t DsMlaLoadTraffic(const PoolLayout& layout, const uint8_t* layer,
                             const int32_t* segments, int64_t num_segments,
                             uint16_t* out, cudaStream_t stream) {
  const int64_t tiles = (layout.block_size + kWarpsPerCta - 1) / kWarpsPerCta;
  const dim3 grid(
      static_cast<unsigned>(std::min<int64_t>(num_segments, INT32_MAX)),
      static_cast<unsigned>(std::clamp<int64_t>(tiles, 1, kMaxGridY)));
  LoadTrafficKernel<<<grid, kThreads, 0, stream>>>(layout.block_stride, layer,
                                                   segments, num_segments, out);
  return cudaGetLastError();
}

}  // namespace kvdepot::gpu::ceiling
