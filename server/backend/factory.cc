#include "server/backend/factory.h"

#include "absl/strings/str_cat.h"
#include "server/cpu/cpu_backend.h"
#ifdef KVDEPOT_HAVE_CUDA
#include "server/cuda/cuda_backend.h"
#endif

namespace kvdepot {

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(
    absl::string_view kind, const BackendOptions& options) {
  if (kind == "cpu") return MakeCpuBackend(options);
#ifdef KVDEPOT_HAVE_CUDA
  if (kind == "cuda") return MakeCudaBackend(options);
  if (kind == "auto") {
    absl::StatusOr<int> devices = CudaDeviceCount();
    if (devices.ok() && *devices > 0) return MakeCudaBackend(options);
    return MakeCpuBackend(options);
  }
#else
  if (kind == "auto") return MakeCpuBackend(options);
  if (kind == "cuda") {
    return absl::UnimplementedError(
        "--backend=cuda: this build has no CUDA backend (built without a "
        "CUDA toolkit, or with KVDEPOT_DISABLE_CUDA=1); use --backend=cpu "
        "(or auto)");
  }
#endif
  return absl::InvalidArgumentError(
      absl::StrCat("--backend = \"", kind, "\" is not one of auto, cpu, cuda"));
}

}  // namespace kvdepot
