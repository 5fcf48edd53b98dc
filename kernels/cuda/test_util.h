// Random inputs shared by the GPU tests and the benchmark: K/V values with
// special values sprinkled in, slot mappings with -1 padding and load plans
// with gaps and zero-fill segments. All deterministic given the generator.
#ifndef KVDEPOT_KERNELS_CUDA_TEST_UTIL_H_
#define KVDEPOT_KERNELS_CUDA_TEST_UTIL_H_

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/format.h"
#include "kernels/store_load.h"

namespace kvdepot::gpu {

// n * elements input values of `dtype` as raw bytes: normal values times a
// per-token magnitude in [1e-6, 1e4], with `specials` about 1 in 256 special
// (NaN, +-Inf, +-0, subnormal, huge). Tokens past the first 8192 repeat
// earlier ones.
std::vector<uint8_t> RandomKv(std::mt19937& rng, int64_t n, int32_t elements,
                              InputDtype dtype, bool specials = true);

// n slots: distinct slots of [0, num_slots) in random order, about
// padding_percent % of them replaced by -1. REQUIRES n <= num_slots.
std::vector<int32_t> RandomSlots(std::mt19937& rng, int64_t n,
                                 int64_t num_slots, int padding_percent);

// A valid plan of about `num_segments` segments over `layout` (flattened
// [S][4]), with -1 blocks, empty segments and uncovered rows; *total_k gets
// the output row count.
std::vector<int32_t> RandomSegments(std::mt19937& rng, const PoolLayout& layout,
                                    int64_t num_segments, int64_t* total_k);

// n random bytes.
std::vector<uint8_t> RandomBytes(std::mt19937& rng, int64_t n);

bool AllZero(const std::vector<uint8_t>& bytes);

}  // namespace kvdepot::gpu

#endif  // KVDEPOT_KERNELS_CUDA_TEST_UTIL_H_
