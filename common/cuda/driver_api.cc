#include "common/cuda/driver_api.h"

#include <cuda_runtime_api.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace kvdepot::gpu {
namespace {

// The ABI of each entry point: the typedef suffixes in driver_api.h.
constexpr unsigned kV6000 = 6000;
constexpr unsigned kV10020 = 10020;
constexpr unsigned kV11070 = 11070;

template <typename Fn>
absl::Status Resolve(const char* symbol, unsigned version, Fn* out) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t e = cudaGetDriverEntryPointByVersion(
      symbol, &fn, version, cudaEnableDefault, &found);
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess ||
      fn == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the CUDA driver does not provide ", symbol, " (ABI ", version, "): ",
        e != cudaSuccess ? cudaGetErrorString(e)
        : found == cudaDriverEntryPointVersionNotSufficent
            ? "driver too old"
            : "symbol not found"));
  }
  *out = reinterpret_cast<Fn>(fn);
  return absl::OkStatus();
}

absl::StatusOr<DriverApi> Load() {
  DriverApi d;
  absl::Status s;
  auto r = [&s](const char* symbol, unsigned version, auto* out) {
    if (s.ok()) s = Resolve(symbol, version, out);
  };
  r("cuGetErrorName", kV6000, &d.cuGetErrorName);
  r("cuGetErrorString", kV6000, &d.cuGetErrorString);
  r("cuMemCreate", kV10020, &d.cuMemCreate);
  r("cuMemRelease", kV10020, &d.cuMemRelease);
  r("cuMemExportToShareableHandle", kV10020, &d.cuMemExportToShareableHandle);
  r("cuMemImportFromShareableHandle", kV10020,
    &d.cuMemImportFromShareableHandle);
  r("cuMemAddressReserve", kV10020, &d.cuMemAddressReserve);
  r("cuMemAddressFree", kV10020, &d.cuMemAddressFree);
  r("cuMemMap", kV10020, &d.cuMemMap);
  r("cuMemUnmap", kV10020, &d.cuMemUnmap);
  r("cuMemSetAccess", kV10020, &d.cuMemSetAccess);
  r("cuMemGetAllocationGranularity", kV10020, &d.cuMemGetAllocationGranularity);
  r("cuMemGetAllocationPropertiesFromHandle", kV10020,
    &d.cuMemGetAllocationPropertiesFromHandle);
  r("cuStreamWaitValue64", kV11070, &d.cuStreamWaitValue64);
  r("cuStreamWriteValue64", kV11070, &d.cuStreamWriteValue64);
  if (!s.ok()) return s;
  return d;
}

}  // namespace

absl::StatusOr<const DriverApi*> Driver() {
  static const absl::StatusOr<DriverApi>* const loaded =
      new absl::StatusOr<DriverApi>(Load());
  if (!loaded->ok()) return loaded->status();
  return &**loaded;
}

absl::Status DriverStatus(CUresult result, absl::string_view detail) {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  const char* name = "?";
  const char* text = "";
  if (absl::StatusOr<const DriverApi*> d = Driver(); d.ok()) {
    if ((*d)->cuGetErrorName(result, &name) != CUDA_SUCCESS) name = "?";
    if ((*d)->cuGetErrorString(result, &text) != CUDA_SUCCESS) text = "";
  }
  const std::string message =
      absl::StrCat(detail, ": CUDA driver error ", static_cast<int>(result),
                   " (", name, "): ", text);
  switch (result) {
    case CUDA_ERROR_OUT_OF_MEMORY:
      return absl::ResourceExhaustedError(message);
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
    case CUDA_ERROR_NOT_PERMITTED:
      return absl::InvalidArgumentError(message);
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_INVALID_DEVICE:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_NOT_SUPPORTED:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace kvdepot::gpu
