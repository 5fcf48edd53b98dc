// The fused store (SPEC §8) for the 128-element index formats (FP4_INDEX,
// FP8_FP32SF_INDEX, MXFP8_INDEX) without RoPE, with a Hadamard over the
// whole token or none, above 64K tokens: one thread per token, the whole
// token in 128 registers, so no step crosses lanes. fused.cu's
// four-tokens-per-warp kernel, which keeps the smaller batches, wraps the
// same arithmetic in shuffles (48 per four tokens for the Hadamard alone),
// shared-memory round trips and per-lane bookkeeping; here those go, and at
// 1M tokens the store runs at 73.6 % of copy instead of 56.8 %
// (docs/BENCHMARKS.md, 2026-12-03 ~12:10), and at 75.5-76.5 % since the
// quantization reads the row back from shared memory in a loop (~15:25).
//
// Per warp, 32 consecutive tokens (8 KB of BF16 input) arrive in shared
// memory by cp.async, 16 bytes per lane and 512 contiguous bytes per
// instruction, the next tile's fetch in flight while this one is
// processed. Each lane then reads its own token's row (the 16-byte pad per
// row makes the 8 lanes of a quarter-warp hit 8 different bank groups),
// computes steps 1-4 in registers with the reference's operations and
// order, puts the BF16 values back into its row, quantizes them from there
// one group at a time into the record's data bytes at the row's start, and
// the warp writes the records out together (8 or 4 lanes per record, 16 bytes
// each); the scale word and the cast_back row are written by the token's lane.
//
// Bit-exactness with kernels/reference/fused.cc is fused.cu's: explicit
// round-to-nearest intrinsics, no contraction (-fmad=false too), the
// RMSNorm tree of SPEC §8 (for 128 elements: slot j is chunk j's sum,
// slots 16-31 are 0, then the pairwise steps 8 ... 1, done here in one
// thread in that order), the Hadamard stages h = 1, 2, ..., 64 each as
// (a + b, a - b), and the store kernels' quantization math (quant.h).
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

constexpr int kD = 128;          // elements per token
constexpr int kChunks = kD / 8;  // 16-byte chunks of a BF16 row
constexpr int kWarps = 2;        // per CTA
constexpr int kThreads = kWarps * kWarp;
constexpr int kTile = kWarp;         // tokens per warp iteration
constexpr int kPitch = 2 * kD + 16;  // bytes per token row in shared memory
// ~35 KB of shared memory per CTA: six CTAs (12 warps, three per
// scheduler: at most 168 registers) fill an H100/H200 SM's 228 KB. The
// 128 values per thread fit in that. (While the quantization was unrolled,
// FP4_INDEX's e2m1 encoding spilled at six and ran at four.)
constexpr int kMinCtas = 6;

// Up to this many tokens fused.cu's four-tokens-per-warp kernel runs
// instead. A thread here works through its whole token alone, ~2 us of
// dependent instructions: at 1-1024 tokens (graph replay) this kernel
// took 3.8-4.5 us where that one takes 1.6-1.9, and at 64K tokens 43.5 %
// of copy against 44.6 %; at 1M 73.6 % against 56.8 % (H200,
// docs/BENCHMARKS.md, 2026-12-03 ~12:10). The two cross between 64K and
// 96K tokens (2026-12-03 ~13:32: 14.1 us at 65,537 tokens here against
// 13.6 at 65,536 there), so this threshold costs at most ~0.5 us.
constexpr int64_t kMaxQuadTokens = 65536;

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

// Tokens [base, base + 32) ∩ [0, n) into rows, one group: 16-byte unit
// u = 32 r + lane is chunk u % 16 of token u / 16.
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
template <int kH>
__device__ __forceinline__ void TreeStep(float (&slot)[16]) {
#pragma unroll
  for (int j = 0; j < kH; ++j) slot[j] = __fadd_rn(slot[j], slot[j + kH]);
}

// Step 1's scale r = 1 / sqrt(mean + eps) of the BF16 row in shared
// memory: SPEC §8's tree for a 128-element token. Read from the row, not
// from the token's registers, so that the division and square root (whose
// slow paths are calls) run with few live registers: with all 128 values
// live across them the kernel spilled.
__device__ __forceinline__ float NormScale(const FusedParams& p,
                                           const uint8_t* row) {
  const int c0 = p.norm_begin / 8, c1 = p.norm_end / 8;
  float slot[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
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
    slot[c] = __fadd_rn(s, 0.0f);  // step h = 16: slots 16-31 are 0
  }
  // h = 8, 4, 2, 1 written out: a loop over h kept the array in local
  // memory (it was not unrolled).
  TreeStep<8>(slot);
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

// Step 3 over the whole token: stages h = 1 ... 64, then the scale.
__device__ __forceinline__ void HadamardRow(float (&v)[kD]) {
  RegisterButterflies<1, kD>(v);
  const float scale = BitsToFloat(kHadamardScaleBits[7]);  // 128^(-1/2)
#pragma unroll
  for (int i = 0; i < kD; ++i) v[i] = __fmul_rn(v[i], scale);
}

// Steps 5-6 for the token whose BF16 values (step 4's rounding) are in
// `row` (shared memory, element 2i in the low half of word i): the
// record's data bytes go back into the same row from its start, cast_back's
// row (if any) to global memory; returns the token's scale word (one per
// token in these formats: four UE8M0 bytes, group g in byte g, or one
// fp32). The loop over groups is not unrolled: a token's whole work as
// straight-line code (~38 KB) did not stay in the instruction cache (ncu:
// a quarter of the time waiting for instruction fetch,
// docs/BENCHMARKS.md, 2026-12-03 ~13:32), and the values now come from
// shared memory, so nothing is indexed by the loop counter in registers.
// Group g's data bytes land on bytes every group up to g has already
// read, and depend on group g's own reads, so the row is never read after
// it is overwritten.
template <class Q>
__device__ __forceinline__ uint32_t QuantizeRow(uint8_t* row,
                                                uint16_t* cast_row) {
  constexpr int kGroup = Q::kGroup;  // 32 or 128
  constexpr int kWords = kGroup / 2;
  static_assert(Q::kElems == kD && Q::kScaleWords == 1 && kD % kGroup == 0);
  uint32_t word = 0;
#pragma unroll 1
  for (int g = 0; g < kD / kGroup; ++g) {
    uint32_t bf[kWords];
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) {
      const uint4 w4 =
          *reinterpret_cast<const uint4*>(row + 2 * kGroup * g + 16 * i);
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
    const GroupScale scale = ScaleOf<Q>(amax);
    if constexpr (Q::kSf == ScaleFormat::kFP32) {
      word = scale.stored;
    } else {
      word |= (scale.stored & 0xFFu) << (8 * g);
    }
#pragma unroll
    for (int h = 0; h < kGroup / 16; ++h) {
      const int piece = g * (kGroup / 16) + h;  // elements [16 piece, +16)
      float x[16];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        x[2 * i] = BitsToFloat(bf[8 * h + i] << 16);
        x[2 * i + 1] = BitsToFloat(bf[8 * h + i] & 0xFFFF0000u);
      }
      const uint4 q = Encode16<Q, true>(x, scale.multiplier);
      if constexpr (Q::kDataBytesPerLane == 16) {
        *reinterpret_cast<uint4*>(row + 16 * piece) = q;
      } else {
        *reinterpret_cast<uint2*>(row + 8 * piece) = make_uint2(q.x, q.y);
      }
      if (cast_row != nullptr) {
        CastBack16<Q>(q, scale.stored, cast_row + 16 * piece);
      }
    }
  }
  return word;
}

// Steps 1-6 of the lane's token (active: < n) whose BF16 row is `row`
// (shared memory; step 4's values replace it, then its first bytes
// receive the record's data). Returns the record's byte offset in the
// layer, -1 if nothing is stored. cast_row: null for an inactive token.
template <class Q, int kHad>
__device__ __forceinline__ int64_t
ProcessRow(const PoolLayout& layout, const FastDiv& div, uint8_t* layer,
           const FusedParams& p, const uint16_t* weights, uint8_t* row,
           int32_t slot, bool active, uint16_t* cast_row) {
  const float r = p.norm() ? NormScale(p, row) : 0.0f;
  // Step 4 by the hardware (RNE): a NaN stays a NaN, which the
  // quantization ignores in amax and encodes alike whatever its bits.
  if constexpr (kHad == kD) {
    float v[kD];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      float x[8];
      LoadChunk(p, weights, r, row, c, x);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[8 * c + i] = x[i];
    }
    HadamardRow(v);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      *reinterpret_cast<uint4*>(row + 16 * c) =
          make_uint4(HwBf16x2(v[8 * c], v[8 * c + 1]),
                     HwBf16x2(v[8 * c + 2], v[8 * c + 3]),
                     HwBf16x2(v[8 * c + 4], v[8 * c + 5]),
                     HwBf16x2(v[8 * c + 6], v[8 * c + 7]));
    }
  } else if (p.norm()) {  // each element on its own: one chunk at a time
#pragma unroll 1
    for (int c = 0; c < kChunks; ++c) {
      float x[8];
      LoadChunk(p, weights, r, row, c, x);
      *reinterpret_cast<uint4*>(row + 16 * c) =
          make_uint4(HwBf16x2(x[0], x[1]), HwBf16x2(x[2], x[3]),
                     HwBf16x2(x[4], x[5]), HwBf16x2(x[6], x[7]));
    }
  }  // else the row holds step 4's values already (BF16 in, nothing done;
     // a NaN keeps its sign and payload, which the quantization ignores)
  const uint32_t word = QuantizeRow<Q>(row, cast_row);
  if (!active || slot < 0) return -1;
  const int32_t block = div.Div(slot);
  const int32_t t = slot - block * div.d;
  StoreStream4(layer + ScaleOffset<Q>(layout, block, t), word);
  return DataOffset<Q>(layout, block, t);
}

template <class Q, int kHad>
__global__ void __launch_bounds__(kThreads, kMinCtas)
    FusedStoreKernelRow(PoolLayout layout, FastDiv div, uint8_t* layer,
                        const uint16_t* kv, FusedParams p, const int32_t* slots,
                        int64_t n, uint16_t* cast_back) {
  __shared__ __align__(16) WarpTiles tiles[kWarps];
  __shared__ __align__(16) uint16_t weights[kD];  // 0 outside the range
  PdlWait();
  PdlLaunchDependents();
  if (p.norm()) {
    for (int e = threadIdx.x; e < kD; e += kThreads) {
      weights[e] = e >= p.norm_begin && e < p.norm_end
                       ? __ldg(p.norm_weight + (e - p.norm_begin))
                       : uint16_t{0};
    }
  }
  __syncthreads();  // the only CTA-wide barrier
  const int lane = threadIdx.x % kWarp;
  WarpTiles& w = tiles[threadIdx.x / kWarp];
  const int64_t step = int64_t{kTile} * gridDim.x * kWarps;
  int64_t base =
      kTile * (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp);
  if (base >= n) return;  // warp-uniform
  FetchTile(kv, base, n, lane, w.rows[0]);
  int32_t slot = base + lane < n ? __ldg(slots + base + lane) : -1;
  constexpr int kPieces = Q::kDataBytes / 16;  // 16-byte pieces per record
  constexpr int kPerPass = kWarp / kPieces;    // records per store pass
  for (int buf = 0; base < n; base += step, buf ^= 1) {
    const int64_t next = base + step;
    int32_t next_slot = -1;
    if (next < n) {  // warp-uniform
      FetchTile(kv, next, n, lane, w.rows[buf ^ 1]);
      if (next + lane < n) next_slot = __ldg(slots + next + lane);
    } else {
      CpAsyncCommit();  // an empty group, so the wait below is the same
    }
    CpAsyncWaitAllButNewest();
    __syncwarp();  // every lane's copies of this tile have landed
    const int64_t token = base + lane;
    const bool active = token < n;
    uint8_t* rows = w.rows[buf];
    uint16_t* cast_row =
        cast_back != nullptr && active ? cast_back + token * kD : nullptr;
    w.data_offset[lane] =
        ProcessRow<Q, kHad>(layout, div, layer, p, weights,
                            rows + lane * kPitch, slot, active, cast_row);
    __syncwarp();  // the records and offsets are in shared memory
#pragma unroll
    for (int r = 0; r < kTile / kPerPass; ++r) {
      const int j = kPerPass * r + lane / kPieces, c = lane % kPieces;
      const int64_t offset = w.data_offset[j];
      if (offset >= 0) {
        StoreStream16(layer + offset + 16 * c, *reinterpret_cast<const uint4*>(
                                                   rows + j * kPitch + 16 * c));
      }
    }
    __syncwarp();  // rows[buf] is free for the fetch after next
    slot = next_slot;
  }
}

// Resident CTAs of a row kernel, with the shared-memory carveout at its
// maximum first (six CTAs need ~213 KB of it). Once per process, on the
// device current then, as ResidentCtas assumes.
template <auto kKernel>
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

template <class Q, int kHad>
cudaError_t Go(const PoolLayout& layout, uint8_t* layer, const uint16_t* kv,
               const FusedParams& p, const int32_t* slots, int64_t n,
               uint16_t* cast_back, const Launch& launch) {
  constexpr auto kKernel = FusedStoreKernelRow<Q, kHad>;
  const FastDiv div = FastDiv::Of(static_cast<int32_t>(layout.block_size));
  const dim3 grid(
      PersistentGrid(n, int64_t{kTile} * kWarps, RowResidentCtas<kKernel>()));
  return LaunchKernel(kKernel, grid, dim3(kThreads), launch, layout, div, layer,
                      kv, p, slots, n, cast_back);
}

template <class Q>
cudaError_t ByHadamard(const PoolLayout& layout, uint8_t* layer,
                       const uint16_t* kv, const FusedParams& p,
                       const int32_t* slots, int64_t n, uint16_t* cast_back,
                       const Launch& launch) {
  return p.hadamard()
             ? Go<Q, kD>(layout, layer, kv, p, slots, n, cast_back, launch)
             : Go<Q, 0>(layout, layer, kv, p, slots, n, cast_back, launch);
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
