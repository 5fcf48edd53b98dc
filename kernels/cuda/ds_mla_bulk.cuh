// The DS_MLA_FP8 bulk store's pipeline (SPEC §2.1; ds_mla.cu), shared with
// its no-math ceiling (bench_ceiling.cu) so that both issue the same
// copies: persistent CTAs of kDsMlaBulkTile warps over tiles of that many
// consecutive tokens, whose input rows (contiguous) arrive in shared memory
// by one bulk copy kDsMlaBulkStages tiles ahead; warp w encodes token
// tile * kDsMlaBulkTile + w into a record in shared memory, which its lane
// 0 writes to the slot with one 656-byte bulk store.
#ifndef KVDEPOT_KERNELS_CUDA_DS_MLA_BULK_CUH_
#define KVDEPOT_KERNELS_CUDA_DS_MLA_BULK_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_bulk.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/ds_mla.cuh"

namespace kvdepot::gpu::internal {

inline constexpr int kDsMlaBulkTile = 16;   // warps (tokens) per CTA, tile
inline constexpr int kDsMlaBulkStages = 2;  // tiles in flight per CTA
inline constexpr int kDsMlaBulkThreads = kDsMlaBulkTile * kWarp;
inline constexpr int kDsMlaRowBytes = kDsMlaElems * 2;
// Dynamic shared memory: rows [stages][tile][1152 B], then records
// [stages][tile][656 B] (57 KB: above the default 48 KB, ResidentCtasSmem).
inline constexpr int kDsMlaBulkSmem =
    kDsMlaBulkStages * kDsMlaBulkTile * (kDsMlaRowBytes + kDsMlaRecord);
static_assert(kDsMlaRowBytes % 16 == 0 && kDsMlaRecord % 16 == 0);

// Called once per tile and warp, before the tile is encoded; the default
// does nothing. A kernel that needs per-token data besides the row (the
// fused store's cos/sin values) loads it here one tile ahead.
struct DsMlaBulkNoAhead {
  __device__ void operator()(int64_t /*tile*/) const {}
};

// The whole kernel body; launch with kDsMlaBulkThreads threads and
// kDsMlaBulkSmem bytes of dynamic shared memory. encode(row, rec, lane,
// token, slot) is called by every lane of a warp whose token has a slot
// >= 0 (with kEveryToken: of every warp whose token is < n, slot -1
// included; its record is not stored): row, the token's 1152 input bytes,
// and rec, its 656-byte record to fill, both in shared memory. ahead(tile)
// is called by every lane at the top of each of its CTA's tiles (before
// the rows' barrier wait), prime(tile) once before the first (both after
// the kernel's PDL wait: they may read what earlier kernels wrote). One bulk
// group per warp and tile (empty for a -1 slot or past n), so a stage's
// record is rewritten only after the store issued from it kDsMlaBulkStages
// tiles earlier has read it. REQUIRES: layer, kv 16-byte aligned;
// block_stride % 16 == 0.
template <bool kEveryToken, typename Encode, typename Prime, typename Ahead>
__device__ __forceinline__ void DsMlaBulkPipeline(
    int64_t block_stride, const FastDiv& div, uint8_t* layer,
    const uint16_t* kv, const int32_t* slots, int64_t n, const Encode& encode,
    const Prime& prime, const Ahead& ahead) {
  constexpr int kTile = kDsMlaBulkTile, kStages = kDsMlaBulkStages;
  extern __shared__ __align__(128) uint8_t bulk_smem[];
  __shared__ __align__(8) uint64_t bars[kStages];
  uint8_t* const rows = bulk_smem;
  uint8_t* const recs = bulk_smem + kStages * kTile * kDsMlaRowBytes;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t tiles = (n + kTile - 1) / kTile;
  const auto fetch = [&](int64_t tile, int stage) {
    const int64_t first = tile * kTile;
    const int64_t count = n - first < kTile ? n - first : kTile;
    BulkLoad(rows + stage * kTile * kDsMlaRowBytes, kv + first * kDsMlaElems,
             static_cast<uint32_t>(count * kDsMlaRowBytes), &bars[stage]);
  };
  const auto slot_of = [&](int64_t tile) -> int32_t {
    const int64_t token = tile * kTile + warp;
    return token < n ? __ldg(slots + token) : -1;
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) BarrierInit(&bars[s]);
  }
  __syncthreads();
  PdlWait();
  PdlLaunchDependents();
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      const int64_t tile = blockIdx.x + int64_t{s} * gridDim.x;
      if (tile < tiles) fetch(tile, s);
    }
  }
  int32_t slot = slot_of(blockIdx.x);
  prime(static_cast<int64_t>(blockIdx.x));
  int it = 0;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x, ++it) {
    ahead(tile);
    const int32_t next_slot = slot_of(tile + gridDim.x);  // one tile ahead
    const int stage = it % kStages;
    BarrierWait(&bars[stage], (it / kStages) & 1);
    uint8_t* const rec = recs + (stage * kTile + warp) * kDsMlaRecord;
    if (lane == 0) BulkStoresRead<kStages - 1>();
    __syncwarp();
    const int64_t token = tile * kTile + warp;
    if (kEveryToken ? token < n : slot >= 0) {
      encode(rows + (stage * kTile + warp) * kDsMlaRowBytes, rec, lane, token,
             slot);
    }
    FenceSharedForBulk();
    __syncwarp();
    if (lane == 0) {
      if (slot >= 0) {
        BulkStore(DsMlaRecordAt(layer, block_stride, div, slot), rec,
                  kDsMlaRecord);
      } else {
        BulkCommitEmpty();
      }
    }
    __syncthreads();  // every warp has read this stage's rows
    if (threadIdx.x == 0) {
      const int64_t next = tile + int64_t{kStages} * gridDim.x;
      if (next < tiles) fetch(next, stage);
    }
    slot = next_slot;
  }
  if (lane == 0) BulkStoresDone();
}

// The plain store's form: encode(row, rec, lane) for tokens with a slot.
template <typename Encode>
__device__ __forceinline__ void DsMlaBulkStore(
    int64_t block_stride, const FastDiv& div, uint8_t* layer,
    const uint16_t* kv, const int32_t* slots, int64_t n, const Encode& encode) {
  DsMlaBulkPipeline</*kEveryToken=*/false>(
      block_stride, div, layer, kv, slots, n,
      [&](const uint8_t* row, uint8_t* rec, int lane, int64_t, int32_t) {
        encode(row, rec, lane);
      },
      DsMlaBulkNoAhead(), DsMlaBulkNoAhead());
}

}  // namespace kvdepot::gpu::internal

#endif  // KVDEPOT_KERNELS_CUDA_DS_MLA_BULK_CUH_
