// The CPU reference of store (SPEC §4) and segment load (SPEC §5). It defines
// every result bit for bit: the CUDA kernels are tested against it, and it is
// the engine of the daemon's CPU backend.
//
// Every entry point validates all of its untrusted inputs before writing a
// single byte; on error nothing is written and the status is
// INVALID_ARGUMENT naming the field and index, e.g.
//   "slot_mapping[17] = 9000 is outside [-1, 8192)".
#ifndef KVDEPOT_KERNELS_REFERENCE_H_
#define KVDEPOT_KERNELS_REFERENCE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/format.h"

namespace kvdepot {

// Element type of the K/V handed to a store.
enum class InputDtype : uint8_t {
  kBF16 = 0,  // uint16_t bit patterns
  kFP32 = 1,  // float (tests, tools)
};

// Bytes per output row of a segment load.
//   do_cast formats: data = BF16 [elements] (2 * elements bytes), no scales
//                    (BF16(N) records are copied as they are).
//   index formats:   data = raw [quantized_bytes];
//                    scales = UE8M0/e4m3 bytes packed four per int32 (row of
//                    sf_bytes rounded up to 4, zero padded) or one fp32.
int64_t LoadDataRowBytes(const KVCacheFormat& format);
int64_t LoadScaleRowBytes(const KVCacheFormat& format);

// OK when `format` is valid (ValidateFormat) and its quantized_dtype /
// sf_format pair is one SPEC §3 defines math for: e4m3+ue8m0, e2m1+ue8m0,
// e2m1+e4m3, e4m3+fp32 (or no quantization). Other pairs are UNIMPLEMENTED.
absl::Status ValidateQuantization(const KVCacheFormat& format);

// Checks slot_mapping against the layout: every slot in [-1, num_slots) and
// no non-(-1) slot twice.
absl::Status ValidateSlotMapping(const PoolLayout& layout,
                                 absl::Span<const int32_t> slot_mapping);

// Quantizes kv[n, elements] (n = slot_mapping.size()) and writes each token
// into its slot of one pool layer. -1 slots are skipped; n = 0 is a no-op.
// slot_mapping: [n]; slot = block_id * block_size + offset, -1 = skip.
// The layout must be one MakePoolLayout builds and the format must pass
// ValidateQuantization. REQUIRES: `layer` points at layout.layer_bytes bytes;
// kv holds n * layout.format.elements() values of `dtype` (any alignment).
absl::Status Store(const PoolLayout& layout, uint8_t* layer, const void* kv,
                   InputDtype dtype, absl::Span<const int32_t> slot_mapping);

// Checks a plan: segments is [S][4] int32 {src_block_id, src_begin, src_end,
// dst_offset} flattened (size divisible by 4), total_k >= 0, every field in
// range, destination ranges inside [0, total_k) and pairwise disjoint. An
// empty segment (src_begin == src_end) overlaps nothing; its dst_offset may
// be anything in [0, total_k].
absl::Status ValidateSegments(const PoolLayout& layout,
                              absl::Span<const int32_t> segments,
                              int64_t total_k);

// Segment load from one pool layer into caller-supplied outputs of
// total_k rows (LoadDataRowBytes / LoadScaleRowBytes per row). Rows that no
// segment covers are left untouched; -1 blocks write zero rows (data and
// scales). `scales` may be null for do_cast formats.
absl::Status LoadSegments(const PoolLayout& layout, const uint8_t* layer,
                          absl::Span<const int32_t> segments, int64_t total_k,
                          void* data, void* scales);

// One token through the quantization of its format: fp32 input of
// format.elements() values -> data bytes (data_bytes()) and scale bytes
// (sf_bytes()), exactly as Store writes them. Used by tools and tests.
// REQUIRES: ValidateQuantization(format) is OK; otherwise nothing is
// written (same for DecodeToken).
void EncodeToken(const KVCacheFormat& format, const float* x, uint8_t* data,
                 uint8_t* scales);

// The inverse for do_cast formats: data + scales -> fp32 (before the BF16
// rounding that the load applies). For index formats returns the
// dequantized values too (used by inspection tools, not by the load).
void DecodeToken(const KVCacheFormat& format, const uint8_t* data,
                 const uint8_t* scales, float* out);

}  // namespace kvdepot

#endif  // KVDEPOT_KERNELS_REFERENCE_H_
