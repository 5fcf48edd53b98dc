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

}  // namespace kvdepot::internal

#endif  // KVDEPOT_KERNELS_REFERENCE_REFERENCE_INTERNAL_H_
