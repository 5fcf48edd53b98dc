// Device memory from the CUDA virtual memory management API (SPEC §11):
// a physical allocation created shareable as a POSIX file descriptor
// (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), mapped read-write at an
// address range reserved for it on one device. A pool or buffer is handed
// to another process as that descriptor (SCM_RIGHTS), which imports and
// maps it with VmmAllocation::Import: no bearer token ever names it.
//
// The driver is reached through //common/cuda:driver_api (no -lcuda).
// Neither Create, Import nor the destructor synchronizes anything: the
// owner waits for the streams that used the memory before destroying it.
#ifndef KVDEPOT_COMMON_CUDA_VMM_H_
#define KVDEPOT_COMMON_CUDA_VMM_H_

#include <cuda.h>

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/unique_fd.h"

namespace kvdepot::gpu {

class VmmAllocation {
 public:
  // The allocation granularity of `device` (the driver's minimum for
  // POSIX-descriptor-shareable device memory; 2 MiB on the H200).
  static absl::StatusOr<int64_t> Granularity(int device);

  // `size` > 0 bytes, rounded up to Granularity(device), on `device`,
  // mapped read-write there. Not zero-filled.
  static absl::StatusOr<VmmAllocation> Create(int device, int64_t size);

  // Imports a peer's exported descriptor `fd` (borrowed: the caller still
  // owns and closes it) and maps `size` bytes of it on `device`; `device`
  // < 0 = the device the allocation lives on. INVALID_ARGUMENT when `fd`
  // is not a VMM export (a memfd, a pipe, ...), when `size` is not a
  // positive multiple of the granularity, when the allocation is smaller
  // than `size`, or when it lives on another device than `device`.
  static absl::StatusOr<VmmAllocation> Import(int fd, int64_t size, int device);

  VmmAllocation() = default;
  VmmAllocation(VmmAllocation&& other) noexcept;
  VmmAllocation& operator=(VmmAllocation&& other) noexcept;
  VmmAllocation(const VmmAllocation&) = delete;
  VmmAllocation& operator=(const VmmAllocation&) = delete;
  // Unmaps, frees the address range, releases the handle.
  ~VmmAllocation();

  // A new descriptor of the allocation (close-on-exec) for a peer.
  absl::StatusOr<UniqueFd> ExportFd() const;

  bool valid() const { return ptr_ != 0; }
  uint8_t* data() const { return reinterpret_cast<uint8_t*>(ptr_); }
  CUdeviceptr device_ptr() const { return ptr_; }
  // Mapped bytes (a multiple of the granularity).
  int64_t size() const { return size_; }
  int device() const { return device_; }

 private:
  void Reset();

  CUmemGenericAllocationHandle handle_ = 0;
  bool has_handle_ = false;
  CUdeviceptr ptr_ = 0;  // reserved range; 0 = none
  bool mapped_ = false;
  int64_t size_ = 0;
  int device_ = -1;
};

}  // namespace kvdepot::gpu

#endif  // KVDEPOT_COMMON_CUDA_VMM_H_
