// CUDA driver API entry points reached through the runtime
// (cudaGetDriverEntryPointByVersion), never by linking -lcuda: the daemon
// must start, and its CPU backend work, on a machine without a driver.
// The function types are the CUDA headers' own PFN typedefs
// (cudaTypedefs.h), pinned to the ABI version this code was written for.
#ifndef KVDEPOT_COMMON_CUDA_DRIVER_API_H_
#define KVDEPOT_COMMON_CUDA_DRIVER_API_H_

#include <cuda.h>
#include <cudaTypedefs.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvdepot::gpu {

struct DriverApi {
  PFN_cuGetErrorName_v6000 cuGetErrorName = nullptr;
  PFN_cuGetErrorString_v6000 cuGetErrorString = nullptr;
  PFN_cuMemCreate_v10020 cuMemCreate = nullptr;
  PFN_cuMemRelease_v10020 cuMemRelease = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 cuMemExportToShareableHandle =
      nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 cuMemImportFromShareableHandle =
      nullptr;
  PFN_cuMemAddressReserve_v10020 cuMemAddressReserve = nullptr;
  PFN_cuMemAddressFree_v10020 cuMemAddressFree = nullptr;
  PFN_cuMemMap_v10020 cuMemMap = nullptr;
  PFN_cuMemUnmap_v10020 cuMemUnmap = nullptr;
  PFN_cuMemSetAccess_v10020 cuMemSetAccess = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 cuMemGetAllocationGranularity =
      nullptr;
  PFN_cuMemGetAllocationPropertiesFromHandle_v10020
      cuMemGetAllocationPropertiesFromHandle = nullptr;
  // The step path's doorbells (stream memory operations).
  PFN_cuStreamWaitValue64_v11070 cuStreamWaitValue64 = nullptr;
  PFN_cuStreamWriteValue64_v11070 cuStreamWriteValue64 = nullptr;
};

// The entry points, resolved once (thread-safe); FAILED_PRECONDITION naming
// the first symbol the installed driver does not provide (or no driver).
absl::StatusOr<const DriverApi*> Driver();

// OK for CUDA_SUCCESS; otherwise a status naming `detail` and the error.
// Out of memory: RESOURCE_EXHAUSTED; invalid value or handle, not
// permitted: INVALID_ARGUMENT; no device or driver, not supported:
// FAILED_PRECONDITION; else INTERNAL.
absl::Status DriverStatus(CUresult result, absl::string_view detail);

}  // namespace kvdepot::gpu

#define RETURN_IF_CU_ERROR(expr, detail)                            \
  do {                                                              \
    const CUresult kv_cu_result_ = (expr);                          \
    if (kv_cu_result_ != CUDA_SUCCESS) {                            \
      return ::kvdepot::gpu::DriverStatus(kv_cu_result_, (detail)); \
    }                                                               \
  } while (false)

#endif  // KVDEPOT_COMMON_CUDA_DRIVER_API_H_
