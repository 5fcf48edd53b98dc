// The CUDA kernels of kvdepot (SPEC §3-§5, §7) behind a host-only API: no
// CUDA syntax here, streams travel as opaque pointers. Every pointer below is
// device memory unless it says otherwise.
//
// The launchers take inputs that were already validated on the host (the
// daemon has host copies of every untrusted array): they check only what is
// cheap without reading device memory (formats, sizes, null and alignment)
// and never read the arrays themselves. Validate* run the contract's checks
// (kernels/store_load_host.h), the same the CPU reference and the daemon run.
//
// Launches are asynchronous on the caller's stream. With options.pdl the
// kernel is launched with Programmatic Dependent Launch: it may start while
// the previous kernel of the stream finishes and waits (griddepcontrol.wait)
// before reading any input.
#ifndef KVDEPOT_KERNELS_CUDA_KERNELS_H_
#define KVDEPOT_KERNELS_CUDA_KERNELS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/format.h"
#include "kernels/store_load.h"

namespace kvdepot::gpu {

struct LaunchOptions {
  void* stream = nullptr;  // a cudaStream_t; nullptr = the default stream
  bool pdl = false;        // Programmatic Dependent Launch
  // e4m3 encoding by cvt.rn.satfinite.e4m3x2.f32 (bit-exact with quant.h,
  // proven over all 2^32 inputs by the GPU tests) instead of quant.h's
  // integer path. Both give the same bytes.
  bool hw_e4m3 = true;
};

// Host-side validation, the contract's checks (store_load_host.h).
//   slot_mapping: host copy, [n]; -1 = padding.
absl::Status ValidateStore(const PoolLayout& layout,
                           absl::Span<const int32_t> slot_mapping);
//   segments: host copy, [S][4] flattened.
absl::Status ValidateLoad(const PoolLayout& layout,
                          absl::Span<const int32_t> segments, int64_t total_k);

// Store (SPEC §4) into one pool layer.
//   layer:        the layer's base (layout.layer_bytes), 16-byte aligned
//   kv:           [num_tokens][format.elements()] BF16 bits or fp32,
//                 16-byte aligned
//   slot_mapping: [num_tokens]; -1 = padding, skip; REQUIRES validated
// num_tokens = 0 launches nothing.
absl::Status Store(const PoolLayout& layout, void* layer, const void* kv,
                   InputDtype dtype, const int32_t* slot_mapping,
                   int64_t num_tokens, const LaunchOptions& options = {});

// Segment load (SPEC §5) from one pool layer.
//   segments: [num_segments][4] {src_block_id, src_begin, src_end,
//             dst_offset}; block -1 = zero rows; REQUIRES validated
//   data:     do_cast formats: BF16 [total_k][elements];
//             index formats: raw [total_k][quantized_bytes]; 16-byte aligned
//   scales:   index formats: int32 [total_k] (four UE8M0 bytes or the fp32
//             bits); ignored (may be null) for do_cast formats
// Rows no segment covers are untouched; num_segments = 0 launches nothing.
absl::Status LoadSegments(const PoolLayout& layout, const void* layer,
                          const int32_t* segments, int64_t num_segments,
                          void* data, void* scales,
                          const LaunchOptions& options = {});

// Decode top-k conversion in place (planner ConvertTopk):
//   topk:        [num_seqs][k] logical indices in, slots out (-1 invalid)
//   valid_count: [num_seqs] in [0, k]; columns past it become -1
//   num_tokens:  [num_seqs] >= 0 compressed tokens per sequence
//   block_table: [num_seqs][row_stride]; row_lens: [num_seqs] in
//                [0, num_cols], or null = every row has num_cols entries
//   invalid_count: a device counter the number of invalid entries (x < 0,
//                x >= num_tokens, past the row, or a table entry outside
//                [0, num_blocks)) is added to; may be null
absl::Status ConvertTopk(int32_t* topk, int64_t num_seqs, int32_t k,
                         const int32_t* valid_count, const int32_t* num_tokens,
                         const int32_t* block_table, const int32_t* row_lens,
                         int32_t num_cols, int64_t row_stride,
                         int32_t block_size, int32_t num_blocks,
                         unsigned long long* invalid_count,
                         const LaunchOptions& options = {});

// SWA decode index (planner ExpandSwaDecodeIndex):
//   state_ids, starts, valid_lens: [n]
//   out: [n][window]; state * ring_size + (start + i) % ring_size for
//        i < valid_len, else -1
absl::Status SwaDecodeIndex(const int32_t* state_ids, const int32_t* starts,
                            const int32_t* valid_lens, int64_t n,
                            int32_t window, int32_t ring_size, int32_t* out,
                            const LaunchOptions& options = {});

// Prefill SWA index from pivots (planner ExpandSwaIndex):
//   pivots: [rows][4] {off1, len1, off2, len2}, 16-byte aligned
//   out:    [rows][width]
absl::Status ExpandSwaIndex(const int32_t* pivots, int64_t rows, int32_t width,
                            int32_t* out, const LaunchOptions& options = {});

// [SWA index | compressed index + main_kv_offset] per row (planner
// KvIndexCat):
//   swa: [rows][swa_width]; compressed: [rows][compressed_width], -1 kept
//   out: [rows][swa_width + compressed_width]
absl::Status KvIndexCat(const int32_t* swa, int32_t swa_width,
                        const int32_t* compressed, int32_t compressed_width,
                        int64_t rows, int32_t main_kv_offset, int32_t* out,
                        const LaunchOptions& options = {});

// KvIndexCat on an untrusted compressed index (device memory a worker
// wrote): an entry outside [-1, compressed_rows) becomes -1 and is added
// to the device counter *invalid_count (required).
absl::Status KvIndexCatChecked(const int32_t* swa, int32_t swa_width,
                               const int32_t* compressed,
                               int32_t compressed_width, int64_t rows,
                               int32_t main_kv_offset, int32_t compressed_rows,
                               int32_t* out, unsigned long long* invalid_count,
                               const LaunchOptions& options = {});

}  // namespace kvdepot::gpu

#endif  // KVDEPOT_KERNELS_CUDA_KERNELS_H_
