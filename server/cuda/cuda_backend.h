// The CUDA backend of kvcached (SPEC §9): pools and buffers are device
// memory exported by CUDA IPC handles, client allocations are imported by
// handle, and Store/Load run the kernels of //kernels/cuda on a stream per
// pool.
//
// Operands: a pointer inside a daemon allocation or an import (a buffer
// slice) is used in place when the kernel's alignment allows (16 bytes for
// K/V rows, 4 for scales) and staged through device scratch otherwise;
// anything else is host memory (inline request or reply bytes) and is
// staged through pinned memory. Request arrays (slot mappings, segments)
// are host copies the service validated and are always staged.
//
// Completion: without GPU ordering a call returns after its work finished
// (cudaStreamSynchronize), so the reply means "done". With
// GpuOrdering::record_event it records the pool's interprocess event after
// the work and returns at once (unless an output is host memory, which
// must be copied back first); the client waits on the event.
#ifndef KVCACHED_SERVER_CUDA_CUDA_BACKEND_H_
#define KVCACHED_SERVER_CUDA_CUDA_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/backend.h"

namespace kvcache {

// GPU ordering of one request (kvcache.proto wait_event_ipc_handle and
// record_event).
struct CudaOrdering {
  // cudaIpcEventHandle_t bytes of a client event the kernels wait on
  // (cudaStreamWaitEvent); empty = none.
  absl::string_view wait_event;
  // Record an interprocess event after the kernels and return without
  // waiting for them.
  bool record_event = false;
};

// The CUDA device count, or FAILED_PRECONDITION naming the CUDA error (no
// driver, no device).
absl::StatusOr<int> CudaDeviceCount();

// The CUDA backend, or FAILED_PRECONDITION when no CUDA device is visible.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(
    const BackendOptions& options);

// Store/Load with GPU ordering on a backend made by MakeCudaBackend (the
// Backend methods are these with no ordering). *recorded_event receives the
// event's cudaIpcEventHandle_t bytes when ordering.record_event, and is
// cleared otherwise. INVALID_ARGUMENT naming `wait_field` when the wait
// handle is malformed or cannot be opened (nothing is written then);
// INTERNAL when `backend` is not a CUDA backend.
absl::Status CudaStoreOrdered(Backend* backend, const PoolLayout& layout,
                              const Memory& pool, int64_t layer, const void* kv,
                              InputDtype dtype,
                              absl::Span<const int32_t> slot_mapping,
                              absl::string_view wait_field,
                              const CudaOrdering& ordering,
                              std::string* recorded_event);
absl::Status CudaLoadOrdered(Backend* backend, const PoolLayout& layout,
                             const Memory& pool, int64_t layer,
                             absl::Span<const int32_t> segments,
                             int64_t total_k, void* data, void* scales,
                             absl::string_view wait_field,
                             const CudaOrdering& ordering,
                             std::string* recorded_event);

}  // namespace kvcache

#endif  // KVCACHED_SERVER_CUDA_CUDA_BACKEND_H_
