#include "common/cuda/cuda_mappings.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/cuda/cuda_status.h"
#include "common/status_macros.h"

namespace kvdepot {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes);
static_assert(sizeof(cudaIpcEventHandle_t) == kCudaIpcHandleBytes);

// One open IPC handle of this process.
struct OpenHandle {
  uint8_t* base = nullptr;  // cudaIpcOpenMemHandle's address
  int64_t bytes = 0;        // allocation size the driver reports
  int device = -1;
  int refs = 0;  // CudaIpcMapping objects using it
};

// Process-wide registry, key: the handle's bytes. Opening and closing
// happen under the lock, so a handle is never open twice.
struct Registry {
  absl::Mutex mu;
  absl::flat_hash_map<std::string, OpenHandle> open ABSL_GUARDED_BY(mu);
};

Registry& GetRegistry() {
  static Registry* registry = new Registry;  // never destroyed
  return *registry;
}

// cuMemGetAddressRange through the runtime's driver entry point, so the
// binary needs no libcuda at link time.
using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

absl::StatusOr<int64_t> AllocationBytes(const void* base) {
  static GetAddressRangeFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult result{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000,
                                         cudaEnableDefault,
                                         &result) != cudaSuccess ||
        result != cudaDriverEntryPointSuccess) {
      p = nullptr;
    }
    return reinterpret_cast<GetAddressRangeFn>(p);
  }();
  if (fn == nullptr) {
    return absl::FailedPreconditionError(
        "the CUDA driver does not provide cuMemGetAddressRange, needed to "
        "check the size of an imported allocation");
  }
  CUdeviceptr range_base = 0;
  size_t range_bytes = 0;
  const CUresult r =
      fn(&range_base, &range_bytes, reinterpret_cast<CUdeviceptr>(base));
  if (r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat(
        "cuMemGetAddressRange of an IPC mapping failed with CUresult ", r));
  }
  if (range_base != reinterpret_cast<CUdeviceptr>(base)) {
    return absl::InternalError(
        "cuMemGetAddressRange: an IPC mapping does not start at its "
        "allocation's base");
  }
  return static_cast<int64_t>(range_bytes);
}

}  // namespace

absl::StatusOr<ScopedCudaDevice> ScopedCudaDevice::Enter(int device) {
  int previous = -1;
  RETURN_IF_CUDA_ERROR(cudaGetDevice(&previous), "cudaGetDevice");
  if (previous != device) {
    RETURN_IF_CUDA_ERROR(cudaSetDevice(device),
                         absl::StrCat("cudaSetDevice(", device, ")"));
    return ScopedCudaDevice(previous);
  }
  return ScopedCudaDevice(-1);
}

ScopedCudaDevice::ScopedCudaDevice(ScopedCudaDevice&& other) noexcept
    : previous_(std::exchange(other.previous_, -1)) {}

ScopedCudaDevice::~ScopedCudaDevice() {
  if (previous_ >= 0) (void)cudaSetDevice(previous_);
}

absl::Status ValidateCudaHandle(absl::string_view field,
                                const v1::SharedHandle& handle,
                                int device_count) {
  if (handle.kind_case() != v1::SharedHandle::kCudaIpcHandle) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": a CUDA backend needs cuda_ipc_handle (",
        handle.kind_case() == v1::SharedHandle::kShmName ? "got shm_name"
                                                         : "no handle set",
        ")"));
  }
  if (handle.cuda_ipc_handle().size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".cuda_ipc_handle holds ", handle.cuda_ipc_handle().size(),
        " bytes; a cudaIpcMemHandle_t has ", kCudaIpcHandleBytes));
  }
  if (handle.device_ordinal() < 0 || handle.device_ordinal() >= device_count) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".device_ordinal = ", handle.device_ordinal(),
        " is outside [0, ", device_count, ") (visible CUDA devices)"));
  }
  if (handle.size() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".size = ", handle.size(), " must be > 0"));
  }
  if (handle.offset() < 0 || handle.offset() >= handle.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".offset = ", handle.offset(), " is outside [0, ",
                     handle.size(), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CudaIpcMapping> CudaIpcMapping::Open(
    const v1::SharedHandle& handle) {
  int device_count = 0;
  RETURN_IF_CUDA_ERROR(cudaGetDeviceCount(&device_count), "cudaGetDeviceCount");
  RETURN_IF_ERROR(ValidateCudaHandle("handle", handle, device_count));
  const std::string& key = handle.cuda_ipc_handle();
  Registry& registry = GetRegistry();
  absl::MutexLock lock(&registry.mu);
  auto it = registry.open.find(key);
  if (it == registry.open.end()) {
    const int device = handle.device_ordinal();
    absl::StatusOr<ScopedCudaDevice> scoped = ScopedCudaDevice::Enter(device);
    if (!scoped.ok()) return scoped.status();
    cudaIpcMemHandle_t h;
    std::memcpy(&h, key.data(), sizeof(h));
    void* base = nullptr;
    if (const cudaError_t e =
            cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
        e != cudaSuccess) {
      (void)cudaGetLastError();  // a bad handle must not linger as last error
      return gpu::ToStatus(
          e,
          absl::StrCat("cudaIpcOpenMemHandle(handle.cuda_ipc_handle) on cuda:",
                       device));
    }
    absl::StatusOr<int64_t> bytes = AllocationBytes(base);
    if (!bytes.ok()) {
      (void)cudaIpcCloseMemHandle(base);
      return bytes.status();
    }
    OpenHandle entry;
    entry.base = static_cast<uint8_t*>(base);
    entry.bytes = *bytes;
    entry.device = device;
    it = registry.open.emplace(key, entry).first;
  }
  OpenHandle& entry = it->second;
  if (handle.size() > entry.bytes) {
    const std::string message = absl::StrCat(
        "handle.size = ", handle.size(), " exceeds the exported allocation's ",
        entry.bytes, " bytes");
    if (entry.refs == 0) {
      absl::StatusOr<ScopedCudaDevice> scoped =
          ScopedCudaDevice::Enter(entry.device);
      (void)cudaIpcCloseMemHandle(entry.base);
      registry.open.erase(it);
    }
    return absl::InvalidArgumentError(message);
  }
  ++entry.refs;
  return CudaIpcMapping(key, entry.base, handle.offset(),
                        handle.size() - handle.offset(), entry.device);
}

CudaIpcMapping::CudaIpcMapping(CudaIpcMapping&& other) noexcept
    : key_(std::exchange(other.key_, std::string())),
      base_(std::exchange(other.base_, nullptr)),
      offset_(other.offset_),
      size_(other.size_),
      device_(other.device_) {}

CudaIpcMapping& CudaIpcMapping::operator=(CudaIpcMapping&& other) noexcept {
  if (this != &other) {
    Release();
    key_ = std::exchange(other.key_, std::string());
    base_ = std::exchange(other.base_, nullptr);
    offset_ = other.offset_;
    size_ = other.size_;
    device_ = other.device_;
  }
  return *this;
}

CudaIpcMapping::~CudaIpcMapping() { Release(); }

void CudaIpcMapping::Release() {
  if (key_.empty()) return;
  Registry& registry = GetRegistry();
  absl::MutexLock lock(&registry.mu);
  auto it = registry.open.find(key_);
  if (it != registry.open.end() && --it->second.refs == 0) {
    absl::StatusOr<ScopedCudaDevice> scoped =
        ScopedCudaDevice::Enter(it->second.device);
    (void)cudaIpcCloseMemHandle(it->second.base);
    registry.open.erase(it);
  }
  key_.clear();
  base_ = nullptr;
}

int CudaIpcMapping::RefCount(absl::string_view handle_bytes) {
  Registry& registry = GetRegistry();
  absl::MutexLock lock(&registry.mu);
  auto it = registry.open.find(std::string(handle_bytes));
  return it == registry.open.end() ? 0 : it->second.refs;
}

}  // namespace kvdepot
