// The daemon's memory and kernel backend. The service validates every
// request first; a backend only allocates, maps and runs kernels on
// validated input. The CPU backend keeps pools and buffers in sealed memfds
// handed to clients as descriptors (SPEC §11) and runs the CPU reference;
// the CUDA backend keeps them in device memory, VMM allocations handed over
// as descriptors the same way (legacy CUDA IPC handles only when the
// operator opted in, --legacy_cuda_ipc), and launches
// the kernels (its pointers are then device addresses: inline request
// data, which is host memory, must be staged by the backend).
#ifndef KVDEPOT_SERVER_BACKEND_BACKEND_H_
#define KVDEPOT_SERVER_BACKEND_BACKEND_H_

#include <sys/types.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/unique_fd.h"
#include "kernels/format.h"
#include "kernels/fused.h"
#include "kernels/store_load.h"
#include "kvdepot/v1/kvdepot.pb.h"
#include "server/descriptors.h"

namespace kvdepot {

// A region of backend memory: a pool, a daemon-allocated buffer or an
// imported one. Released (unmapped, unlinked when owned) on destruction.
class Memory {
 public:
  virtual ~Memory() = default;
  // Base address in the backend's address space.
  virtual uint8_t* data() const = 0;
  virtual int64_t size() const = 0;
  // A new descriptor of this region to hand to a client (SCM_RIGHTS);
  // FAILED_PRECONDITION for memory that is not handed over by descriptor.
  virtual absl::StatusOr<UniqueFd> ExportFd() const {
    return absl::FailedPreconditionError(
        "this memory is not handed over by descriptor");
  }
  // Bytes a client maps from ExportFd() (>= size(); CUDA VMM allocations
  // are rounded up to the allocation granularity) and the device they live
  // on ("cpu" or "cuda:N").
  virtual int64_t fd_size() const { return size(); }
  virtual std::string device() const { return "cpu"; }
  // The legacy handle of this region (CUDA IPC; Backend::legacy_handles()).
  virtual void FillHandle(v1::SharedHandle* /*handle*/) const {}
};

struct BackendOptions {
  // CUDA: share memory by legacy CUDA IPC handles (bearer tokens, SPEC §11);
  // without it pools and buffers are VMM allocations handed over as
  // descriptors and handles are refused.
  bool legacy_cuda_ipc = false;
  // CUDA: the watchdog on a client's wait event (AwaitClientEvent): a
  // request whose event has not fired by then fails with
  // DEADLINE_EXCEEDED, nobody else's.
  absl::Duration cuda_wait_timeout = absl::Seconds(10);
  // CUDA: device memory kept free for others (the device budget is the
  // free memory at start minus this); < 0 = no device budget.
  int64_t cuda_memory_reserve_bytes = int64_t{1} << 30;
  // CUDA: host threads that wait for the GPU (stream and event
  // synchronization, a full launch queue) sleep on an interrupt instead of
  // spinning (cudaDeviceScheduleBlockingSync on every device's primary
  // context): a few microseconds more latency, no core burnt per waiter.
  bool cuda_blocking_sync = true;
  // CPU: the budget every pool's and buffer's memfd (allocated or
  // imported) is admitted against (server/descriptors.h); null = none.
  std::shared_ptr<DescriptorBudget> descriptors;
};

// GPU ordering of one Store or Load (SPEC §9; kvdepot.proto
// wait_event_ipc_handle and record_event).
struct GpuOrdering {
  // cudaIpcEventHandle_t bytes of a client event the kernels wait on;
  // empty = none.
  absl::string_view wait_event;
  // Record an interprocess event after the kernels and return without
  // waiting for them.
  bool record_event = false;
  // The caller's session number (0 = none): the CUDA backend queues each
  // session's work on its own stream.
  uint64_t session = 0;

  bool empty() const { return wait_event.empty() && !record_event; }
};

// The index operations of SPEC §7 on request memory (kvdepot.proto's
// buffer forms). Pointers are request memory: inline request or reply bytes
// (host) or buffer slices (backend memory), never validated entry by entry
// (they may be device memory, written by a worker's kernels); spans are host
// copies the service validated.
struct ConvertTopkCall {
  const int32_t* topk = nullptr;  // [batch][k]
  int32_t* slots = nullptr;       // [batch][k]; may equal topk (in place)
  int64_t batch = 0;
  int32_t k = 0;
  absl::Span<const int32_t> valid_count;  // [batch] in [0, k]
  absl::Span<const int32_t> num_tokens;   // [batch] >= 0
  const int32_t* block_table = nullptr;   // [batch][cols]; any entries
  int32_t cols = 0;
  int32_t block_size = 0;
  int32_t num_blocks = 0;
  uint8_t* invalid_word = nullptr;  // 8 bytes (int64 LE) or null
};

struct SwaDecodeCall {
  absl::Span<const int32_t> queries;  // [n][3] {state, start, valid_len}
  int32_t window = 0;
  int32_t ring_size = 0;
  int32_t* slots = nullptr;  // [n][window]
};

struct PrefillIndexCall {
  absl::Span<const int32_t> pivots;  // [rows][4], ComputeSwaPivots
  int64_t rows = 0;
  int32_t window = 0;
  const int32_t* compressed = nullptr;  // [rows][topk_k]; any entries
  int32_t topk_k = 0;
  int32_t compressed_rows = 0;  // entries outside [-1, this) -> -1, counted
  int32_t main_kv_offset = 0;
  int32_t* index = nullptr;         // [rows][window + topk_k]
  uint8_t* invalid_word = nullptr;  // 8 bytes (int64 LE) or null
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

  // Whether memory is shared by legacy handles (Memory::FillHandle and
  // Import) instead of descriptors.
  virtual bool legacy_handles() const { return false; }

  // Maps a client's allocation named by a legacy handle.
  virtual absl::StatusOr<std::unique_ptr<Memory>> Import(
      const v1::SharedHandle& /*handle*/) {
    return absl::FailedPreconditionError(absl::StrCat(
        "handle: the ", name(),
        " backend takes no named memory; hand a sealed memfd over on the "
        "companion socket (SPEC §11)"));
  }

  // Maps a client's memory of `size` bytes handed over as `fd` after
  // validating it, INVALID_ARGUMENT when it is not what it claims: a sealed
  // memfd on the CPU backend (ValidateMemfd), a CUDA VMM export (POSIX fd)
  // of at least `size` bytes, `size` a multiple of the allocation
  // granularity, on the CUDA backend.
  virtual absl::StatusOr<std::unique_ptr<Memory>> ImportFd(UniqueFd /*fd*/,
                                                           int64_t /*size*/) {
    return absl::FailedPreconditionError(
        absl::StrCat("the ", name(), " backend cannot import descriptors"));
  }

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

  // Store / Load ordered by GPU events: the kernels first wait on
  // ordering.wait_event; with ordering.record_event the backend records an
  // interprocess event after them, sets *recorded_event to its handle bytes
  // and returns without waiting for completion (else *recorded_event is
  // cleared). Backends without GPU events (CPU) reject a non-empty ordering
  // with INVALID_ARGUMENT before anything is written; these defaults do that
  // and otherwise call Store / Load.
  virtual absl::Status StoreOrdered(const PoolLayout& layout,
                                    const Memory& pool, int64_t layer,
                                    const void* kv, InputDtype dtype,
                                    absl::Span<const int32_t> slot_mapping,
                                    const GpuOrdering& ordering,
                                    std::string* recorded_event) {
    if (absl::Status s = RejectOrdering(ordering, recorded_event); !s.ok()) {
      return s;
    }
    return Store(layout, pool, layer, kv, dtype, slot_mapping);
  }
  virtual absl::Status LoadOrdered(const PoolLayout& layout, const Memory& pool,
                                   int64_t layer,
                                   absl::Span<const int32_t> segments,
                                   int64_t total_k, void* data, void* scales,
                                   const GpuOrdering& ordering,
                                   std::string* recorded_event) {
    if (absl::Status s = RejectOrdering(ordering, recorded_event); !s.ok()) {
      return s;
    }
    return Load(layout, pool, layer, segments, total_k, data, scales);
  }

  // PrefillLoad's cast-back (SPEC §6) on the backend's own engine: `n`
  // tokens of `kv` (format.elements() values of `dtype` each) through
  // `format`'s quantization and back, written to `out` as BF16 rows
  // (LoadDataRowBytes each), bit-exact with the CPU reference (encode,
  // decode, round to BF16). After the backend's earlier calls on the
  // memory involved, on ordering.session's stream; with
  // ordering.record_event it returns once queued (unless `out` is host
  // memory), else when done. ordering.wait_event must be empty (awaited
  // by the caller). UNIMPLEMENTED = the caller casts on the host (the CPU
  // backend, whose memory is host memory). REQUIRES: a do_cast format,
  // validated sizes.
  virtual absl::Status CastBack(const KVCacheFormat& /*format*/,
                                const void* /*kv*/, InputDtype /*dtype*/,
                                int64_t /*n*/, void* /*out*/,
                                const GpuOrdering& /*ordering*/) {
    return absl::UnimplementedError("cast-back on the host");
  }

  // Waits on the host, before anything of the call is queued, for a
  // client's event (GpuOrdering::wait_event bytes) that a call on `pool`
  // must follow, until `deadline` at most (a backend may cut it shorter
  // with its own watchdog): DEADLINE_EXCEEDED when it has not fired by
  // then (only this call fails; call it without holding the pool's lock),
  // INVALID_ARGUMENT when the bytes cannot be opened. Empty = OK at once.
  // Backends without GPU events refuse non-empty bytes.
  virtual absl::Status AwaitClientEvent(const Memory& /*pool*/,
                                        absl::string_view wait_event,
                                        absl::Time /*deadline*/) {
    if (wait_event.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("wait_event_ipc_handle: the ", name(),
                     " backend has no GPU events; leave it unset"));
  }

  // The fused store (SPEC §8) on layer `layer` of `pool`: kv is BF16
  // [slot_mapping.size()][elements]; params' arrays and cast_back (BF16
  // [n][elements] or null) are request memory like kv (the CUDA backend
  // stages host ones). REQUIRES: ValidateFused with the host copy of the
  // positions and ValidateSlotMapping passed. Completes before returning.
  virtual absl::Status StoreFused(const PoolLayout& /*layout*/,
                                  const Memory& /*pool*/, int64_t /*layer*/,
                                  const uint16_t* /*kv*/,
                                  const FusedParams& /*params*/,
                                  absl::Span<const int32_t> /*slot_mapping*/,
                                  uint16_t* /*cast_back*/) {
    return absl::UnimplementedError(
        absl::StrCat("fused: the ", name(), " backend has no fused store"));
  }

  // The index operations (SPEC §7) on the backend's device, ordered like
  // StoreOrdered (the client's event awaited on the host until `deadline`
  // at most, the caller's session stream, record_event: return at once with
  // *invalid = -1). *invalid = entries that became -1 because an index or
  // a table entry was out of range. `device_memory` is a Memory the call
  // runs next to (the pool, or the buffer of an output), for its device.
  // UNIMPLEMENTED (these defaults; a call with no operand in device memory)
  // = the service runs it on the host, the CPU backend's engine.
  virtual absl::Status ConvertTopkOrdered(const Memory& /*device_memory*/,
                                          const ConvertTopkCall& /*call*/,
                                          const GpuOrdering& /*ordering*/,
                                          absl::Time /*deadline*/,
                                          int64_t* /*invalid*/,
                                          std::string* /*recorded_event*/) {
    return absl::UnimplementedError("index operations on the host");
  }
  virtual absl::Status SwaDecodeOrdered(const Memory& /*device_memory*/,
                                        const SwaDecodeCall& /*call*/,
                                        const GpuOrdering& /*ordering*/,
                                        absl::Time /*deadline*/,
                                        std::string* /*recorded_event*/) {
    return absl::UnimplementedError("index operations on the host");
  }
  virtual absl::Status PrefillIndexOrdered(const Memory& /*device_memory*/,
                                           const PrefillIndexCall& /*call*/,
                                           const GpuOrdering& /*ordering*/,
                                           absl::Time /*deadline*/,
                                           int64_t* /*invalid*/,
                                           std::string* /*recorded_event*/) {
    return absl::UnimplementedError("index operations on the host");
  }

  // Copies `n` bytes between any two of: backend memory (Memory::data()
  // ranges) and host memory, after the backend's earlier calls on them
  // completed. For the host code that reads or writes request data (a
  // CUDA backend's buffers are device memory); the CPU backend's memory is
  // host memory, so the default is memcpy.
  virtual absl::Status CopyBytes(void* dst, const void* src, int64_t n) {
    if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n));
    return absl::OkStatus();
  }

 private:
  absl::Status RejectOrdering(const GpuOrdering& ordering,
                              std::string* recorded_event) const {
    if (recorded_event != nullptr) recorded_event->clear();
    if (ordering.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        ordering.wait_event.empty() ? "record_event" : "wait_event_ipc_handle",
        ": the ", name(), " backend has no GPU events; leave it unset"));
  }
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_BACKEND_BACKEND_H_
