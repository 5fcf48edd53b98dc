// The boundary between the host launchers (kernels.cc, plain C++ with absl)
// and the CUDA translation units (*.cu, compiled by nvcc without absl). The
// launchers validate and dispatch; the functions declared here only size the
// grid and launch, and return the launch's cudaError_t. The format's FormatId
// (named_formats.h), identified once per call on the host, picks the kernel.
#ifndef KVDEPOT_KERNELS_CUDA_LAUNCH_INTERNAL_H_
#define KVDEPOT_KERNELS_CUDA_LAUNCH_INTERNAL_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/format.h"
#include "kernels/named_formats.h"

namespace kvdepot::gpu::internal {

struct Launch {
  cudaStream_t stream = nullptr;
  bool pdl = false;  // Programmatic Dependent Launch attribute
};

// kv: [n][elements] BF16 bits (fp32_input false) or float; slots: [n],
// -1 = skip. REQUIRES: validated slots, n > 0, 16-byte aligned pointers.
cudaError_t LaunchStore(FormatId id, const PoolLayout& layout, uint8_t* layer,
                        const void* kv, bool fp32_input, const int32_t* slots,
                        int64_t n, bool hw_cvt, const Launch& launch);

// segments: [S][4] {src_block_id, src_begin, src_end, dst_offset}, -1 block =
// zero rows. data: [total_k][row bytes]; scales: [total_k] int32 (index
// formats only). REQUIRES: validated plan, S > 0, 16-byte aligned pointers.
cudaError_t LaunchLoad(FormatId id, const PoolLayout& layout,
                       const uint8_t* layer, const int32_t* segments,
                       int64_t num_segments, void* data, void* scales,
                       const Launch& launch);

// DS_MLA_FP8 (ds_mla.cu): kv [n][576] BF16; out [total_k][576] BF16. Same
// contracts as LaunchStore / LaunchLoad (16-byte aligned pointers). The
// store has two kernels with the same bytes: kAuto takes the bulk-copy one
// from kDsMlaBulkMinTokens tokens where it can run (16-byte aligned layer,
// block stride a multiple of 16), else the warp one; tests and benchmarks
// name one (kBulk where it cannot run: cudaErrorNotSupported, nothing
// launched).
enum class DsMlaStorePath { kAuto, kWarps, kBulk };
inline constexpr int64_t kDsMlaBulkMinTokens = int64_t{1} << 17;
cudaError_t LaunchDsMlaStore(const PoolLayout& layout, uint8_t* layer,
                             const uint16_t* kv, const int32_t* slots,
                             int64_t n, bool hw_cvt, const Launch& launch,
                             DsMlaStorePath path = DsMlaStorePath::kAuto);
cudaError_t LaunchDsMlaLoad(const PoolLayout& layout, const uint8_t* layer,
                            const int32_t* segments, int64_t num_segments,
                            uint16_t* out, const Launch& launch);

// An empty kernel (benchmarks measure launch overhead with it).
cudaError_t LaunchEmpty(const Launch& launch);

// The exhaustive conversion check of the tests: runs the fast device e4m3 /
// e2m1 encoders and quant.h's over all 2^32 fp32 bit patterns, and the
// division-free DS_MLA_FP8 scale exponent and UE8M0 group scales and
// quant.h's over every finite amax, and counts mismatches. mismatches: [4]
// device counters (e4m3, e2m1, DS_MLA scale, UE8M0 scale); first: [4] the
// smallest mismatching bit pattern of each (init 0xFFFFFFFF).
cudaError_t LaunchEncodeCheck(unsigned long long* mismatches, uint32_t* first,
                              const Launch& launch);

// Index operations (SPEC §7); shapes and semantics as in kernels.h.
cudaError_t LaunchConvertTopk(
    int32_t* topk, int64_t num_seqs, int32_t k, const int32_t* valid_count,
    const int32_t* num_tokens, const int32_t* block_table,
    const int32_t* row_lens, int32_t num_cols, int64_t row_stride,
    int32_t block_size, int32_t num_blocks, unsigned long long* invalid_count,
    const Launch& launch);
cudaError_t LaunchSwaDecodeIndex(const int32_t* state_ids,
                                 const int32_t* starts,
                                 const int32_t* valid_lens, int64_t n,
                                 int32_t window, int32_t ring_size,
                                 int32_t* out, const Launch& launch);
cudaError_t LaunchExpandSwaIndex(const int32_t* pivots, int64_t rows,
                                 int32_t width, int32_t* out,
                                 const Launch& launch);
cudaError_t LaunchKvIndexCat(const int32_t* swa, int32_t swa_width,
                             const int32_t* compressed,
                             int32_t compressed_width, int64_t rows,
                             int32_t main_kv_offset, int32_t* out,
                             const Launch& launch);
cudaError_t LaunchKvIndexCatChecked(const int32_t* swa, int32_t swa_width,
                                    const int32_t* compressed,
                                    int32_t compressed_width, int64_t rows,
                                    int32_t main_kv_offset,
                                    int32_t compressed_rows, int32_t* out,
                                    unsigned long long* invalid_count,
                                    const Launch& launch);

}  // namespace kvdepot::gpu::internal

#endif  // KVDEPOT_KERNELS_CUDA_LAUNCH_INTERNAL_H_
