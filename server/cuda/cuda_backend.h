// The CUDA backend of kvdepot (SPEC §9, §11): pools and buffers are CUDA
// VMM allocations handed to clients as POSIX descriptors on the companion
// socket, client allocations are VMM descriptors imported and validated
// (ImportFd); with --legacy_cuda_ipc pools and buffers are cudaMallocs
// exported by CUDA IPC handles and client handles are imported. Store/Load
// run the kernels of //kernels/cuda on the calling session's stream
// (SessionStreams), ordered after earlier work on the same pool by the
// pool's UseFence (events of the daemon's own streams). Nothing ever
// synchronizes the device: a call that must finish before its reply waits
// for its own work (its call event, call_events.h).
//
// Hazards designed out (GPU_HOST.md, SPEC §10): the backend refuses to
// start unless CUDA_MODULE_LOADING=EAGER and CUDA_DEVICE_MAX_CONNECTIONS
// is unset or >= 8 (server/backend/cuda_env.h); a client's wait event is
// awaited on the host (AwaitClientEvent: cudaEventQuery polls, before the
// pool's lock and before anything is queued) with a watchdog
// (BackendOptions::cuda_wait_timeout), so an event that never fires fails
// only its own request with DEADLINE_EXCEEDED; pools and buffers are
// admitted against a device budget (free memory at start minus
// --cuda_memory_reserve_bytes), RESOURCE_EXHAUSTED when they do not fit.
//
// Operands: a pointer inside a daemon allocation or an import (a buffer
// slice) is used in place when the kernel's alignment allows (16 bytes for
// K/V rows, 4 for scales) and staged through device scratch otherwise;
// anything else is host memory (inline request or reply bytes) and is
// staged through pinned memory. Request arrays (slot mappings, segments)
// are host copies the service validated and are always staged.
//
// Completion (Backend::StoreOrdered / LoadOrdered): without GPU ordering a
// call returns after its work finished, so the reply means "done".
// GpuOrdering::wait_event is opened (cudaIpcOpenEventHandle) and awaited
// on the host before any of the call's work is queued; a handle that is
// malformed or cannot be opened fails the call with INVALID_ARGUMENT
// naming wait_event_ipc_handle before anything is queued. With
// GpuOrdering::record_event the call records its stream's interprocess
// event after the work and returns at once (unless an output is host
// memory, which must be copied back first); the client waits on the
// event.
#ifndef KVDEPOT_SERVER_CUDA_CUDA_BACKEND_H_
#define KVDEPOT_SERVER_CUDA_CUDA_BACKEND_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/backend/backend.h"

namespace kvdepot {

// The CUDA device count, or FAILED_PRECONDITION naming the CUDA error (no
// driver, no device).
absl::StatusOr<int> CudaDeviceCount();

// The CUDA backend, or FAILED_PRECONDITION when no CUDA device is visible.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(
    const BackendOptions& options);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_CUDA_CUDA_BACKEND_H_
