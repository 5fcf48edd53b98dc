// The fused store for DS_MLA_FP8 in its MLA configuration (SPEC §8):
// RMSNorm over [0, 512) or none, RoPE on [512, 576) (either style) or none,
// no Hadamard. Kernels with the same bytes: the warp kernel below; the
// same loading the next token ahead, from kFusedMlaAheadMinTokens tokens
// (built for 7 or 5 CTAs per SM); and, as the plain DS_MLA_FP8 store has
// (ds_mla.cu), from kFusedMlaBulkMinTokens tokens on devices with few enough
// bytes per SM (fused_internal.h) the bulk kernel further down (rows into
// shared memory by bulk copies, records out by bulk stores). In all the math
// stays in registers in the plain store's coalesced chunk layout (ds_mla.cuh),
// so the kernels move the bytes that store moves plus the cos/sin rows:
//
//   lane l: chunks l and 32 + l of 8 elements ([8l, +8), [256 + 8l, +8))
//           and tail elements 512 + 2l, 513 + 2l: the RoPE part spread
//           over the whole warp, one 4-byte word per lane, with its
//           cos/sin values (interleaved: pair l; NeoX: the first halves
//           of pairs 2l, 2l + 1 for l < 16, the second halves of pairs
//           2l - 32, 2l - 31 for l >= 16, their partners 16 lanes apart).
//           On lanes 0-7 (16 bytes each) the RoPE math and the tail's
//           NaN canonicalization took a quarter of the warp's issue slots
//           for the whole token's tail; spread, every lane does one pair.
//
// Bit-exactness with kernels/reference/fused.cc: SPEC §8's reduction tree
// puts chunk c's sum of squares (left to right) into slot c mod 32, the
// slot adding its chunks in increasing c (slot s = S_s + S_(s+32) for the
// range [0, 512)), then the slots meet by xor steps h = 16, 8, 4, 2, 1.
// Here lane l holds exactly chunks l and l + 32, so lane l forms slot l and
// step h is a shuffle with lane l ^ h: every pair meets the same partner as
// in the reference, and a + b = b + a exactly, so every lane ends with the
// reference's bits. Products, sums, sqrt and divisions are round-to-nearest
// intrinsics (no FMA contraction).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_quant.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/ds_mla.cuh"
#include "kernels/cuda/ds_mla_bulk.cuh"
#include "kernels/cuda/fused_internal.h"
#include "kernels/format.h"
#include "kernels/fused.h"
#include "kernels/quant.h"

namespace kvdepot::gpu::internal {
namespace {

constexpr int kThreads = 128;
constexpr int kWarpsPerCta = kThreads / kWarp;
// One token in flight per warp, 8 CTAs (32 warps) per SM at <= 64
// registers: the same tokens in flight per SM as 2 per warp at 4 CTAs
// (which measured 37 % of copy at 64K tokens on the H200, 25 % occupancy,
// SM throughput 59 %: the math needs more warps to hide its latency).
constexpr int kSteps = 1;
constexpr int kMinCtas = 8;
constexpr int kNormEnd = 512;
constexpr int kRopeDim = kDsMlaElems - kNormEnd;  // 64
constexpr int kHalf = kRopeDim / 2;

struct MlaIn {
  uint4 a, b;
  uint32_t tail;  // elements 512 + 2l, 513 + 2l
  float2 c, s;    // their cos/sin (interleaved: .x, pair l)
  int32_t slot;
};

__device__ __forceinline__ float SumSquares8(const float* x) {
  float s = __fmul_rn(x[0], x[0]);
#pragma unroll
  for (int i = 1; i < 8; ++i) s = __fadd_rn(s, __fmul_rn(x[i], x[i]));
  return s;
}

__device__ __forceinline__ void Unpack8(uint4 v, float* x) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = BitsToFloat(w[i] << 16);
    x[2 * i + 1] = BitsToFloat(w[i] & 0xFFFF0000u);
  }
}

// Rounds 16 values that are only quantized afterwards to BF16 by the
// hardware, in place, and returns them packed: any NaN stays a NaN (its
// payload is never stored), every number rounds alike (RNE).
__device__ __forceinline__ void RoundHw16(float (&x)[16], uint32_t (&w)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    w[i] = HwBf16x2(x[2 * i], x[2 * i + 1]);
    x[2 * i] = BitsToFloat(w[i] << 16);
    x[2 * i + 1] = BitsToFloat(w[i] & 0xFFFF0000u);
  }
}

// The lane's cos/sin values of position pos (zeros without RoPE).
template <RopeStyle kRope>
__device__ __forceinline__ void LoadCosSin(const FusedParams& p, int64_t pos,
                                           int lane, MlaIn& in) {
  in.c = in.s = make_float2(0.0f, 0.0f);
  const float* cs = p.cos_sin + pos * kRopeDim;
  if constexpr (kRope == RopeStyle::kInterleaved) {
    in.c.x = __ldg(cs + lane);          // cos[l]
    in.s.x = __ldg(cs + kHalf + lane);  // sin[l]
  } else if constexpr (kRope == RopeStyle::kNeox) {
    const int j = 2 * (lane % 16);  // pairs j, j + 1
    in.c = __ldg(reinterpret_cast<const float2*>(cs + j));
    in.s = __ldg(reinterpret_cast<const float2*>(cs + kHalf + j));
  }
}

// The lane's norm weights (its chunks l and 32 + l); zeros without the
// norm.
template <bool kNorm>
__device__ __forceinline__ void LoadNormWeights(const FusedParams& p, int lane,
                                                uint4& w0, uint4& w1) {
  w0 = w1 = make_uint4(0, 0, 0, 0);
  if constexpr (kNorm) {
    w0 = __ldg(reinterpret_cast<const uint4*>(p.norm_weight + 8 * lane));
    w1 = __ldg(reinterpret_cast<const uint4*>(p.norm_weight + 256 + 8 * lane));
  }
}

template <bool kNorm, RopeStyle kRope>
__device__ __forceinline__ void LoadMla(const uint16_t* kv, int64_t token,
                                        int64_t pos, const int32_t* slots,
                                        const FusedParams& p, int lane,
                                        MlaIn& in) {
  const uint16_t* row = kv + token * kDsMlaElems;
  in.slot = __ldg(slots + token);
  in.a = LoadStream16(row + 8 * lane);
  in.b = LoadStream16(row + 256 + 8 * lane);
  in.tail = LoadStream4(row + kNormEnd + 2 * lane);
  LoadCosSin<kRope>(p, pos, lane, in);
}

// Encodes the token of `in`; writes its record to slot in.slot of the layer
// (nothing for -1) and its cast-back row (if any).
template <bool kNorm, RopeStyle kRope>
__device__ __forceinline__ void ProcessMla(int64_t block_stride,
                                           const FastDiv& div, uint8_t* layer,
                                           const FusedParams& p,
                                           const MlaIn& in, uint4 w0, uint4 w1,
                                           int lane, uint16_t* cast_row) {
  float x[16];
  Unpack8(in.a, x);
  Unpack8(in.b, x + 8);
  if constexpr (kNorm) {
    float sum = __fadd_rn(SumSquares8(x), SumSquares8(x + 8));  // slot l
#pragma unroll
    for (int h = 16; h >= 1; h /= 2) {
      sum = __fadd_rn(sum, __shfl_xor_sync(kFullMask, sum, h));
    }
    // sum / 512 is exact scaling by 2^-9 (no flush to zero here): the same
    // bits as the reference's division, without the division's slow path.
    const float mean = __fmul_rn(sum, 1.0f / kNormEnd);
    const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, p.eps)));
    float w[16];
    Unpack8(w0, w);
    Unpack8(w1, w + 8);
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = __fmul_rn(__fmul_rn(x[i], r), w[i]);
  }
  float t0 = BitsToFloat(in.tail << 16),
        t1 = BitsToFloat(in.tail & 0xFFFF0000u);
  if constexpr (kRope == RopeStyle::kInterleaved) {
    const float a = t0, b = t1;
    t0 = __fsub_rn(__fmul_rn(a, in.c.x), __fmul_rn(b, in.s.x));
    t1 = __fadd_rn(__fmul_rn(b, in.c.x), __fmul_rn(a, in.s.x));
  } else if constexpr (kRope == RopeStyle::kNeox) {
    // Pair i = (element 512 + i, element 544 + i): lanes l and l ^ 16.
    // a c - b s (first half) and b c + a s (second) are both t c + o s'
    // with the partner's o and s' = -s on the first half: the same bits,
    // as fused_h512.cu's Rope says.
    const bool second = lane >= 16;
    const float o0 = __shfl_xor_sync(kFullMask, t0, 16);
    const float o1 = __shfl_xor_sync(kFullMask, t1, 16);
    t0 = __fadd_rn(__fmul_rn(t0, in.c.x),
                   __fmul_rn(o0, second ? in.s.x : -in.s.x));
    t1 = __fadd_rn(__fmul_rn(t1, in.c.y),
                   __fmul_rn(o1, second ? in.s.y : -in.s.y));
  }
  uint32_t xw[8] = {in.a.x, in.a.y, in.a.z, in.a.w,
                    in.b.x, in.b.y, in.b.z, in.b.w};
  if constexpr (kNorm) RoundHw16(x, xw);  // else x is the BF16 input
  const uint32_t tw = HwBf16x2Canonical(t0, t1);
  const DsMlaChunks c = DsMlaEncodeChunksBf16<true>(x, xw);
  DsMlaPutRecordChunks</*kStreaming=*/false>(layer, block_stride, div, in.slot,
                                             c, tw, lane);
  if (cast_row != nullptr) {
    DsMlaPutRowChunks</*kStreaming=*/false>(cast_row, c, tw, lane);
  }
}

// The warp kernel loading ahead: token t + warps's row, slot and cos/sin
// go out before token t is processed, so each warp has two tokens' loads
// in flight (two MlaIn in registers). For the batches where the math's
// latency, not the bytes, holds the one-token kernel back; the same bytes.
// Built for at least kCtas CTAs per SM: 7 (<= 72 registers with the norm;
// the most warps) or 5 (<= 102: with the norm the compiler takes 75-84, so
// 5 or 6 are resident; 6 with interleaved RoPE), which kAuto takes with
// cast_back and from kFusedMlaAhead5MinTokens tokens (fused_internal.h has
// the figures). Without the norm both need <= 56 registers (9 CTAs).
template <bool kNorm, RopeStyle kRope, int kCtas>
__global__ void __launch_bounds__(kThreads, kCtas)
    FusedMlaAheadKernel(PoolLayout layout, FastDiv div, uint8_t* layer,
                        const uint16_t* kv,  // [n][576] BF16
                        FusedParams p,
                        const int32_t* slots,  // [n]; -1 = skip
                        int64_t n,
                        uint16_t* cast_back) {  // [n][576] BF16 or null
  PdlWait();
  PdlLaunchDependents();
  const int lane = threadIdx.x % kWarp;
  const int64_t warp =
      static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  uint4 w0, w1;
  LoadNormWeights<kNorm>(p, lane, w0, w1);
  const auto position = [&](int64_t token) -> int64_t {
    return kRope != RopeStyle::kNone && token < n ? __ldg(p.positions + token)
                                                  : 0;
  };
  MlaIn cur;
  if (warp < n) {
    LoadMla<kNorm, kRope>(kv, warp, position(warp), slots, p, lane, cur);
  }
  int64_t pos_next = position(warp + warps);  // one token ahead of the row
  for (int64_t token = warp; token < n; token += warps) {
    const int64_t next = token + warps;
    MlaIn ahead;
    if (next < n) {
      LoadMla<kNorm, kRope>(kv, next, pos_next, slots, p, lane, ahead);
    }
    pos_next = position(next + warps);
    uint16_t* cast_row =
        cast_back == nullptr ? nullptr : cast_back + token * kDsMlaElems;
    ProcessMla<kNorm, kRope>(layout.block_stride, div, layer, p, cur, w0, w1,
                             lane, cast_row);
    cur = ahead;
  }
}

template <bool kNorm, RopeStyle kRope>
__global__ void __launch_bounds__(kThreads, kMinCtas)
    FusedMlaKernel(PoolLayout layout, FastDiv div, uint8_t* layer,
                   const uint16_t* kv,  // [n][576] BF16
                   FusedParams p,
                   const int32_t* slots,  // [n]; -1 = skip (cast_back kept)
                   int64_t n,
                   uint16_t* cast_back) {  // [n][576] BF16 or null
  PdlWait();
  PdlLaunchDependents();
  const int lane = threadIdx.x % kWarp;
  const int64_t warp =
      static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  uint4 w0, w1;
  LoadNormWeights<kNorm>(p, lane, w0, w1);
  // The positions of the next round are read one round ahead, so a
  // token's cos/sin loads go out with its row instead of after a
  // dependent load of its position.
  constexpr bool kRopeOn = kRope != RopeStyle::kNone;
  int64_t pos[kSteps];
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
    const int64_t token = warp + u * warps;
    pos[u] = kRopeOn && token < n ? __ldg(p.positions + token) : 0;
  }
  for (int64_t base = warp; base < n; base += kSteps * warps) {
    MlaIn in[kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {  // every load of the round first
      const int64_t token = base + u * warps;
      if (token < n) {
        LoadMla<kNorm, kRope>(kv, token, pos[u], slots, p, lane, in[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int64_t next = base + (kSteps + u) * warps;
      pos[u] = kRopeOn && next < n ? __ldg(p.positions + next) : 0;
    }
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int64_t token = base + u * warps;
      if (token >= n) break;  // warp-uniform
      uint16_t* cast_row =
          cast_back == nullptr ? nullptr : cast_back + token * kDsMlaElems;
      ProcessMla<kNorm, kRope>(layout.block_stride, div, layer, p, in[u], w0,
                               w1, lane, cast_row);
    }
  }
}

// ---- From kFusedMlaBulkMinTokens tokens: the bulk pipeline ----
//
// ds_mla_bulk.cuh's CTAs of 16 warps over tiles of 16 consecutive tokens,
// whose rows arrive in shared memory by one bulk copy two tiles ahead; warp
// w encodes token 16 tile + w from there with ProcessMla into a shared
// record, written to the slot by one bulk store (the same bytes). The
// cos/sin values are loaded one tile ahead of their use, from a
// position loaded two tiles ahead. cast_back rows (every token, -1 slots
// included) are written from registers.
template <bool kNorm, RopeStyle kRope>
__global__ void __launch_bounds__(kDsMlaBulkThreads, 2)
    FusedMlaBulkKernel(int64_t block_stride, FastDiv div, uint8_t* layer,
                       const uint16_t* kv,  // [n][576] BF16
                       FusedParams p,
                       const int32_t* slots,  // [n]; -1 = skip (cast_back kept)
                       int64_t n,
                       uint16_t* cast_back) {  // [n][576] BF16 or null
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  uint4 w0 = make_uint4(0, 0, 0, 0), w1 = w0;  // loaded by prime (PDL)
  const int64_t grid_tokens = int64_t{gridDim.x} * kDsMlaBulkTile;
  // This warp's token of a tile and its position (0 past n or without
  // RoPE).
  const auto token_of = [&](int64_t tile) {
    return tile * kDsMlaBulkTile + warp;
  };
  const auto position = [&](int64_t token) -> int64_t {
    return kRope != RopeStyle::kNone && token < n ? __ldg(p.positions + token)
                                                  : 0;
  };
  MlaIn cur, next;       // cos/sin of this tile's token and of the next tile's
  int64_t pos_next = 0;  // of the next tile's token
  const auto prime = [&](int64_t tile) {  // after the pipeline's PdlWait
    LoadNormWeights<kNorm>(p, lane, w0, w1);
    LoadCosSin<kRope>(p, position(token_of(tile)), lane, next);
    pos_next = position(token_of(tile) + grid_tokens);
  };
  const auto ahead = [&](int64_t tile) {
    cur.c = next.c, cur.s = next.s;
    LoadCosSin<kRope>(p, pos_next, lane, next);
    pos_next = position(token_of(tile) + 2 * grid_tokens);
  };
  DsMlaBulkPipeline</*kEveryToken=*/true>(
      block_stride, div, layer, kv, slots, n,
      [&](const uint8_t* row, uint8_t* rec, int lane, int64_t token,
          int32_t slot) {
        MlaIn in = cur;
        in.a = *reinterpret_cast<const uint4*>(row + 16 * lane);
        in.b = *reinterpret_cast<const uint4*>(row + 512 + 16 * lane);
        in.tail =
            *reinterpret_cast<const uint32_t*>(row + 2 * kNormEnd + 4 * lane);
        in.slot = slot >= 0 ? 0 : -1;  // rec: slot 0 of a one-record layer
        uint16_t* cast_row =
            cast_back == nullptr ? nullptr : cast_back + token * kDsMlaElems;
        ProcessMla<kNorm, kRope>(0, div, rec, p, in, w0, w1, lane, cast_row);
      },
      prime, ahead);
}

// Whether the bulk kernel keeps up with this device's memory
// (fused_internal.h). Asked once per process (devices of one process are
// assumed alike, as ResidentCtas does; a wrong guess changes the speed,
// never the bytes).
bool BulkKeepsUp() {
  static const bool keeps = [] {
    int device = 0, sms = 0, khz = 0, bits = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, device) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth,
                               device) != cudaSuccess ||
        sms <= 0 || khz <= 0 || bits <= 0) {
      cudaGetLastError();  // clear; the warp kernels fit every device
      return false;
    }
    // Double data rate: two transfers per clock.
    const double bytes_per_second = 2.0 * khz * 1e3 * (bits / 8.0);
    return bytes_per_second / sms <= kFusedMlaBulkMaxBytesPerSmSecond;
  }();
  return keeps;
}

template <bool kNorm, RopeStyle kRope>
cudaError_t GoBulk(const PoolLayout& layout, uint8_t* layer, const uint16_t* kv,
                   const FusedParams& p, const int32_t* slots, int64_t n,
                   uint16_t* cast_back, const Launch& launch) {
  constexpr auto kKernel = FusedMlaBulkKernel<kNorm, kRope>;
  const int resident =
      ResidentCtasSmem<kKernel, kDsMlaBulkThreads, kDsMlaBulkSmem>();
  if (resident == 0) return cudaErrorNotSupported;
  const FastDiv div = FastDiv::Of(static_cast<int32_t>(layout.block_size));
  const dim3 grid(PersistentGrid(n, kDsMlaBulkTile, resident));
  return LaunchKernelSmem(kKernel, grid, dim3(kDsMlaBulkThreads),
                          kDsMlaBulkSmem, launch, layout.block_stride, div,
                          layer, kv, p, slots, n, cast_back);
}

template <bool kNorm, RopeStyle kRope>
cudaError_t Go(const PoolLayout& layout, uint8_t* layer, const uint16_t* kv,
               const FusedParams& p, const int32_t* slots, int64_t n,
               uint16_t* cast_back, const Launch& launch, FusedMlaPath path) {
  if constexpr (kRope != RopeStyle::kNeox) {  // NeoX's cos/sin would spill
    const bool can = reinterpret_cast<uintptr_t>(layer) % 16 == 0 &&
                     layout.block_stride % 16 == 0;
    if (path == FusedMlaPath::kBulk && !can) return cudaErrorNotSupported;
    if (path == FusedMlaPath::kBulk ||
        (path == FusedMlaPath::kAuto && can && n >= kFusedMlaBulkMinTokens &&
         BulkKeepsUp())) {
      return GoBulk<kNorm, kRope>(layout, layer, kv, p, slots, n, cast_back,
                                  launch);
    }
  } else if (path == FusedMlaPath::kBulk) {
    return cudaErrorNotSupported;
  }
  const FastDiv div = FastDiv::Of(static_cast<int32_t>(layout.block_size));
  const bool ahead = kRope != RopeStyle::kNeox && n >= kFusedMlaAheadMinTokens;
  const bool more_registers =
      cast_back != nullptr || n >= kFusedMlaAhead5MinTokens;
  if (path == FusedMlaPath::kAhead5 ||
      (path == FusedMlaPath::kAuto && ahead && more_registers)) {
    constexpr auto kKernel = FusedMlaAheadKernel<kNorm, kRope, 5>;
    const dim3 grid(
        PersistentGrid(n, kWarpsPerCta, ResidentCtas<kKernel, kThreads>()));
    return LaunchKernel(kKernel, grid, dim3(kThreads), launch, layout, div,
                        layer, kv, p, slots, n, cast_back);
  }
  if (path == FusedMlaPath::kAhead || (path == FusedMlaPath::kAuto && ahead)) {
    constexpr auto kKernel = FusedMlaAheadKernel<kNorm, kRope, 7>;
    const dim3 grid(
        PersistentGrid(n, kWarpsPerCta, ResidentCtas<kKernel, kThreads>()));
    return LaunchKernel(kKernel, grid, dim3(kThreads), launch, layout, div,
                        layer, kv, p, slots, n, cast_back);
  }
  constexpr auto kKernel = FusedMlaKernel<kNorm, kRope>;
  const dim3 grid(
      PersistentGrid(n, kWarpsPerCta, ResidentCtas<kKernel, kThreads>()));
  return LaunchKernel(kKernel, grid, dim3(kThreads), launch, layout, div, layer,
                      kv, p, slots, n, cast_back);
}

template <bool kNorm>
cudaError_t ByRope(const PoolLayout& layout, uint8_t* layer, const uint16_t* kv,
                   const FusedParams& p, const int32_t* slots, int64_t n,
                   uint16_t* cast_back, const Launch& launch,
                   FusedMlaPath path) {
  switch (p.rope) {
    case RopeStyle::kNone:
      return Go<kNorm, RopeStyle::kNone>(layout, layer, kv, p, slots, n,
                                         cast_back, launch, path);
    case RopeStyle::kInterleaved:
      return Go<kNorm, RopeStyle::kInterleaved>(layout, layer, kv, p, slots, n,
                                                cast_back, launch, path);
    case RopeStyle::kNeox:
      return Go<kNorm, RopeStyle::kNeox>(layout, layer, kv, p, slots, n,
                                         cast_back, launch, path);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

bool FusedMlaApplies(const FusedParams& p) {
  return p.hadamard_len == 0 &&
         (!p.norm() || (p.norm_begin == 0 && p.norm_end == kNormEnd)) &&
         (p.rope == RopeStyle::kNone ||
          (p.rope_offset == kNormEnd && p.rope_dim == kRopeDim));
}

cudaError_t LaunchFusedMla(const PoolLayout& layout, uint8_t* layer,
                           const uint16_t* kv, const FusedParams& p,
                           const int32_t* slots, int64_t n, uint16_t* cast_back,
                           const Launch& launch, FusedMlaPath path) {
  if (!FusedMlaApplies(p)) return cudaErrorInvalidValue;
  return p.norm() ? ByRope<true>(layout, layer, kv, p, slots, n, cast_back,
                                 launch, path)
                  : ByRope<false>(layout, layer, kv, p, slots, n, cast_back,
                                  launch, path);
}

}  // namespace kvdepot::gpu::internal
