// CUDA IPC memory mappings: memory that another process allocated with
// cudaMalloc and exported with cudaIpcGetMemHandle (kvdepot.proto
// SharedHandle.cuda_ipc_handle), mapped into this process.
//
// A process may open a given IPC handle only once, so mappings are cached
// per handle (its 64 bytes) and reference-counted: opening the same handle
// twice returns the same base address, and the handle is closed
// (cudaIpcCloseMemHandle) when the last CudaIpcMapping of it is destroyed.
//
//   allocation base (handle)                       base + handle.size
//   |<- handle.offset ->|<------ size() ------>|...|
//                       data()
#ifndef KVDEPOT_COMMON_CUDA_CUDA_MAPPINGS_H_
#define KVDEPOT_COMMON_CUDA_CUDA_MAPPINGS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvdepot/v1/kvdepot.pb.h"

namespace kvdepot {

// Bytes of a cudaIpcMemHandle_t / cudaIpcEventHandle_t (checked against the
// CUDA headers in the .cc files).
inline constexpr size_t kCudaIpcHandleBytes = 64;

// Makes `device` current for the calling thread and restores the previous
// device on destruction. Move-only.
class ScopedCudaDevice {
 public:
  static absl::StatusOr<ScopedCudaDevice> Enter(int device);

  ScopedCudaDevice(ScopedCudaDevice&& other) noexcept;
  ScopedCudaDevice& operator=(ScopedCudaDevice&&) = delete;
  ScopedCudaDevice(const ScopedCudaDevice&) = delete;
  ~ScopedCudaDevice();

 private:
  explicit ScopedCudaDevice(int previous) : previous_(previous) {}
  int previous_ = -1;  // -1 = nothing to restore
};

// Checks a SharedHandle that names CUDA memory: kind cuda_ipc_handle of
// kCudaIpcHandleBytes bytes, device_ordinal in [0, device_count), size > 0,
// offset in [0, size). Messages name `field` ("handle").
absl::Status ValidateCudaHandle(absl::string_view field,
                                const v1::SharedHandle& handle,
                                int device_count);

// One mapping of another process's CUDA allocation. Move-only RAII.
class CudaIpcMapping {
 public:
  // Validates `handle` (ValidateCudaHandle), opens it on device
  // handle.device_ordinal (or reuses this process's open mapping of it) and
  // checks that handle.size fits the allocation the driver reports, so a
  // wrong size cannot make anyone access memory outside it.
  static absl::StatusOr<CudaIpcMapping> Open(const v1::SharedHandle& handle);

  CudaIpcMapping(CudaIpcMapping&& other) noexcept;
  CudaIpcMapping& operator=(CudaIpcMapping&& other) noexcept;
  CudaIpcMapping(const CudaIpcMapping&) = delete;
  CudaIpcMapping& operator=(const CudaIpcMapping&) = delete;
  ~CudaIpcMapping();

  // Allocation base in this process (device address).
  uint8_t* base() const { return base_; }
  // The region the handle names: base() + offset, size - offset bytes.
  uint8_t* data() const { return base_ + offset_; }
  int64_t size() const { return size_; }
  int device() const { return device_; }

  // Number of CudaIpcMapping objects sharing the mapping of `handle_bytes`
  // in this process (0 = not open). For tests and diagnostics.
  static int RefCount(absl::string_view handle_bytes);

 private:
  CudaIpcMapping(std::string key, uint8_t* base, int64_t offset, int64_t size,
                 int device)
      : key_(std::move(key)),
        base_(base),
        offset_(offset),
        size_(size),
        device_(device) {}
  void Release();

  std::string key_;          // the handle's bytes; empty = moved from
  uint8_t* base_ = nullptr;  // mapping base
  int64_t offset_ = 0;       // region start inside the mapping
  int64_t size_ = 0;         // region bytes
  int device_ = -1;          // device the mapping was opened on
};

}  // namespace kvdepot

#endif  // KVDEPOT_COMMON_CUDA_CUDA_MAPPINGS_H_
