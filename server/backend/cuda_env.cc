#include "server/backend/cuda_env.h"

#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvdepot {

absl::Status CheckCudaEnvironment() {
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  if (loading == nullptr || std::string(loading) != "EAGER") {
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA_MODULE_LOADING = ",
        loading == nullptr ? "(unset)" : absl::StrCat("\"", loading, "\""),
        ": the CUDA backend needs EAGER (with lazy loading the first launch "
        "of a kernel hangs while another stream waits; GPU_HOST.md); unset "
        "it (kvdepotd sets EAGER itself) or set it to EAGER"));
  }
  const char* connections = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  if (connections == nullptr) return absl::OkStatus();  // the default, 8
  int n = 0;
  if (!absl::SimpleAtoi(connections, &n) || n < kMinCudaDeviceConnections) {
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA_DEVICE_MAX_CONNECTIONS = \"", connections,
        "\": the CUDA backend needs at least ", kMinCudaDeviceConnections,
        " hardware connections (with fewer, streams queue behind a waiting "
        "one and its release never lands; GPU_HOST.md); unset it or raise "
        "it"));
  }
  return absl::OkStatus();
}

absl::Status PrepareCudaEnvironment() {
  if (std::getenv("CUDA_MODULE_LOADING") == nullptr) {
    setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  }
  return CheckCudaEnvironment();
}

}  // namespace kvdepot
