// bench_ceiling.h: ds_mla.cu's stores and load with the math taken out.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string_view>

#include "kernels/cuda/bench_ceiling.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/ds_mla_bulk.cuh"
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

// LoadTrafficKernel's accesses from a persistent grid: warp w takes the
// flat items (segment s, token k < block_size) w, w + W, ..., two in flight.
__global__ void __launch_bounds__(kThreads)
    LoadTrafficPersistentKernel(int64_t block_stride, int32_t block_size,
                                const uint8_t* layer, const int32_t* segments,
                                int64_t num_segments, uint16_t* out) {
  constexpr int kSteps = 2;
  const int lane = threadIdx.x % kWarp;
  const int64_t warp =
      static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  const int64_t items = num_segments * block_size;
  for (int64_t base = warp; base < items; base += kSteps * warps) {
    uint2 q0[kSteps], q1[kSteps];
    uint4 sf[kSteps], tail[kSteps];
    int64_t dst[kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int64_t item = base + u * warps;
      q0[u] = q1[u] = make_uint2(0, 0);
      sf[u] = tail[u] = make_uint4(0, 0, 0, 0);
      dst[u] = -1;
      if (item >= items) continue;
      const int64_t s = item / block_size;
      const int32_t k = static_cast<int32_t>(item - s * block_size);
      const int32_t* p = segments + kSegmentFields * s;
      const Segment seg{__ldg(p), __ldg(p + 1), __ldg(p + 2), __ldg(p + 3)};
      if (k >= seg.len()) continue;
      dst[u] = static_cast<int64_t>(seg.dst) + k;
      if (seg.block >= 0) {
        const uint8_t* rec = layer + seg.block * block_stride +
                             (seg.begin + k) * static_cast<int64_t>(kRecord);
        q0[u] = internal::LoadStream8(rec + 8 * lane);
        q1[u] = internal::LoadStream8(rec + 256 + 8 * lane);
        sf[u] = __ldg(reinterpret_cast<const uint4*>(rec + 512));
        if (lane < 8) tail[u] = internal::LoadStream16(rec + kTail + 16 * lane);
      }
    }
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      if (dst[u] < 0) continue;
      uint16_t* row = out + dst[u] * kElems;
      const uint32_t s0 = lane < 16 ? sf[u].x : sf[u].y;
      const uint32_t s1 = lane < 16 ? sf[u].z : sf[u].w;
      internal::StoreStream16(
          row + 8 * lane,
          make_uint4(q0[u].x, q0[u].y ^ s0, q0[u].x ^ s0, q0[u].y));
      internal::StoreStream16(
          row + 256 + 8 * lane,
          make_uint4(q1[u].x, q1[u].y ^ s1, q1[u].x ^ s1, q1[u].y));
      if (lane < 8) internal::StoreStream16(row + 512 + 8 * lane, tail[u]);
    }
  }
}

// The load's bytes as plain contiguous copies: one CTA per segment reads
// its records (len x 656 bytes) and writes its rows (len x 1152 bytes) in
// 16-byte words, each written word depending on a read one. No per-token
// layout: the best any load of these bytes could do.
__global__ void __launch_bounds__(kThreads)
    LoadTrafficFlatKernel(int64_t block_stride, const uint8_t* layer,
                          const int32_t* segments, int64_t num_segments,
                          uint16_t* out) {
  for (int64_t s = blockIdx.x; s < num_segments; s += gridDim.x) {
    const int32_t* p = segments + kSegmentFields * s;
    const Segment seg{__ldg(p), __ldg(p + 1), __ldg(p + 2), __ldg(p + 3)};
    if (seg.len() <= 0) continue;
    const int64_t in_words = int64_t{seg.len()} * (kRecord / 16);
    const int64_t out_words = int64_t{seg.len()} * (kElems * 2 / 16);
    const uint4* in = reinterpret_cast<const uint4*>(
        layer + (seg.block >= 0 ? seg.block : 0) * block_stride +
        int64_t{seg.begin} * kRecord);
    uint4* o = reinterpret_cast<uint4*>(out + int64_t{seg.dst} * kElems);
    for (int64_t w = threadIdx.x; w < out_words; w += kThreads) {
      const uint4 v = w < in_words
                          ? internal::LoadStream16(
                                reinterpret_cast<const uint16_t*>(in + w))
                          : make_uint4(0, 0, 0, 0);
      internal::StoreStream16(reinterpret_cast<uint16_t*>(o + w),
                              make_uint4(v.y, v.x, v.w, v.z));
    }
  }
}

// The store's bytes as plain contiguous copies: input words (n x 1152
// bytes) read in order, record words (n x 656 bytes) written in order, each
// written word depending on a read one, two words in flight per thread. No
// per-token layout and no pool blocks: what plain copies of these bytes
// reach in one launch (a reference point, not a proven bound).
__global__ void __launch_bounds__(kThreads)
    StoreTrafficFlatKernel(const uint4* in, int64_t in_words, uint4* out,
                           int64_t out_words) {
  const int64_t threads = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
       w < in_words; w += 2 * threads) {
    uint4 v[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int64_t k = w + u * threads;
      v[u] = k < in_words ? internal::LoadStream16(in + k)
                          : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int64_t k = w + u * threads;
      if (k < out_words) out[k] = make_uint4(v[u].y, v[u].x, v[u].w, v[u].z);
    }
  }
}

// ds_mla.cu's bulk store with the mix instead of the encode.
__global__ void __launch_bounds__(internal::kDsMlaBulkThreads)
    StoreTrafficBulkKernel(int64_t block_stride, FastDiv div, uint8_t* layer,
                           const uint16_t* kv, const int32_t* slots,
                           int64_t n) {
  internal::DsMlaBulkStore(
      block_stride, div, layer, kv, slots, n,
      [](const uint8_t* row, uint8_t* rec, int lane) {
        const uint4 a = *reinterpret_cast<const uint4*>(row + 16 * lane);
        const uint4 b = *reinterpret_cast<const uint4*>(row + 512 + 16 * lane);
        *reinterpret_cast<uint2*>(rec + 8 * lane) =
            make_uint2(a.x ^ a.y, a.z ^ a.w);
        *reinterpret_cast<uint2*>(rec + 256 + 8 * lane) =
            make_uint2(b.x ^ b.y, b.z ^ b.w);
        if (lane == 0) {
          *reinterpret_cast<uint4*>(rec + 512) = make_uint4(a.x, b.x, a.y, b.y);
        }
        if (lane < 8) {
          *reinterpret_cast<uint4*>(rec + kTail + 16 * lane) =
              *reinterpret_cast<const uint4*>(row + 1024 + 16 * lane);
        }
      });
}

}  // namespace

cudaError_t DsMlaStoreTrafficFlat(uint8_t* layer, const uint16_t* kv, int64_t n,
                                  cudaStream_t stream) {
  const int64_t in_words = n * (kElems * 2 / 16);
  const int64_t out_words = n * (kRecord / 16);
  const dim3 grid(internal::PersistentGrid(
      in_words, 2 * kThreads,
      internal::ResidentCtas<StoreTrafficFlatKernel, kThreads>()));
  StoreTrafficFlatKernel<<<grid, kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(kv), in_words,
      reinterpret_cast<uint4*>(layer), out_words);
  return cudaGetLastError();
}

cudaError_t DsMlaStoreTrafficBulk(const PoolLayout& layout, uint8_t* layer,
                                  const uint16_t* kv, const int32_t* slots,
                                  int64_t n, cudaStream_t stream) {
  using internal::kDsMlaBulkSmem;
  using internal::kDsMlaBulkThreads;
  constexpr auto kKernel = StoreTrafficBulkKernel;
  if (layout.block_stride % 16 != 0) return cudaErrorInvalidValue;
  const int resident =
      internal::ResidentCtasSmem<kKernel, kDsMlaBulkThreads, kDsMlaBulkSmem>();
  if (resident == 0) return cudaErrorNotSupported;
  const FastDiv div = FastDiv::Of(static_cast<int32_t>(layout.block_size));
  const dim3 grid(
      internal::PersistentGrid(n, internal::kDsMlaBulkTile, resident));
  kKernel<<<grid, kDsMlaBulkThreads, kDsMlaBulkSmem, stream>>>(
      layout.block_stride, div, layer, kv, slots, n);
  return cudaGetLastError();
}

cudaError_t DsMlaLoadTrafficPersistent(const PoolLayout& layout,
                                       const uint8_t* layer,
                                       const int32_t* segments,
                                       int64_t num_segments, uint16_t* out,
                                       cudaStream_t stream) {
  const int64_t items = num_segments * layout.block_size;
  const dim3 grid(internal::PersistentGrid(
      items, kWarpsPerCta,
      internal::ResidentCtas<LoadTrafficPersistentKernel, kThreads>()));
  LoadTrafficPersistentKernel<<<grid, kThreads, 0, stream>>>(
      layout.block_stride, static_cast<int32_t>(layout.block_size), layer,
      segments, num_segments, out);
  return cudaGetLastError();
}

cudaError_t DsMlaLoadTrafficFlat(const PoolLayout& layout, const uint8_t* layer,
                                 const int32_t* segments, int64_t num_segments,
                                 uint16_t* out, cudaStream_t stream) {
  const dim3 grid(
      static_cast<unsigned>(std::min<int64_t>(num_segments, INT32_MAX)));
  LoadTrafficFlatKernel<<<grid, kThreads, 0, stream>>>(
      layout.block_stride, layer, segments, num_segments, out);
  return cudaGetLastError();
}

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

namespace {
__global__ void EmptyKernelBody() {}

// Every 16-byte word of `p` read through L2 (ld.global.cg: L1 bypassed,
// the line allocated in L2); the xor of all of them is written only if it
// equals `never`, which it cannot be told apart from at compile time, so
// no load is dropped and nothing is written in practice.
__global__ void ReadFlushBody(const uint4* p, int64_t words, uint32_t never,
                              uint32_t* sink) {
  uint32_t acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < words; i += stride) {
    const uint4 v = __ldcg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == never) *sink = acc;
}

constexpr int kChains = 8, kLinks = 512;

template <bool kUnrolled>
__global__ void CodeFetchBody(float* out, int links) {
  float v[kChains];
#pragma unroll
  for (int i = 0; i < kChains; ++i) v[i] = static_cast<float>(threadIdx.x + i);
  if constexpr (kUnrolled) {
#pragma unroll
    for (int k = 0; k < kLinks; ++k) {
#pragma unroll
      for (int i = 0; i < kChains; ++i) v[i] = __fmaf_rn(v[i], 1.0001f, 0.5f);
    }
  } else {
#pragma unroll 1
    for (int k = 0; k < links; ++k) {
#pragma unroll
      for (int i = 0; i < kChains; ++i) v[i] = __fmaf_rn(v[i], 1.0001f, 0.5f);
    }
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kChains; ++i) sum += v[i];
  out[threadIdx.x] = sum;
}
}  // namespace

cudaError_t FlushL2(L2Flush mode, void* buffer, int64_t bytes, int salt,
                    cudaStream_t stream) {
  if (mode == L2Flush::kWrite) {
    return cudaMemsetAsync(buffer, salt & 0xFF, bytes, stream);
  }
  if (bytes < 32 || bytes % 16 != 0) return cudaErrorInvalidValue;
  // The buffer's last word is the sink (read before it could be written).
  auto* words = static_cast<const uint4*>(buffer);
  auto* sink = static_cast<uint32_t*>(buffer) + bytes / 4 - 1;
  int device = 0, sms = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  if (e != cudaSuccess) return e;
  ReadFlushBody<<<8 * sms, 256, 0, stream>>>(
      words, bytes / 16, 0x9E3779B9u ^ static_cast<uint32_t>(salt), sink);
  return cudaGetLastError();
}

bool ParseL2Flush(const char* name, L2Flush* mode) {
  const std::string_view n(name);
  if (n == "write") {
    *mode = L2Flush::kWrite;
  } else if (n == "read") {
    *mode = L2Flush::kRead;
  } else {
    return false;
  }
  return true;
}

const char* L2FlushName(L2Flush mode) {
  return mode == L2Flush::kWrite ? "write" : "read";
}

cudaError_t EmptyKernel(cudaStream_t stream) {
  EmptyKernelBody<<<1, kWarp, 0, stream>>>();
  return cudaGetLastError();
}

cudaError_t CodeFetchKernel(bool unrolled, float* out, cudaStream_t stream) {
  if (unrolled) {
    CodeFetchBody<true><<<1, kWarp, 0, stream>>>(out, kLinks);
  } else {
    CodeFetchBody<false><<<1, kWarp, 0, stream>>>(out, kLinks);
  }
  return cudaGetLastError();
}

}  // namespace kvdepot::gpu::ceiling
