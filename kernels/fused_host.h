// Validation of the fused store's inputs (SPEC §8), shared by the CPU
// reference, the CUDA launcher and the tools. INVALID_ARGUMENT naming the
// field and index, e.g. "positions[3] = 9000 is outside [0, 4096)".
#ifndef KVDEPOT_KERNELS_FUSED_HOST_H_
#define KVDEPOT_KERNELS_FUSED_HOST_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/format.h"
#include "kernels/fused.h"

namespace kvdepot {

// Checks the ranges against the format (D = elements() <= kFusedMaxElements,
// a multiple of 8), the pointers each enabled stage needs, eps (finite,
// >= 0), and, when RoPE is on, every position (host copy, [n]) against
// max_position. ValidateQuantization and the slots are checked separately.
absl::Status ValidateFused(const KVCacheFormat& format, const FusedParams& p,
                           absl::Span<const int64_t> positions);

}  // namespace kvdepot

#endif  // KVDEPOT_KERNELS_FUSED_HOST_H_
