// The fused store (SPEC §8) for the 128-element index formats (FP4_INDEX,
// FP8_FP32SF_INDEX, MXFP8_INDEX) without RoPE, with a Hadamard over the
// whole token or none, above 23K tokens: one or two lanes per token, the
// token's values in registers. fused.cu's four-tokens-per-warp kernel
// (eight lanes per token), which keeps the smaller batches, wraps the same
// arithmetic in shuffles (48 per four tokens for the Hadamard alone),
// shared-memory round trips and per-lane bookkeeping; here almost all of
// that goes. One lane per token: every step in the thread, no shuffle.
// Two lanes (lanes j and j + 16, 64 values each): the norm's tree joins the
// halves' slots once, the Hadamard's last stage (h = 64) pairs the lanes,
// and a group of 128 joins its amax; the thread's chain is half as long
// and its registers fit 16 warps per SM instead of 12. Two lanes win up to
// 256K tokens, and at every size for FP8_FP32SF_INDEX, whose one group of
// 128 per token is one long block in a single thread; one lane wins at 1M
// for the groups of 32 (docs/BENCHMARKS.md, 2026-12-03 ~16:00). The
// thresholds and their figures: fused_internal.h.
//
// Per warp, 32 (or 16) consecutive tokens arrive in shared memory by
// cp.async, 16 bytes per lane and 512 contiguous bytes per instruction, the
// next tile's fetch in flight while this one is processed. Each lane then
// reads its part of its token's row (the 16-byte pad per row makes the 8
// lanes of a quarter-warp hit 8 different bank groups), computes steps 1-4
// in registers with the reference's operations and order, puts the BF16
// values back into its part of the row, quantizes them from there one group
// at a time (a loop: straight-line code did not stay in the instruction
// cache) into record data bytes at the start of its part, and the warp
// writes the records out together (8 or 4 lanes per record, 16 bytes each);
// the scale word is written by the token's first lane, the cast_back row by
// each lane for its part.
//
// Bit-exactness with kernels/reference/fused.cc is fused.cu's: explicit
// round-to-nearest intrinsics, no contraction (-fmad=false too), the
// RMSNorm tree of SPEC §8 (for 128 elements: slot j is chunk j's sum,
// slots 16-31 are 0, then the pairwise steps 8 ... 1 in that order), the
// Hadamard stages h = 1, 2, ..., 64 each as (a + b, a - b), and the store
// kernels' quantization math (quant.h).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_quant.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/fused_internal.h"
#include "kernels/format.h"
#include "kernels/fused.h"
#include "kernels/named_formats.h"
#include "kernels/quant.h"

namespace kvdepot::gpu::internal {
namespace {

constexpr int kD = 128;              // elements per token
constexpr int kChunks = kD / 8;      // 16-byte chunks of a BF16 row
constexpr int kPitch = 2 * kD + 16;  // bytes per token row in shared memory

// The kernel's shape for kLanes lanes per token (1 or 2). Either way a CTA
// holds ~35 KB of shared memory (two tiles of rows per warp), so six
// 2-warp CTAs or four 4-warp CTAs fit an H100/H200 SM's 228 KB. One lane:
// 128 values per thread, at most 168 registers; two lanes: 64 values, at
// most 128 (at five CTAs, 96 registers, the Hadamard kernel spilled 8
// bytes and was no faster).
template <int kLanes>
struct Shape {
  static_assert(kLanes == 1 || kLanes == 2);
  static constexpr int kWarps = kLanes == 1 ? 2 : 4;  // per CTA
  static constexpr int kThreads = kWarps * kWarp;
  static constexpr int kMinCtas = kLanes == 1 ? 6 : 4;
  static constexpr int kTile = kWarp / kLanes;  // tokens per warp iteration
  static constexpr int kElems = kD / kLanes;    // elements per lane
  static constexpr int kLaneChunks = kChunks / kLanes;
};

template <int kTile>
struct WarpTiles {
  uint8_t rows[2][kTile * kPitch];  // one tile processed, the next arriving
  int64_t data_offset[kTile];       // each token's record offset, -1: none
};

__device__ __forceinline__ void CpAsync16(void* dst, const void* src) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src)
               : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Waits until at most one committed group (the newest) is still pending.
__device__ __forceinline__ void CpAsyncWaitAllButNewest() {
  asm volatile("cp.async.wait_group 1;" ::: "memory");
}

// Tokens [base, base + kTile) ∩ [0, n) into rows, one group: 16-byte unit
// u = 32 r + lane is chunk u % 16 of token u / 16.
template <int kTile>
__device__ __forceinline__ void FetchTile(const uint16_t* kv, int64_t base,
                                          int64_t n, int lane, uint8_t* rows) {
#pragma unroll
  for (int r = 0; r < kTile * kChunks / kWarp; ++r) {
    const int u = kWarp * r + lane;
    const int j = u / kChunks, c = u % kChunks;
    if (base + j < n) {
      CpAsync16(rows + j * kPitch + 16 * c, kv + (base + j) * kD + 8 * c);
    }
  }
  CpAsyncCommit();
}

// One step of SPEC §8's tree: slot[j] += slot[j + kH] for j < kH.
template <int kH, int kN>
__device__ __forceinline__ void TreeStep(float (&slot)[kN]) {
#pragma unroll
  for (int j = 0; j < kH; ++j) slot[j] = __fadd_rn(slot[j], slot[j + kH]);
}

// Step 1's scale r = 1 / sqrt(mean + eps) of the BF16 row in shared
// memory: SPEC §8's tree for a 128-element token. Slot c is chunk c's sum
// (slots 16-31 are 0). With two lanes per token each sums the chunks of
// its half, the step h = 8 adds the other half's slots (from the partner
// lane: a sum of two floats is the same in either order), and both lanes
// finish the tree. Read from the row, not from the token's registers, so
// that the division and square root (whose slow paths are calls) run with
// few live registers: with all 128 values live across them the one-lane
// kernel spilled.
template <int kLanes>
__device__ __forceinline__ float NormScale(const FusedParams& p,
                                           const uint8_t* row, int half) {
  constexpr int kN = Shape<kLanes>::kLaneChunks;
  const int c0 = p.norm_begin / 8, c1 = p.norm_end / 8;
  float slot[kN];
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const int c = kN * half + k;
    float s = 0.0f;
    if (c >= c0 && c < c1) {
      const uint4 w4 = *reinterpret_cast<const uint4*>(row + 16 * c);
      const uint32_t w[4] = {w4.x, w4.y, w4.z, w4.w};
      float sq = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float a = BitsToFloat(w[i] << 16);
        const float b = BitsToFloat(w[i] & 0xFFFF0000u);
        sq = i == 0 ? __fmul_rn(a, a) : __fadd_rn(sq, __fmul_rn(a, a));
        sq = __fadd_rn(sq, __fmul_rn(b, b));
      }
      s = __fadd_rn(s, sq);
    }
    slot[k] = __fadd_rn(s, 0.0f);  // step h = 16: slots 16-31 are 0
  }
  // h = 8, 4, 2, 1 written out: a loop over h kept the array in local
  // memory (it was not unrolled).
  if constexpr (kLanes == 1) {
    TreeStep<8>(slot);
  } else {
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      slot[k] = __fadd_rn(slot[k], __shfl_xor_sync(0xFFFFFFFFu, slot[k], 16));
    }
  }
  TreeStep<4>(slot);
  TreeStep<2>(slot);
  TreeStep<1>(slot);
  const float mean =
      __fdiv_rn(slot[0], static_cast<float>(p.norm_end - p.norm_begin));
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, p.eps)));
}

// Chunk c of the BF16 row (elements [8c, 8c + 8)) as fp32, with step 1's
// products y = (x r) w if the chunk is in the norm range. weights: BF16
// [128], each element's norm weight (0 outside the range).
__device__ __forceinline__ void LoadChunk(const FusedParams& p,
                                          const uint16_t* weights, float r,
                                          const uint8_t* row, int c,
                                          float (&x)[8]) {
  const uint4 x4 = *reinterpret_cast<const uint4*>(row + 16 * c);
  const uint32_t xw[4] = {x4.x, x4.y, x4.z, x4.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = BitsToFloat(xw[i] << 16);
    x[2 * i + 1] = BitsToFloat(xw[i] & 0xFFFF0000u);
  }
  if (!p.norm() || c < p.norm_begin / 8 || c >= p.norm_end / 8) return;
  const uint4 w4 = *reinterpret_cast<const uint4*>(weights + 8 * c);
  const uint32_t w[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = __fmul_rn(__fmul_rn(x[2 * i], r), BitsToFloat(w[i] << 16));
    x[2 * i + 1] =
        __fmul_rn(__fmul_rn(x[2 * i + 1], r), BitsToFloat(w[i] & 0xFFFF0000u));
  }
}

// Step 3 over the whole token, this lane's part of it in v: the stages
// within the part in registers (h = 1 ... 64, or ... 32 with two lanes),
// then with two lanes h = 64 with the partner (element i of the low half
// is a, of the high half b: the low lane keeps a + b, the high one
// b (-1) + a = a - b, one rounding each), then the scale.
template <int kLanes>
__device__ __forceinline__ void HadamardPart(float (&v)[Shape<kLanes>::kElems],
                                             int half) {
  constexpr int kN = Shape<kLanes>::kElems;
  RegisterButterflies<1, kN>(v);
  if constexpr (kLanes == 2) {
    const float sign = half == 0 ? 1.0f : -1.0f;
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      v[i] = __fmaf_rn(v[i], sign, __shfl_xor_sync(0xFFFFFFFFu, v[i], 16));
    }
  }
  const float scale = BitsToFloat(kHadamardScaleBits[7]);  // 128^(-1/2)
#pragma unroll
  for (int i = 0; i < kN; ++i) v[i] = __fmul_rn(v[i], scale);
}

// Steps 5-6 for this lane's part of the token whose BF16 values (step 4's
// rounding) are in `row` (shared memory, element 2i in the low half of
// word i): the part's record data bytes go back to the start of its own
// part of the row (with two lanes the low lane's first, then the high
// lane's: together the record), cast_back's row (if any) to global memory;
// returns the token's scale word (one per token in these formats: four
// UE8M0 bytes, group g in byte g, or one fp32) in every lane of the token.
// With two lanes a group of 128 spans both halves: its amax is joined with
// the partner's (a maximum is exact in any order). The loop over groups is not
// unrolled: straight-line code did not stay in the instruction cache (ncu,
// docs/BENCHMARKS.md, 2026-12-03 ~13:32), and the values come from shared
// memory, so nothing is indexed by the loop counter in registers. Group g's
// data bytes land on bytes that groups up to g have already read.
template <class Q, int kLanes>
__device__ __forceinline__ uint32_t QuantizePart(uint8_t* row, int half,
                                                 uint16_t* cast_row) {
  constexpr int kGroup = Q::kGroup;  // 32 or 128
  constexpr int kN = Shape<kLanes>::kElems;
  static_assert(Q::kElems == kD && Q::kScaleWords == 1 && kD % kGroup == 0);
  constexpr int kSpan = kGroup < kN ? kGroup : kN;  // elements per step
  constexpr int kWords = kSpan / 2;
  uint8_t* mine = row + 2 * kN * half;
  uint32_t word = 0;
#pragma unroll 1
  for (int g = 0; g < kN / kSpan; ++g) {
    uint32_t bf[kWords];
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) {
      const uint4 w4 =
          *reinterpret_cast<const uint4*>(mine + 2 * kSpan * g + 16 * i);
      bf[4 * i] = w4.x;
      bf[4 * i + 1] = w4.y;
      bf[4 * i + 2] = w4.z;
      bf[4 * i + 3] = w4.w;
    }
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      amax = fmaxf(amax, fabsf(BitsToFloat(bf[i] << 16)));  // NaN ignored
      amax = fmaxf(amax, fabsf(BitsToFloat(bf[i] & 0xFFFF0000u)));
    }
    if constexpr (kGroup > kN) {
      amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 16));
    }
    const GroupScale scale = ScaleOf<Q>(amax);
    if constexpr (Q::kSf == ScaleFormat::kFP32) {
      word = scale.stored;
    } else {
      word |= (scale.stored & 0xFFu) << (8 * ((kN / kSpan) * half + g));
    }
#pragma unroll
    for (int h = 0; h < kSpan / 16; ++h) {
      const int piece = g * (kSpan / 16) + h;  // of this half
      float x[16];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        x[2 * i] = BitsToFloat(bf[8 * h + i] << 16);
        x[2 * i + 1] = BitsToFloat(bf[8 * h + i] & 0xFFFF0000u);
      }
      const uint4 q = Encode16<Q, true>(x, scale.multiplier);
      if constexpr (Q::kDataBytesPerLane == 16) {
        *reinterpret_cast<uint4*>(mine + 16 * piece) = q;
      } else {
        *reinterpret_cast<uint2*>(mine + 8 * piece) = make_uint2(q.x, q.y);
      }
      if (cast_row != nullptr) {
        CastBack16<Q>(q, scale.stored, cast_row + kN * half + 16 * piece);
      }
    }
  }
  if constexpr (kLanes == 2 && Q::kSf != ScaleFormat::kFP32) {
    word |= __shfl_xor_sync(0xFFFFFFFFu, word, 16);  // the other half's bytes
  }
  return word;
}

// Steps 1-6 of this lane's part of the token (active: < n) whose BF16 row
// is `row` (shared memory; step 4's values replace it, then each part's
// first bytes receive its record data). Returns, in the token's first
// lane, the record's byte offset in the layer, -1 if nothing is stored
// (and -1 in the other lane). cast_row: null for an inactive token.
template <class Q, int kHad, int kLanes>
__device__ __forceinline__ int64_t
ProcessPart(const PoolLayout& layout, const FastDiv& div, uint8_t* layer,
            const FusedParams& p, const uint16_t* weights, uint8_t* row,
            int half, int32_t slot, bool active, uint16_t* cast_row) {
  using S = Shape<kLanes>;
  const float r = p.norm() ? NormScale<kLanes>(p, row, half) : 0.0f;
  // Step 4 by the hardware (RNE): a NaN stays a NaN, which the
  // quantization ignores in amax and encodes alike whatever its bits.
  if constexpr (kHad == kD) {
    float v[S::kElems];
#pragma unroll
    for (int k = 0; k < S::kLaneChunks; ++k) {
      float x[8];
      LoadChunk(p, weights, r, row, S::kLaneChunks * half + k, x);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[8 * k + i] = x[i];
    }
    HadamardPart<kLanes>(v, half);
#pragma unroll
    for (int k = 0; k < S::kLaneChunks; ++k) {
      *reinterpret_cast<uint4*>(row + 16 * (S::kLaneChunks * half + k)) =
          make_uint4(HwBf16x2(v[8 * k], v[8 * k + 1]),
                     HwBf16x2(v[8 * k + 2], v[8 * k + 3]),
                     HwBf16x2(v[8 * k + 4], v[8 * k + 5]),
                     HwBf16x2(v[8 * k + 6], v[8 * k + 7]));
    }
  } else if (p.norm()) {  // each element on its own: one chunk at a time
#pragma unroll 1
    for (int k = 0; k < S::kLaneChunks; ++k) {
      const int c = S::kLaneChunks * half + k;
      float x[8];
      LoadChunk(p, weights, r, row, c, x);
      *reinterpret_cast<uint4*>(row + 16 * c) =
          make_uint4(HwBf16x2(x[0], x[1]), HwBf16x2(x[2], x[3]),
                     HwBf16x2(x[4], x[5]), HwBf16x2(x[6], x[7]));
    }
  }  // else the row holds step 4's values already (BF16 in, nothing done;
     // a NaN keeps its sign and payload, which the quantization ignores)
  const uint32_t word = QuantizePart<Q, kLanes>(row, half, cast_row);
  if (!active || slot < 0 || half != 0) return -1;
  const int32_t block = div.Div(slot);
  const int32_t t = slot - block * div.d;
  StoreStream4(layer + ScaleOffset<Q>(layout, block, t), word);
  return DataOffset<Q>(layout, block, t);
}

template <class Q, int kHad, int kLanes>
__global__ void __launch_bounds__(Shape<kLanes>::kThreads,
                                  Shape<kLanes>::kMinCtas)
    FusedStoreKernelRow(PoolLayout layout, FastDiv div, uint8_t* layer,
                        const uint16_t* kv, FusedParams p, const int32_t* slots,
                        int64_t n, uint16_t* cast_back) {
  using S = Shape<kLanes>;
  constexpr int kTile = S::kTile, kWarps = S::kWarps;
  __shared__ __align__(16) WarpTiles<kTile> tiles[kWarps];
  __shared__ __align__(16) uint16_t weights[kD];  // 0 outside the range
  PdlWait();
  PdlLaunchDependents();
  if (p.norm()) {
    for (int e = threadIdx.x; e < kD; e += S::kThreads) {
      weights[e] = e >= p.norm_begin && e < p.norm_end
                       ? __ldg(p.norm_weight + (e - p.norm_begin))
                       : uint16_t{0};
    }
  }
  __syncthreads();  // the only CTA-wide barrier
  const int lane = threadIdx.x % kWarp;
  // Token j of the tile; with two lanes, in lanes j and j + 16: the 8 lanes
  // of a quarter-warp read 8 different rows (no bank conflicts).
  const int j = lane % kTile, half = lane / kTile;
  WarpTiles<kTile>& w = tiles[threadIdx.x / kWarp];
  const int64_t step = int64_t{kTile} * gridDim.x * kWarps;
  int64_t base =
      kTile * (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp);
  if (base >= n) return;  // warp-uniform
  FetchTile<kTile>(kv, base, n, lane, w.rows[0]);
  int32_t slot = base + j < n ? __ldg(slots + base + j) : -1;
  constexpr int kPieces = Q::kDataBytes / 16;  // 16-byte pieces per record
  constexpr int kPerPass = kWarp / kPieces;    // records per store pass
  for (int buf = 0; base < n; base += step, buf ^= 1) {
    const int64_t next = base + step;
    int32_t next_slot = -1;
    if (next < n) {  // warp-uniform
      FetchTile<kTile>(kv, next, n, lane, w.rows[buf ^ 1]);
      if (next + j < n) next_slot = __ldg(slots + next + j);
    } else {
      CpAsyncCommit();  // an empty group, so the wait below is the same
    }
    CpAsyncWaitAllButNewest();
    __syncwarp();  // every lane's copies of this tile have landed
    const int64_t token = base + j;
    const bool active = token < n;
    uint8_t* rows = w.rows[buf];
    uint16_t* cast_row =
        cast_back != nullptr && active ? cast_back + token * kD : nullptr;
    const int64_t offset = ProcessPart<Q, kHad, kLanes>(
        layout, div, layer, p, weights, rows + j * kPitch, half, slot, active,
        cast_row);
    if (half == 0) w.data_offset[j] = offset;
    __syncwarp();  // the records and offsets are in shared memory
#pragma unroll
    for (int r = 0; r < kTile / kPerPass; ++r) {
      const int t = kPerPass * r + lane / kPieces, c = lane % kPieces;
      const int64_t out = w.data_offset[t];
      // Piece c of the record: in its lane's part of the row.
      constexpr int kPartPieces = kPieces / kLanes;
      const int from =
          2 * S::kElems * (c / kPartPieces) + 16 * (c % kPartPieces);
      if (out >= 0) {
        StoreStream16(layer + out + 16 * c, *reinterpret_cast<const uint4*>(
                                                rows + t * kPitch + from));
      }
    }
    __syncwarp();  // rows[buf] is free for the fetch after next
    slot = next_slot;
  }
}

// Resident CTAs of a row kernel, with the shared-memory carveout at its
// maximum first (six 2-warp CTAs need ~213 KB of it). Once per process, on
// the device current then, as ResidentCtas assumes.
template <auto kKernel, int kThreads>
int RowResidentCtas() {
  static const int ctas = [] {
    cudaFuncSetAttribute(kKernel,
                         cudaFuncAttributePreferredSharedMemoryCarveout,
                         cudaSharedmemCarveoutMaxShared);
    cudaGetLastError();  // a refused preference changes only the speed
    return ResidentCtas<kKernel, kThreads>();
  }();
  return ctas;
}

template <class Q, int kHad, int kLanes>
cudaError_t Go(const PoolLayout& layout, uint8_t* layer, const uint16_t* kv,
               const FusedParams& p, const int32_t* slots, int64_t n,
               uint16_t* cast_back, const Launch& launch) {
  using S = Shape<kLanes>;
  constexpr auto kKernel = FusedStoreKernelRow<Q, kHad, kLanes>;
  const FastDiv div = FastDiv::Of(static_cast<int32_t>(layout.block_size));
  const dim3 grid(PersistentGrid(n, int64_t{S::kTile} * S::kWarps,
                                 RowResidentCtas<kKernel, S::kThreads>()));
  return LaunchKernel(kKernel, grid, dim3(S::kThreads), launch, layout, div,
                      layer, kv, p, slots, n, cast_back);
}

// Two lanes per token for FP8_FP32SF_INDEX (its one group of 128 per
// token) and up to kMaxPairTokens for the others; one lane above that.
template <class Q, int kHad>
cudaError_t ByLanes(const PoolLayout& layout, uint8_t* layer,
                    const uint16_t* kv, const FusedParams& p,
                    const int32_t* slots, int64_t n, uint16_t* cast_back,
                    const Launch& launch) {
  if constexpr (Q::kGroup == kD) {
    return Go<Q, kHad, 2>(layout, layer, kv, p, slots, n, cast_back, launch);
  } else {
    return n <= kMaxPairTokens ? Go<Q, kHad, 2>(layout, layer, kv, p, slots, n,
                                                cast_back, launch)
                               : Go<Q, kHad, 1>(layout, layer, kv, p, slots, n,
                                                cast_back, launch);
  }
}

template <class Q>
cudaError_t ByHadamard(const PoolLayout& layout, uint8_t* layer,
                       const uint16_t* kv, const FusedParams& p,
                       const int32_t* slots, int64_t n, uint16_t* cast_back,
                       const Launch& launch) {
  return p.hadamard()
             ? ByLanes<Q, kD>(layout, layer, kv, p, slots, n, cast_back, launch)
             : ByLanes<Q, 0>(layout, layer, kv, p, slots, n, cast_back, launch);
}

}  // namespace

bool FusedRowApplies(FormatId id, const FusedParams& p, int64_t n) {
  if (id != FormatId::kFp4Index && id != FormatId::kFp8Fp32SfIndex &&
      id != FormatId::kMxfp8Index) {
    return false;
  }
  if (n <= kMaxQuadTokens) return false;
  return p.rope == RopeStyle::kNone &&
         (!p.hadamard() || (p.hadamard_len == kD && p.hadamard_begin == 0));
}

cudaError_t LaunchFusedRow(FormatId id, const PoolLayout& layout,
                           uint8_t* layer, const uint16_t* kv,
                           const FusedParams& p, const int32_t* slots,
                           int64_t n, uint16_t* cast_back,
                           const Launch& launch) {
  if (!FusedRowApplies(id, p, n)) return cudaErrorInvalidValue;
  switch (id) {
    case FormatId::kFp4Index:
      return ByHadamard<Fp4IndexFormat>(layout, layer, kv, p, slots, n,
                                        cast_back, launch);
    case FormatId::kFp8Fp32SfIndex:
      return ByHadamard<Fp8Fp32SfFormat>(layout, layer, kv, p, slots, n,
                                         cast_back, launch);
    default:
      return ByHadamard<Mxfp8IndexFormat>(layout, layer, kv, p, slots, n,
                                          cast_back, launch);
  }
}

}  // namespace kvdepot::gpu::internal
