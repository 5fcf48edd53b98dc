// Host-side part of the store and load contract (SPEC §4, §5): the row sizes
// of a segment load's outputs and the checks of every untrusted store and
// load input. The CPU reference, the CUDA launchers and the daemon all
// validate through these, so they accept and reject exactly the same
// requests. On error the status is INVALID_ARGUMENT naming the field and
// index, e.g. "slot_mapping[17] = 9000 is outside [-1, 8192)".
#ifndef KVDEPOT_KERNELS_STORE_LOAD_HOST_H_
#define KVDEPOT_KERNELS_STORE_LOAD_HOST_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/format.h"
#include "kernels/store_load.h"

namespace kvdepot {

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
// e2m1+e4m3, e4m3+fp32 (or no quantization), or e4m3+fp32 with pow2_ceil
// scales (SPEC §2.1, the only scheme with a BF16 tail). Other pairs are
// UNIMPLEMENTED.
absl::Status ValidateQuantization(const KVCacheFormat& format);

// True for formats whose store takes BF16 input only: e4m3+fp32 pow2_ceil
// and any record with a BF16 tail (DS_MLA_FP8, SPEC §2.1).
bool TakesBf16InputOnly(const KVCacheFormat& format);

// OK when `dtype` is BF16 or FP32 and the format accepts it (FP32 input to a
// TakesBf16InputOnly format is INVALID_ARGUMENT naming the format).
absl::Status ValidateInputDtype(const KVCacheFormat& format, InputDtype dtype);

// Checks slot_mapping against the layout: every slot in [-1, num_slots) and
// no non-(-1) slot twice.
absl::Status ValidateSlotMapping(const PoolLayout& layout,
                                 absl::Span<const int32_t> slot_mapping);

// Checks a plan: segments is [S][4] int32 {src_block_id, src_begin, src_end,
// dst_offset} flattened (size divisible by 4; see Segment), total_k >= 0,
// every field in range, destination ranges inside [0, total_k) and pairwise
// disjoint. An empty segment (src_begin == src_end) overlaps nothing; its
// dst_offset may be anything in [0, total_k].
absl::Status ValidateSegments(const PoolLayout& layout,
                              absl::Span<const int32_t> segments,
                              int64_t total_k);

}  // namespace kvdepot

#endif  // KVDEPOT_KERNELS_STORE_LOAD_HOST_H_
