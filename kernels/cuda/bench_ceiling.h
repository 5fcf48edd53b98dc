// Benchmark-only "ceiling" kernels: the DS_MLA_FP8 stores' and load's
// memory traffic with no math. Each issues exactly the loads and stores of
// its kernel (ds_mla.cu's warp store and load: one warp per token, the same
// lane layout, tokens in flight and grid; its bulk store: the same tiles,
// stages and bulk copies) and replaces the quantization by bit mixing, so
// the bytes it writes are meaningless. The fraction of copy they
// reach is what the memory system gives that access pattern; the real
// kernels are measured against it (cuda_benchmark's *_ceiling rows).
#ifndef KVDEPOT_KERNELS_CUDA_BENCH_CEILING_H_
#define KVDEPOT_KERNELS_CUDA_BENCH_CEILING_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/format.h"

namespace kvdepot::gpu::ceiling {

// kv [n][576] BF16, slots [n] (-1 skipped; null: token t to slot t, every
// record written in order) into a DS_MLA_FP8 layer.
cudaError_t DsMlaStoreTraffic(const PoolLayout& layout, uint8_t* layer,
                              const uint16_t* kv, const int32_t* slots,
                              int64_t n, cudaStream_t stream);
// The store's bytes as contiguous copies (kv rows in order into n records
// from layer's start: no slots, no blocks); and the bulk store's traffic
// (ds_mla.cu: CTAs of 16 warps, rows fetched by bulk copies two tiles
// ahead, one bulk store per record).
cudaError_t DsMlaStoreTrafficFlat(uint8_t* layer, const uint16_t* kv, int64_t n,
                                  cudaStream_t stream);
cudaError_t DsMlaStoreTrafficBulk(const PoolLayout& layout, uint8_t* layer,
                                  const uint16_t* kv, const int32_t* slots,
                                  int64_t n, cudaStream_t stream);
// segments [S][4] of a DS_MLA_FP8 layer into out [total_k][576] BF16.
cudaError_t DsMlaLoadTraffic(const PoolLayout& layout, const uint8_t* layer,
                             const int32_t* segments, int64_t num_segments,
                             uint16_t* out, cudaStream_t stream);

// The same load traffic from a persistent grid (warps over flat (segment,
// token) items, two in flight), and as plain contiguous copies per segment
// (records in, rows out, 16-byte words: no per-token layout at all).
cudaError_t DsMlaLoadTrafficPersistent(const PoolLayout& layout,
                                       const uint8_t* layer,
                                       const int32_t* segments,
                                       int64_t num_segments, uint16_t* out,
                                       cudaStream_t stream);
cudaError_t DsMlaLoadTrafficFlat(const PoolLayout& layout, const uint8_t* layer,
                                 const int32_t* segments, int64_t num_segments,
                                 uint16_t* out, cudaStream_t stream);

// How a benchmark empties L2 before a timed launch, with a buffer larger
// than L2 (`bytes`, a multiple of 16). kWrite rewrites it (cudaMemset, the
// benchmarks' default): L2 is left full of dirty lines, and the timed
// kernel pays their write-back as it evicts them (about L2's size in extra
// DRAM writes: a large share of a 64K-token launch, little of a 1 GiB
// copy). kRead reads it: L2 is left full of clean lines, dropped for free,
// so a kernel pays only for its own traffic (its own dirty lines are
// written back during the next flush, which the timing counts). `salt`
// varies the bytes written (kWrite) and is never matched (kRead).
enum class L2Flush { kWrite, kRead };
cudaError_t FlushL2(L2Flush mode, void* buffer, int64_t bytes, int salt,
                    cudaStream_t stream);
// "write" / "read" -> mode; false for anything else.
bool ParseL2Flush(const char* name, L2Flush* mode);
const char* L2FlushName(L2Flush mode);

// One warp that does nothing: the launch floor of a graph of back-to-back
// launches (fused_benchmark's latency table).
cudaError_t EmptyKernel(cudaStream_t stream);

// One warp running 4096 independent fp32 fmas (8 chains of 512) whose code
// is either straight (unrolled: 64 KB of instructions, each fetched once)
// or a loop of 8 (the same work from a few hundred bytes of code): the
// difference is what fetching a large kernel's code costs one warp.
cudaError_t CodeFetchKernel(bool unrolled, float* out, cudaStream_t stream);

}  // namespace kvdepot::gpu::ceiling

#endif  // KVDEPOT_KERNELS_CUDA_BENCH_CEILING_H_
