#include "server/cuda/devices.h"

#include <cstdint>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace kvdepot {

absl::StatusOr<int> ParseCudaDevice(absl::string_view field,
                                    absl::string_view requested,
                                    int device_count) {
  if (device_count <= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, " = \"", requested, "\": no CUDA device is visible"));
  }
  int ordinal = 0;
  if (!requested.empty() && requested != "cuda") {
    absl::string_view digits = requested;
    bool ok = absl::ConsumePrefix(&digits, "cuda:") && !digits.empty() &&
              digits.size() <= 9;
    for (char c : digits) ok = ok && absl::ascii_isdigit(c);
    if (!ok || !absl::SimpleAtoi(digits, &ordinal)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " = \"", requested,
                       "\" is not \"cuda:N\" (N a device ordinal) or empty"));
    }
  }
  if (ordinal >= device_count) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " = \"", requested, "\": device ", ordinal, " is outside [0, ",
        device_count, ") (visible CUDA devices)"));
  }
  return ordinal;
}

std::string CudaDeviceName(int ordinal) {
  return absl::StrCat("cuda:", ordinal);
}

absl::StatusOr<int64_t> RoundUpAllocation(int64_t size) {
  constexpr int64_t g = kCudaAllocationGranularity;
  if (size <= 0 || size > std::numeric_limits<int64_t>::max() - (g - 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("size = ", size, " is outside [1, ",
                     std::numeric_limits<int64_t>::max() - (g - 1), "]"));
  }
  return (size + g - 1) / g * g;
}

}  // namespace kvdepot
