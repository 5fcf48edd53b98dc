// The CPU reference of the fused store (SPEC §8): defines every bit the CUDA
// kernel must produce. Built with -ffp-contract=off (and tested also in an
// -mfma build): every product and sum below is rounded as written.
#ifndef KVDEPOT_KERNELS_REFERENCE_FUSED_H_
#define KVDEPOT_KERNELS_REFERENCE_FUSED_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/format.h"
#include "kernels/fused.h"

namespace kvdepot {

// One token through the stages before quantization: x (D BF16 bit patterns,
// D = format.elements()) -> D BF16 bit patterns (step 4 of SPEC §8).
// `position` is the token's RoPE position (ignored without RoPE).
// REQUIRES: ValidateFused(format, p, {position}) is OK.
void FusedTransformToken(const KVCacheFormat& format, const FusedParams& p,
                         int64_t position, const uint16_t* x, uint16_t* y);

// The RMSNorm sum of squares of SPEC §8's reduction tree over
// x[begin, end) (fp32 values; begin and end multiples of 8).
float FusedSumOfSquares(const float* x, int32_t begin, int32_t end);

// The fused store into one pool layer: kv [n][D] BF16 (n =
// slot_mapping.size()), slots as Store (SPEC §4; -1 = skip), cast_back (may
// be null) [n][D] BF16: what a later load of the token's slot returns (for
// -1 slots, as if stored). Validates everything before writing.
absl::Status FusedStore(const PoolLayout& layout, uint8_t* layer,
                        const uint16_t* kv, const FusedParams& params,
                        absl::Span<const int32_t> slot_mapping,
                        uint16_t* cast_back);

}  // namespace kvdepot

#endif  // KVDEPOT_KERNELS_REFERENCE_FUSED_H_
