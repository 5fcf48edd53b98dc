// The CPU reference of store (SPEC §4) and segment load (SPEC §5). It defines
// every result bit for bit: the CUDA kernels are tested against it, and it is
// the engine of the daemon's CPU backend.
//
// Every entry point validates all of its untrusted inputs before writing a
// single byte, with the contract's checks (kernels/store_load_host.h); on
// error nothing is written and the status is INVALID_ARGUMENT naming the
// field and index, e.g.
//   "slot_mapping[17] = 9000 is outside [-1, 8192)".
#ifndef KVDEPOT_KERNELS_REFERENCE_REFERENCE_H_
#define KVDEPOT_KERNELS_REFERENCE_REFERENCE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/format.h"
#include "kernels/store_load.h"
#include "kernels/store_load_host.h"

namespace kvdepot {

// Quantizes kv[n, elements] (n = slot_mapping.size()) and writes each token
// into its slot of one pool layer. -1 slots are skipped; n = 0 is a no-op.
// slot_mapping: [n]; slot = block_id * block_size + offset, -1 = skip.
// The layout must be one MakePoolLayout builds and the format must pass
// ValidateQuantization. REQUIRES: `layer` points at layout.layer_bytes bytes;
// kv holds n * layout.format.elements() values of `dtype` (any alignment).
absl::Status Store(const PoolLayout& layout, uint8_t* layer, const void* kv,
                   InputDtype dtype, absl::Span<const int32_t> slot_mapping);

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
// Formats with a BF16 tail (DS_MLA_FP8) write the tail right after the
// scales (scales + sf_bytes(), as in the record) and take BF16 input: x is
// rounded to BF16 first (exact for BF16 values).
// REQUIRES: ValidateQuantization(format) is OK; otherwise nothing is
// written (same for DecodeToken).
void EncodeToken(const KVCacheFormat& format, const float* x, uint8_t* data,
                 uint8_t* scales);

// The inverse for do_cast formats: data + scales -> fp32 (before the BF16
// rounding that the load applies). For index formats returns the
// dequantized values too (used by inspection tools, not by the load).
// A BF16 tail is read from scales + sf_bytes().
void DecodeToken(const KVCacheFormat& format, const uint8_t* data,
                 const uint8_t* scales, float* out);

// EncodeToken from BF16 input (x: elements() BF16 bit patterns, any
// alignment): exactly the bytes Store writes for a BF16 token, tails
// included bit for bit.
void EncodeTokenBf16(const KVCacheFormat& format, const uint8_t* x,
                     uint8_t* data, uint8_t* scales);

// One record -> the row a segment load writes for it: BF16 bits (elements()
// x 2 bytes; any alignment). Index formats: their values dequantized to
// BF16 (tools only; the load copies them raw). BF16 records and tails are
// copied bit for bit.
void DecodeTokenBf16(const KVCacheFormat& format, const uint8_t* data,
                     const uint8_t* scales, uint8_t* out);

}  // namespace kvdepot

#endif  // KVDEPOT_KERNELS_REFERENCE_REFERENCE_H_
