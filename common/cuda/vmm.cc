#include "common/cuda/vmm.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_mappings.h"
#include "common/cuda/cuda_status.h"
#include "common/cuda/driver_api.h"
#include "common/status_macros.h"

namespace kvdepot::gpu {
namespace {

CUmemAllocationProp DeviceProp(int device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// Makes `device` current with its primary context bound to this thread
// (cudaFree(nullptr) is the runtime's idiom for that), so that the driver
// calls that follow work on a thread that never used the runtime.
absl::StatusOr<ScopedCudaDevice> BindDevice(int device) {
  ASSIGN_OR_RETURN(ScopedCudaDevice scoped, ScopedCudaDevice::Enter(device));
  RETURN_IF_CUDA_ERROR(cudaFree(nullptr),
                       absl::StrCat("initializing cuda:", device));
  return scoped;
}

}  // namespace

absl::StatusOr<int64_t> VmmAllocation::Granularity(int device) {
  ASSIGN_OR_RETURN(const DriverApi* d, Driver());
  const CUmemAllocationProp prop = DeviceProp(device);
  size_t g = 0;
  RETURN_IF_CU_ERROR(
      d->cuMemGetAllocationGranularity(&g, &prop,
                                       CU_MEM_ALLOC_GRANULARITY_MINIMUM),
      absl::StrCat("cuMemGetAllocationGranularity(cuda:", device, ")"));
  if (g == 0) {
    return absl::InternalError("cuMemGetAllocationGranularity returned 0");
  }
  return static_cast<int64_t>(g);
}

absl::StatusOr<VmmAllocation> VmmAllocation::Create(int device, int64_t size) {
  if (size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a VMM allocation of ", size, " bytes"));
  }
  ASSIGN_OR_RETURN(const DriverApi* d, Driver());
  ASSIGN_OR_RETURN(ScopedCudaDevice scoped, BindDevice(device));
  ASSIGN_OR_RETURN(const int64_t g, Granularity(device));
  if (size > INT64_MAX - g) {
    return absl::InvalidArgumentError(
        absl::StrCat("a VMM allocation of ", size, " bytes"));
  }
  const int64_t bytes = (size + g - 1) / g * g;
  const CUmemAllocationProp prop = DeviceProp(device);
  VmmAllocation m;  // from here the destructor undoes what was done
  m.device_ = device;
  m.size_ = bytes;
  RETURN_IF_CU_ERROR(
      d->cuMemCreate(&m.handle_, static_cast<size_t>(bytes), &prop, 0),
      absl::StrCat("cuMemCreate(", bytes, " bytes on cuda:", device, ")"));
  m.has_handle_ = true;
  RETURN_IF_CU_ERROR(d->cuMemAddressReserve(&m.ptr_, static_cast<size_t>(bytes),
                                            static_cast<size_t>(g), 0, 0),
                     "cuMemAddressReserve");
  RETURN_IF_CU_ERROR(
      d->cuMemMap(m.ptr_, static_cast<size_t>(bytes), 0, m.handle_, 0),
      "cuMemMap");
  m.mapped_ = true;
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  RETURN_IF_CU_ERROR(
      d->cuMemSetAccess(m.ptr_, static_cast<size_t>(bytes), &access, 1),
      "cuMemSetAccess");
  return m;
}

absl::StatusOr<VmmAllocation> VmmAllocation::Import(int fd, int64_t size,
                                                    int device) {
  // Descriptors that cannot be a VMM export are refused before the driver
  // sees them (the driver refuses the rest).
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError("the descriptor is not open");
  }
  if (S_ISREG(st.st_mode) || S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode) ||
      S_ISDIR(st.st_mode) || S_ISLNK(st.st_mode) || S_ISBLK(st.st_mode)) {
    return absl::InvalidArgumentError(
        "the descriptor is not CUDA VMM memory (a file, memfd, pipe or "
        "socket); export it with cuMemExportToShareableHandle "
        "(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)");
  }
  if (size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("size = ", size, " must be > 0"));
  }
  ASSIGN_OR_RETURN(const DriverApi* d, Driver());
  ASSIGN_OR_RETURN(ScopedCudaDevice bound,
                   BindDevice(device >= 0 ? device : 0));
  VmmAllocation m;
  {
    const CUresult r = d->cuMemImportFromShareableHandle(
        &m.handle_, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the descriptor is not CUDA VMM memory this process can import: ",
          DriverStatus(r, "cuMemImportFromShareableHandle").message()));
    }
  }
  m.has_handle_ = true;
  CUmemAllocationProp prop = {};
  RETURN_IF_CU_ERROR(
      d->cuMemGetAllocationPropertiesFromHandle(&prop, m.handle_),
      "cuMemGetAllocationPropertiesFromHandle");
  if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
    return absl::InvalidArgumentError(
        "the imported allocation is not device memory");
  }
  if (device >= 0 && prop.location.id != device) {
    return absl::InvalidArgumentError(
        absl::StrCat("the imported allocation is on cuda:", prop.location.id,
                     ", not cuda:", device));
  }
  m.device_ = prop.location.id;
  ASSIGN_OR_RETURN(ScopedCudaDevice scoped, BindDevice(m.device_));
  ASSIGN_OR_RETURN(const int64_t g, Granularity(m.device_));
  if (size % g != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("size = ", size, " is not a multiple of cuda:", m.device_,
                     "'s allocation granularity (", g, " bytes)"));
  }
  m.size_ = size;
  RETURN_IF_CU_ERROR(d->cuMemAddressReserve(&m.ptr_, static_cast<size_t>(size),
                                            static_cast<size_t>(g), 0, 0),
                     "cuMemAddressReserve");
  if (const CUresult r =
          d->cuMemMap(m.ptr_, static_cast<size_t>(size), 0, m.handle_, 0);
      r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot map ", size,
                     " bytes of the imported allocation (is it that "
                     "large?): ",
                     DriverStatus(r, "cuMemMap").message()));
  }
  m.mapped_ = true;
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = m.device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  RETURN_IF_CU_ERROR(
      d->cuMemSetAccess(m.ptr_, static_cast<size_t>(size), &access, 1),
      "cuMemSetAccess");
  return m;
}

VmmAllocation::VmmAllocation(VmmAllocation&& other) noexcept
    : handle_(std::exchange(other.handle_, 0)),
      has_handle_(std::exchange(other.has_handle_, false)),
      ptr_(std::exchange(other.ptr_, 0)),
      mapped_(std::exchange(other.mapped_, false)),
      size_(std::exchange(other.size_, 0)),
      device_(std::exchange(other.device_, -1)) {}

VmmAllocation& VmmAllocation::operator=(VmmAllocation&& other) noexcept {
  if (this != &other) {
    Reset();
    handle_ = std::exchange(other.handle_, 0);
    has_handle_ = std::exchange(other.has_handle_, false);
    ptr_ = std::exchange(other.ptr_, 0);
    mapped_ = std::exchange(other.mapped_, false);
    size_ = std::exchange(other.size_, 0);
    device_ = std::exchange(other.device_, -1);
  }
  return *this;
}

VmmAllocation::~VmmAllocation() { Reset(); }

void VmmAllocation::Reset() {
  if (!has_handle_ && ptr_ == 0) return;
  absl::StatusOr<const DriverApi*> d = Driver();
  if (d.ok()) {
    // The mapping first, then its address range, then the physical memory
    // (freed once no process maps or holds it).
    if (mapped_) (void)(*d)->cuMemUnmap(ptr_, static_cast<size_t>(size_));
    if (ptr_ != 0) {
      (void)(*d)->cuMemAddressFree(ptr_, static_cast<size_t>(size_));
    }
    if (has_handle_) (void)(*d)->cuMemRelease(handle_);
  }
  handle_ = 0;
  has_handle_ = false;
  ptr_ = 0;
  mapped_ = false;
  size_ = 0;
  device_ = -1;
}

absl::StatusOr<UniqueFd> VmmAllocation::ExportFd() const {
  if (!has_handle_) {
    return absl::FailedPreconditionError("no VMM allocation to export");
  }
  ASSIGN_OR_RETURN(const DriverApi* d, Driver());
  int fd = -1;
  RETURN_IF_CU_ERROR(
      d->cuMemExportToShareableHandle(
          &fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
      "cuMemExportToShareableHandle");
  UniqueFd out(fd);
  if (!out.valid()) {
    return absl::InternalError("cuMemExportToShareableHandle returned no fd");
  }
  const int flags = fcntl(out.get(), F_GETFD);
  if (flags < 0 || fcntl(out.get(), F_SETFD, flags | FD_CLOEXEC) != 0) {
    return absl::InternalError("fcntl(FD_CLOEXEC) on an exported VMM fd");
  }
  return out;
}

}  // namespace kvdepot::gpu
