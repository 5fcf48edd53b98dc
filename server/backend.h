// The daemon's memory and kernel backend. The service validates every
// request first; a backend only allocates, maps and runs kernels on
// validated input. The CPU backend keeps pools and buffers in POSIX shared
// memory and runs the CPU reference; a CUDA backend would keep them in
// device memory exported through CUDA IPC handles and launch the kernels
// (its pointers are then device addresses: inline request data, which is
// host memory, must be staged by the backend).
#ifndef KVCACHED_SERVER_BACKEND_H_
#define KVCACHED_SERVER_BACKEND_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/format.h"
#include "kernels/reference.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvcache {

// A region of backend memory: a pool, a daemon-allocated buffer or an
// imported one. Released (unmapped, unlinked when owned) on destruction.
class Memory {
 public:
  virtual ~Memory() = default;
  // Base address in the backend's address space.
  virtual uint8_t* data() const = 0;
  virtual int64_t size() const = 0;
  // How another process maps this region.
  virtual void FillHandle(v1::SharedHandle* handle) const = 0;
};

struct BackendOptions {
  mode_t shm_mode = 0600;  // permission bits of shm objects (CPU)
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu" or "cuda".
  virtual absl::string_view name() const = 0;

  // Canonical device for a pool request ("" = default); INVALID_ARGUMENT
  // when the backend has no such device.
  virtual absl::StatusOr<std::string> ResolveDevice(
      absl::string_view requested) const = 0;

  // Zero-filled memory of `size` > 0 bytes on `device` (ResolveDevice'd).
  virtual absl::StatusOr<std::unique_ptr<Memory>> Allocate(
      int64_t size, absl::string_view device) = 0;

  // Maps a client's allocation.
  virtual absl::StatusOr<std::unique_ptr<Memory>> Import(
      const v1::SharedHandle& handle) = 0;

  // SPEC §4 on layer `layer` of `pool`. REQUIRES: validated input; kv holds
  // slot_mapping.size() * elements values of `dtype`.
  virtual absl::Status Store(const PoolLayout& layout, const Memory& pool,
                             int64_t layer, const void* kv, InputDtype dtype,
                             absl::Span<const int32_t> slot_mapping) = 0;

  // SPEC §5 from layer `layer` of `pool`. REQUIRES: validated plan; data
  // holds total_k * LoadDataRowBytes, scales total_k * LoadScaleRowBytes
  // (null for do_cast formats).
  virtual absl::Status Load(const PoolLayout& layout, const Memory& pool,
                            int64_t layer, absl::Span<const int32_t> segments,
                            int64_t total_k, void* data, void* scales) = 0;
};

// Builds a backend: kind "auto" (CUDA when a GPU is visible, else CPU),
// "cpu" or "cuda". This build has no CUDA backend yet: "auto" picks CPU and
// "cuda" fails with UNIMPLEMENTED.
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(
    absl::string_view kind, const BackendOptions& options);

}  // namespace kvcache

#endif  // KVCACHED_SERVER_BACKEND_H_
