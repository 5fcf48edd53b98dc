// Device strings and allocation sizes of the CUDA backend. Plain C++ (no
// CUDA headers), so it is tested in CPU-only builds too.
#ifndef KVDEPOT_SERVER_CUDA_DEVICES_H_
#define KVDEPOT_SERVER_CUDA_DEVICES_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvdepot {

// Every exported allocation is its own cudaMalloc rounded up to this, so
// mapping one never exposes a neighbour's bytes.
inline constexpr int64_t kCudaAllocationGranularity = int64_t{2} << 20;

// The device ordinal a pool request names: "" or "cuda" = 0, "cuda:N" = N
// (decimal digits only). INVALID_ARGUMENT naming `field` when it is
// malformed or N is not in [0, device_count).
absl::StatusOr<int> ParseCudaDevice(absl::string_view field,
                                    absl::string_view requested,
                                    int device_count);

// "cuda:N".
std::string CudaDeviceName(int ordinal);

// `size` (> 0) rounded up to kCudaAllocationGranularity; INVALID_ARGUMENT
// when size <= 0 or the rounded size overflows int64.
absl::StatusOr<int64_t> RoundUpAllocation(int64_t size);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_CUDA_DEVICES_H_
