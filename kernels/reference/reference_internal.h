// Checks shared by the store and load entry points of the CPU reference
// (reference_validate.cc). Not part of the public API.
#ifndef KVDEPOT_KERNELS_REFERENCE_REFERENCE_INTERNAL_H_
#define KVDEPOT_KERNELS_REFERENCE_REFERENCE_INTERNAL_H_

#include "absl/status/status.h"
#include "kernels/format.h"

namespace kvdepot::internal {

// OK when `layout` is exactly what MakePoolLayout builds for its format,
// block_size, num_blocks and num_layers (a hand-edited stride would send
// writes out of the layer).
absl::Status ValidateLayout(const PoolLayout& layout);

// e4m3 + fp32 pow2_ceil records with a BF16 tail (SPEC §2.1, ds_mla.cc).
// x: the token's elements() BF16 values (bits, any alignment); writes
// quantized_bytes codes to `data`, sf_bytes to `scales` and the tail right
// after the scales (scales + sf_bytes()), as in the record.
void EncodePow2Record(const KVCacheFormat& f, const uint8_t* x, uint8_t* data,
                      uint8_t* scales);
// The inverse: elements() values, BF16 bits (bf16_out, the load: q x s
// rounded, tail copied) or fp32 (q x s, tail widened).
void DecodePow2Record(const KVCacheFormat& f, const uint8_t* data,
                      const uint8_t* scales, bool bf16_out, uint8_t* out);

}  // namespace kvdepot::internal

#endif  // KVDEPOT_KERNELS_REFERENCE_REFERENCE_INTERNAL_H_
