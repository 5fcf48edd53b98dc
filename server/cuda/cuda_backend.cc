#include "server/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/cuda/cuda_events.h"
#include "common/cuda/cuda_mappings.h"
#include "common/cuda/cuda_status.h"
#include "common/status_macros.h"
#include "kernels/cuda/kernels.h"
#include "kernels/format_host.h"
#include "kernels/store_load_host.h"
#include "server/backend/cuda_env.h"
#include "server/cuda/call_events.h"
#include "server/cuda/cuda_fused.h"
#include "server/cuda/cuda_memory.h"
#include "server/cuda/device_budget.h"
#include "server/cuda/devices.h"
#include "server/cuda/session_streams.h"
#include "server/cuda/staging.h"
#include "spdlog/spdlog.h"

namespace kvdepot {
namespace {

// The request field of GpuOrdering::wait_event (kvdepot.proto).
constexpr absl::string_view kWaitField = "wait_event_ipc_handle";

// Where a kernel operand lives.
enum class Where {
  kDevice,        // usable in place
  kStagedDevice,  // device memory, misaligned: copied through scratch
  kHost,          // host memory: copied through pinned + device scratch
};

struct Operand {
  uint8_t* ptr = nullptr;  // the caller's pointer
  int64_t bytes = 0;
  Where where = Where::kDevice;
  int64_t offset = 0;           // inside the Staging when not kDevice
  std::shared_ptr<void> fence;  // UseFence of the memory it lies in
};

// What a call queued, so that a failure can drain the stream before the
// Staging is reused.
struct Queued {
  cudaStream_t stream = nullptr;
  ~Queued() {
    if (stream != nullptr) (void)cudaStreamSynchronize(stream);
  }
};

absl::Status LegacyIpcRequired() {
  return absl::FailedPreconditionError(
      "handle: legacy CUDA IPC handles are bearer tokens (anyone who sees one "
      "can open the memory; SPEC §11) and are accepted only when kvdepotd "
      "runs with --legacy_cuda_ipc; hand a CUDA VMM allocation over as a "
      "descriptor on the companion socket instead (import_buffer)");
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device_count, const BackendOptions& options,
              std::shared_ptr<DeviceBudget> budget)
      : device_count_(device_count),
        legacy_ipc_(options.legacy_cuda_ipc),
        wait_timeout_(options.cuda_wait_timeout),
        budget_(std::move(budget)),
        ranges_(std::make_shared<DeviceRanges>()) {}

  absl::string_view name() const override { return "cuda"; }

  // Pools and buffers are VMM allocations handed over as descriptors
  // (SPEC §11); legacy CUDA IPC handles only when the operator opted in.
  bool legacy_handles() const override { return legacy_ipc_; }

  absl::StatusOr<std::string> ResolveDevice(
      absl::string_view requested) const override {
    absl::StatusOr<int> d = ParseCudaDevice("device", requested, device_count_);
    if (!d.ok()) return d.status();
    return CudaDeviceName(*d);
  }

  absl::StatusOr<std::unique_ptr<Memory>> Allocate(
      int64_t size, absl::string_view device) override {
    absl::StatusOr<int> d = ParseCudaDevice("device", device, device_count_);
    if (!d.ok()) return d.status();
    // The device budget first: a pool that does not fit fails here, with
    // how much is available, before any device memory is taken.
    absl::StatusOr<int64_t> rounded = RoundUpAllocation(size);
    if (!rounded.ok()) return rounded.status();
    absl::StatusOr<std::shared_ptr<void>> token =
        budget_->Reserve(*d, *rounded);
    if (!token.ok()) return token.status();
    absl::StatusOr<std::unique_ptr<CudaAllocation>> m =
        CudaAllocation::Create(size, *d, ranges_, legacy_ipc_);
    if (!m.ok()) return m.status();
    (*m)->HoldBudget(*std::move(token));
    return std::unique_ptr<Memory>(*std::move(m));
  }

  absl::StatusOr<std::unique_ptr<Memory>> Import(
      const v1::SharedHandle& handle) override {
    if (!legacy_ipc_) return LegacyIpcRequired();
    RETURN_IF_ERROR(ValidateCudaHandle("handle", handle, device_count_));
    if (ranges_->IsExported(handle.cuda_ipc_handle())) {
      return absl::InvalidArgumentError(
          "handle.cuda_ipc_handle names memory this daemon allocated (a pool "
          "or buffer); address it by its buffer id instead");
    }
    absl::StatusOr<std::unique_ptr<CudaImport>> m =
        CudaImport::Open(handle, ranges_);
    if (!m.ok()) return m.status();
    return std::unique_ptr<Memory>(*std::move(m));
  }

  // A client's VMM allocation (CudaVmmImport::Open validates it).
  absl::StatusOr<std::unique_ptr<Memory>> ImportFd(UniqueFd fd,
                                                   int64_t size) override {
    absl::StatusOr<std::unique_ptr<CudaVmmImport>> m =
        CudaVmmImport::Open(std::move(fd), size, device_count_, ranges_);
    if (!m.ok()) return m.status();
    return std::unique_ptr<Memory>(*std::move(m));
  }

  absl::Status Store(const PoolLayout& layout, const Memory& pool,
                     int64_t layer, const void* kv, InputDtype dtype,
                     absl::Span<const int32_t> slot_mapping) override {
    return StoreOrdered(layout, pool, layer, kv, dtype, slot_mapping, {},
                        nullptr);
  }

  absl::Status Load(const PoolLayout& layout, const Memory& pool, int64_t layer,
                    absl::Span<const int32_t> segments, int64_t total_k,
                    void* data, void* scales) override {
    return LoadOrdered(layout, pool, layer, segments, total_k, data, scales, {},
                       nullptr);
  }

  // cudaMemcpyDefault: with unified addressing the runtime tells device
  // from host pointers. Calls that returned without waiting (record_event)
  // may still be running on their pools' streams, which the copy (legacy
  // stream; the daemon's streams are non-blocking) does not follow: first
  // wait for the work recorded on the UseFence of the memory each side lies
  // in (never for the whole device).
  absl::Status CopyBytes(void* dst, const void* src, int64_t n) override {
    if (n <= 0) return absl::OkStatus();
    for (const void* p : {static_cast<const void*>(dst), src}) {
      absl::StatusOr<std::optional<DeviceRanges::Range>> r =
          ranges_->Find(p, n);
      if (!r.ok()) return r.status();
      if (r->has_value() && FenceOf(**r) != nullptr) {
        RETURN_IF_ERROR(FenceOf(**r)->Wait());
      }
    }
    // On the daemon's own copy stream of the device the memory lies on,
    // waiting for that stream only (never the legacy stream or the
    // device).
    int device = -1;
    for (const void* p : {static_cast<const void*>(dst), src}) {
      absl::StatusOr<std::optional<DeviceRanges::Range>> r =
          ranges_->Find(p, n);
      if (r.ok() && r->has_value()) device = (*r)->device;
    }
    if (device < 0) {
      std::memcpy(dst, src, static_cast<size_t>(n));
      return absl::OkStatus();
    }
    absl::StatusOr<ScopedCudaDevice> scoped = ScopedCudaDevice::Enter(device);
    if (!scoped.ok()) return scoped.status();
    absl::StatusOr<SessionStream*> copy = copy_streams_.For(device, 0);
    if (!copy.ok()) return copy.status();
    absl::MutexLock lock(&copy_mu_);
    RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(dst, src, static_cast<size_t>(n),
                                         cudaMemcpyDefault, (*copy)->stream()),
                         "copying request bytes (cudaMemcpyDefault)");
    RETURN_IF_CUDA_ERROR(cudaStreamSynchronize((*copy)->stream()),
                         "copying request bytes (the daemon's copy stream)");
    return absl::OkStatus();
  }

  // The client's event, awaited on the host (never by a stream: a GPU-side
  // wait on another process's event cannot be released; GPU_HOST.md), at
  // most until the earlier of `deadline` and the watchdog.
  absl::Status AwaitClientEvent(const Memory& pool, absl::string_view bytes,
                                absl::Time deadline) override {
    if (bytes.empty()) return absl::OkStatus();
    absl::StatusOr<CudaAllocation*> mem = AsAllocation(pool);
    if (!mem.ok()) return mem.status();
    return AwaitOnDevice((*mem)->device_ordinal(), bytes, deadline);
  }

  absl::Status CastBack(const KVCacheFormat& format, const void* kv,
                        InputDtype dtype, int64_t n, void* out,
                        const GpuOrdering& ordering) override;

  absl::Status StoreOrdered(const PoolLayout& layout, const Memory& pool,
                            int64_t layer, const void* kv, InputDtype dtype,
                            absl::Span<const int32_t> slot_mapping,
                            const GpuOrdering& ordering,
                            std::string* recorded_event) override;

  absl::Status StoreFused(const PoolLayout& layout, const Memory& pool,
                          int64_t layer, const uint16_t* kv,
                          const FusedParams& params,
                          absl::Span<const int32_t> slot_mapping,
                          uint16_t* cast_back) override {  // cuda_fused.cc
    absl::StatusOr<CudaAllocation*> mem = AsAllocation(pool);
    if (!mem.ok()) return mem.status();
    const int device = (*mem)->device_ordinal();
    absl::StatusOr<ScopedCudaDevice> scoped = ScopedCudaDevice::Enter(device);
    if (!scoped.ok()) return scoped.status();
    // Sessionless stream 0, ordered after earlier work on the pool; later
    // calls on the pool queue after this one through its fence.
    absl::StatusOr<SessionStream*> stream = StreamFor(*mem, device, 0);
    if (!stream.ok()) return stream.status();
    cudaStream_t st = (*stream)->stream();
    // The operands' memory (request buffers; inline bytes have no fence):
    // after the daemon's earlier work on it, and noted for later calls.
    const int64_t n = static_cast<int64_t>(slot_mapping.size());
    const int64_t row_bytes = 2 * int64_t{layout.format.elements()};
    const bool rope = params.rope != RopeStyle::kNone;
    const std::pair<const void*, int64_t> spans[] = {
        {kv, n * row_bytes},
        {cast_back, cast_back != nullptr ? n * row_bytes : 0},
        {params.norm_weight,
         params.norm() ? 2 * int64_t{params.norm_end - params.norm_begin} : 0},
        {params.positions, rope ? 8 * n : 0},
        {params.cos_sin, rope ? 4 * params.max_position * params.rope_dim : 0}};
    std::vector<std::shared_ptr<void>> fences;
    for (const auto& [p, bytes] : spans) {
      if (p == nullptr || bytes == 0) continue;
      absl::StatusOr<std::optional<DeviceRanges::Range>> r =
          ranges_->Find(p, bytes);
      if (!r.ok()) return r.status();
      if (!r->has_value() || (*r)->fence == nullptr) continue;
      RETURN_IF_ERROR(
          static_cast<UseFence*>((*r)->fence.get())->OrderAfter(st));
      fences.push_back((*r)->fence);
    }
    absl::Status s = CudaStoreFused(st, layout, pool, layer, kv, params,
                                    slot_mapping, cast_back);
    if ((*mem)->fence() != nullptr || !fences.empty()) {
      absl::StatusOr<CallEvent> done = call_events_.Record(device, st);
      if (done.ok()) {
        if ((*mem)->fence() != nullptr) {
          static_cast<UseFence*>((*mem)->fence().get())->Note(st, *done);
        }
        for (const std::shared_ptr<void>& fence : fences) {
          static_cast<UseFence*>(fence.get())->Note(st, *done);
        }
      } else if (s.ok()) {
        s = done.status();
      }
    }
    return s;
  }

  absl::Status LoadOrdered(const PoolLayout& layout, const Memory& pool,
                           int64_t layer, absl::Span<const int32_t> segments,
                           int64_t total_k, void* data, void* scales,
                           const GpuOrdering& ordering,
                           std::string* recorded_event) override;

  // The index operations (SPEC §7) on the kernels of //kernels/cuda.
  absl::Status ConvertTopkOrdered(const Memory& device_memory,
                                  const ConvertTopkCall& call,
                                  const GpuOrdering& ordering,
                                  absl::Time deadline, int64_t* invalid,
                                  std::string* recorded_event) override;
  absl::Status SwaDecodeOrdered(const Memory& device_memory,
                                const SwaDecodeCall& call,
                                const GpuOrdering& ordering,
                                absl::Time deadline,
                                std::string* recorded_event) override;
  absl::Status PrefillIndexOrdered(const Memory& device_memory,
                                   const PrefillIndexCall& call,
                                   const GpuOrdering& ordering,
                                   absl::Time deadline, int64_t* invalid,
                                   std::string* recorded_event) override;

 private:
  // An int32 array of an index call: read from `src` and/or written to
  // `dst` (request memory, host or device). RunIndex sets `dev`, where the
  // kernels find it: in place when aligned device memory, else staged.
  struct IndexArray {
    const void* src = nullptr;
    void* dst = nullptr;
    int64_t bytes = 0;
    absl::string_view field;
    void* dev = nullptr;
  };
  // What RunIndex hands the op's launches: the host-computed arrays
  // (uploaded), device-only scratch and the zeroed invalid counter.
  struct IndexDevice {
    cudaStream_t stream = nullptr;
    uint8_t* fixed = nullptr;
    uint8_t* scratch = nullptr;
    unsigned long long* counter = nullptr;
  };
  // Runs an index call on the device of `device_memory`: awaits the
  // client's event on the host, stages `fixed_bytes` of host arrays that
  // `fill` writes (into pinned memory) and the arrays not usable in place,
  // then `launch`es on the session's stream after the earlier work on
  // every buffer involved, copies the outputs (and the counter into
  // `invalid_word`) back and finishes like Store/Load. UNIMPLEMENTED when
  // no operand is in device memory (the host does it better).
  absl::Status RunIndex(
      const Memory& device_memory, absl::Span<IndexArray> arrays,
      int64_t fixed_bytes, int64_t scratch_bytes,
      const std::function<void(uint8_t*)>& fill,
      const std::function<absl::Status(const IndexDevice&)>& launch,
      uint8_t* invalid_word, const GpuOrdering& ordering, absl::Time deadline,
      int64_t* invalid, std::string* recorded_event);

  absl::Status AwaitOnDevice(int device, absl::string_view bytes,
                             absl::Time deadline) const {
    if (bytes.empty()) return absl::OkStatus();
    absl::StatusOr<ScopedCudaDevice> scoped = ScopedCudaDevice::Enter(device);
    if (!scoped.ok()) return scoped.status();
    absl::StatusOr<std::optional<CudaIpcEvent>> wait =
        OpenWaitEvent(kWaitField, bytes, device);
    if (!wait.ok()) return wait.status();
    return (*wait)->AwaitOnHost(
        kWaitField, std::min(deadline, absl::Now() + wait_timeout_));
  }

  absl::StatusOr<CudaAllocation*> AsAllocation(const Memory& pool) const {
    auto* m = dynamic_cast<const CudaAllocation*>(&pool);
    if (m == nullptr) {
      return absl::InternalError(
          "the pool's memory was not allocated by the CUDA backend");
    }
    return const_cast<CudaAllocation*>(m);
  }

  // Classifies `p` (`bytes` long) for a kernel on `device` that needs
  // `alignment`; `field` names the request field in messages.
  absl::StatusOr<Operand> Classify(const void* p, int64_t bytes, int device,
                                   uintptr_t alignment,
                                   absl::string_view field) const {
    Operand op;
    op.ptr = static_cast<uint8_t*>(const_cast<void*>(p));
    op.bytes = bytes;
    if (bytes == 0) return op;
    absl::StatusOr<std::optional<DeviceRanges::Range>> r =
        ranges_->Find(p, bytes);
    if (!r.ok()) return r.status();
    if (!r->has_value()) {
      op.where = Where::kHost;
    } else if ((*r)->device != device) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " is a buffer on cuda:", (*r)->device,
                       " but the pool is on cuda:", device,
                       "; use a buffer on the pool's device"));
    } else if (reinterpret_cast<uintptr_t>(p) % alignment != 0) {
      op.where = Where::kStagedDevice;
    }
    if (r->has_value()) op.fence = (*r)->fence;
    return op;
  }

  // Opens the client's wait event (INVALID_ARGUMENT when it cannot be).
  absl::StatusOr<std::optional<CudaIpcEvent>> OpenWaitEvent(
      absl::string_view field, absl::string_view bytes, int device) const {
    if (bytes.empty()) return std::optional<CudaIpcEvent>();
    absl::StatusOr<CudaIpcEvent> e = CudaIpcEvent::Open(field, bytes, device);
    if (!e.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": cannot open the client's event: ", e.status().message()));
    }
    return std::optional<CudaIpcEvent>(*std::move(e));
  }

  // Records the call's event (one record, shared by the staging and the
  // fences), returns the stream's interprocess event or synchronizes (SPEC
  // §9), then copies host outputs back from pinned memory.
  // `device_operands` are the call's operands in device memory: with
  // record_event their memory's UseFence (and the pool's) notes the call's
  // event, so that releasing or reading it waits for this call.
  absl::Status Finish(int device, CudaAllocation* mem, SessionStream* stream,
                      StagingPool::Lease& lease, Queued& queued,
                      const GpuOrdering& ordering,
                      absl::Span<const Operand> host_outputs,
                      absl::Span<const Operand* const> device_operands,
                      std::string* recorded_event) {
    cudaStream_t st = stream->stream();
    ASSIGN_OR_RETURN(CallEvent done, call_events_.Record(device, st));
    lease->MarkUsed(done);
    // Later calls on this pool, on any session's stream, queue after this.
    if (mem != nullptr && mem->fence() != nullptr) {
      static_cast<UseFence*>(mem->fence().get())->Note(st, done);
    }
    if (ordering.record_event) {
      absl::StatusOr<std::string> handle = stream->RecordEvent();
      if (!handle.ok()) return handle.status();
      if (recorded_event != nullptr) *recorded_event = *std::move(handle);
    }
    // Also when this call waits below: a call on another stream that
    // arrives meanwhile queues behind this one (OrderAfterOperands).
    for (const Operand* op : device_operands) {
      if (op->fence != nullptr) {
        static_cast<UseFence*>(op->fence.get())->Note(st, done);
      }
    }
    if (!ordering.record_event || !host_outputs.empty()) {
      // This call's work only (its event), not its stream's.
      RETURN_IF_ERROR(lease->WaitUsed());
      for (const Operand& op : host_outputs) {
        std::memcpy(op.ptr, lease->host() + op.offset,
                    static_cast<size_t>(op.bytes));
      }
    }
    queued.stream = nullptr;  // done, or ordered by the recorded event
    return absl::OkStatus();
  }

  // The session's stream, ordered after earlier work on the pool (other
  // streams' recorded points: the daemon's own work only).
  absl::StatusOr<SessionStream*> StreamFor(CudaAllocation* mem, int device,
                                           uint64_t session) {
    absl::StatusOr<SessionStream*> s = streams_.For(device, session);
    if (!s.ok()) return s.status();
    if (mem->fence() != nullptr) {
      RETURN_IF_ERROR(static_cast<UseFence*>(mem->fence().get())
                          ->OrderAfter((*s)->stream()));
    }
    return s;
  }

  // Orders `stream` after the daemon's earlier work on the memory of each
  // device operand (its UseFence), as RunIndex and CastBack do: a call
  // that reads a buffer another session's stream still writes, or writes
  // one still being read there, queues behind that work.
  static absl::Status OrderAfterOperands(
      cudaStream_t stream, std::initializer_list<const Operand*> ops) {
    for (const Operand* op : ops) {
      if (op->fence != nullptr) {
        RETURN_IF_ERROR(
            static_cast<UseFence*>(op->fence.get())->OrderAfter(stream));
      }
    }
    return absl::OkStatus();
  }

  const int device_count_;
  const bool legacy_ipc_;
  const absl::Duration wait_timeout_;
  const std::shared_ptr<DeviceBudget> budget_;
  const std::shared_ptr<DeviceRanges> ranges_;
  CallEvents call_events_;  // one event per call, shared by what it used
  StagingPool staging_;
  SessionStreams streams_;
  SessionStreams copy_streams_;  // CopyBytes: one per device
  absl::Mutex copy_mu_;
};

// The cast-back as the kernels do it: the chunk stored into a scratch
// layer of blocks of kCastBackBlock tokens (slots 0..n-1), then loaded back
// as BF16 rows (a do_cast load decodes), both on the GPU; bit-exact with
// the CPU reference because Store and LoadSegments are.
absl::Status CudaBackend::CastBack(const KVCacheFormat& f, const void* kv,
                                   InputDtype dtype, int64_t n, void* out,
                                   const GpuOrdering& ordering) {
  constexpr int64_t kCastBackBlock = 64;
  if (n <= 0) return absl::OkStatus();
  const int64_t kv_bytes =
      n * f.elements() * (dtype == InputDtype::kFP32 ? 4 : 2);
  const int64_t out_bytes = n * LoadDataRowBytes(f);
  // The device: where either side lives; both host = nothing to gain.
  int device = -1;
  for (auto [p, bytes] : {std::pair<const void*, int64_t>{kv, kv_bytes},
                          std::pair<const void*, int64_t>{out, out_bytes}}) {
    absl::StatusOr<std::optional<DeviceRanges::Range>> r =
        ranges_->Find(p, bytes);
    if (!r.ok()) return r.status();
    if (r->has_value() && device < 0) device = (*r)->device;
  }
  if (device < 0) return Backend::CastBack(f, kv, dtype, n, out, ordering);
  if (!ordering.wait_event.empty()) {
    return absl::InternalError("CastBack: the caller awaits wait_event");
  }
  absl::StatusOr<ScopedCudaDevice> scoped = ScopedCudaDevice::Enter(device);
  if (!scoped.ok()) return scoped.status();
  const int64_t blocks = (n + kCastBackBlock - 1) / kCastBackBlock;
  absl::StatusOr<PoolLayout> layout =
      MakePoolLayout(f, kCastBackBlock, blocks, 1);
  if (!layout.ok()) return layout.status();
  absl::StatusOr<Operand> kv_op =
      Classify(kv, kv_bytes, device, 16, "chunk_kv");
  if (!kv_op.ok()) return kv_op.status();
  absl::StatusOr<Operand> out_op =
      Classify(out, out_bytes, device, 16, "output");
  if (!out_op.ok()) return out_op.status();
  // Staging: [slots | segments | scratch layer | kv | out] (the last two
  // when not used in place).
  const int64_t slots_bytes = n * 4;
  const int64_t segs_bytes = blocks * 4 * 4;
  const int64_t segs_at = StagingRound(slots_bytes);
  const int64_t layer_at = segs_at + StagingRound(segs_bytes);
  int64_t staged = layer_at + StagingRound(layout->total_bytes);
  for (Operand* op : {&*kv_op, &*out_op}) {
    if (op->where != Where::kDevice) {
      op->offset = staged;
      staged += StagingRound(op->bytes);
    }
  }
  absl::StatusOr<StagingPool::Lease> lease = staging_.Acquire(device, staged);
  if (!lease.ok()) return lease.status();
  absl::StatusOr<SessionStream*> stream =
      streams_.For(device, ordering.session);
  if (!stream.ok()) return stream.status();
  cudaStream_t st = (*stream)->stream();
  // After earlier work on the chunk's and the output's memory.
  RETURN_IF_ERROR(OrderAfterOperands(st, {&*kv_op, &*out_op}));
  Queued queued{st};
  uint8_t* host = (*lease)->host();
  uint8_t* dev = (*lease)->dev();
  auto* slots = reinterpret_cast<int32_t*>(host);
  for (int64_t i = 0; i < n; ++i) slots[i] = static_cast<int32_t>(i);
  auto* segs = reinterpret_cast<int32_t*>(host + segs_at);
  for (int64_t b = 0; b < blocks; ++b) {
    segs[4 * b] = static_cast<int32_t>(b);
    segs[4 * b + 1] = 0;
    segs[4 * b + 2] =
        static_cast<int32_t>(std::min(kCastBackBlock, n - b * kCastBackBlock));
    segs[4 * b + 3] = static_cast<int32_t>(b * kCastBackBlock);
  }
  RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(dev, host, static_cast<size_t>(layer_at),
                                       cudaMemcpyHostToDevice, st),
                       "staging the cast-back's slots and segments");
  if (kv_op->where == Where::kHost) {
    std::memcpy(host + kv_op->offset, kv, static_cast<size_t>(kv_bytes));
    RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(dev + kv_op->offset, host + kv_op->offset,
                        static_cast<size_t>(kv_bytes), cudaMemcpyHostToDevice,
                        st),
        "staging an inline chunk_kv");
  } else if (kv_op->where == Where::kStagedDevice) {
    RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(dev + kv_op->offset, kv, static_cast<size_t>(kv_bytes),
                        cudaMemcpyDeviceToDevice, st),
        "staging a misaligned chunk_kv slice");
  }
  const void* kv_dev =
      kv_op->where == Where::kDevice ? kv : dev + kv_op->offset;
  void* out_dev = out_op->where == Where::kDevice ? out : dev + out_op->offset;
  gpu::LaunchOptions launch;
  launch.stream = st;
  launch.pdl = true;  // the load follows the store on the same stream
  uint8_t* layer = dev + layer_at + layout->layer_offset(0);
  RETURN_IF_ERROR(gpu::Store(*layout, layer, kv_dev, dtype,
                             reinterpret_cast<const int32_t*>(dev), n, launch));
  RETURN_IF_ERROR(gpu::LoadSegments(
      *layout, layer, reinterpret_cast<const int32_t*>(dev + segs_at), blocks,
      out_dev, nullptr, launch));
  if (out_op->where == Where::kHost) {
    RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(host + out_op->offset, dev + out_op->offset,
                        static_cast<size_t>(out_bytes), cudaMemcpyDeviceToHost,
                        st),
        "copying the cast-back rows back");
  } else if (out_op->where == Where::kStagedDevice) {
    RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(out, dev + out_op->offset,
                                         static_cast<size_t>(out_bytes),
                                         cudaMemcpyDeviceToDevice, st),
                         "copying the cast-back rows to a misaligned slice");
  }
  ASSIGN_OR_RETURN(CallEvent done, call_events_.Record(device, st));
  // Calls on other streams that arrive while this one runs queue behind it.
  for (const Operand* op : {&*kv_op, &*out_op}) {
    if (op->fence != nullptr) {
      static_cast<UseFence*>(op->fence.get())->Note(st, done);
    }
  }
  (*lease)->MarkUsed(std::move(done));
  // record_event: the caller records the stream's event after its last
  // call; the staging stays leased to this call's event until then.
  if (!ordering.record_event || out_op->where == Where::kHost) {
    RETURN_IF_ERROR((*lease)->WaitUsed());
  }
  if (out_op->where == Where::kHost) {
    std::memcpy(out, host + out_op->offset, static_cast<size_t>(out_bytes));
  }
  queued.stream = nullptr;
  return absl::OkStatus();
}

absl::Status CudaBackend::StoreOrdered(const PoolLayout& layout,
                                       const Memory& pool, int64_t layer,
                                       const void* kv, InputDtype dtype,
                                       absl::Span<const int32_t> slot_mapping,
                                       const GpuOrdering& ordering,
                                       std::string* recorded_event) {
  if (recorded_event != nullptr) recorded_event->clear();
  absl::StatusOr<CudaAllocation*> mem = AsAllocation(pool);
  if (!mem.ok()) return mem.status();
  const int device = (*mem)->device_ordinal();
  absl::StatusOr<ScopedCudaDevice> scoped = ScopedCudaDevice::Enter(device);
  if (!scoped.ok()) return scoped.status();

  const int64_t n = static_cast<int64_t>(slot_mapping.size());
  const int64_t slots_bytes = n * static_cast<int64_t>(sizeof(int32_t));
  const int64_t kv_bytes =
      n * layout.format.elements() * (dtype == InputDtype::kFP32 ? 4 : 2);
  absl::StatusOr<Operand> kv_op = Classify(kv, kv_bytes, device, 16, "kv");
  if (!kv_op.ok()) return kv_op.status();
  // Staging: [slot_mapping | kv when not used in place].
  int64_t staged = StagingRound(slots_bytes);
  if (kv_op->where != Where::kDevice) {
    kv_op->offset = staged;
    staged += StagingRound(kv_bytes);
  }
  // A direct caller's event (the service awaits it before the pool lock).
  RETURN_IF_ERROR(
      AwaitClientEvent(pool, ordering.wait_event, absl::InfiniteFuture()));
  absl::StatusOr<StagingPool::Lease> lease = staging_.Acquire(device, staged);
  if (!lease.ok()) return lease.status();

  absl::StatusOr<SessionStream*> stream =
      StreamFor(*mem, device, ordering.session);
  if (!stream.ok()) return stream.status();
  cudaStream_t st = (*stream)->stream();
  RETURN_IF_ERROR(OrderAfterOperands(st, {&*kv_op}));
  Queued queued{st};
  uint8_t* host = (*lease)->host();
  uint8_t* dev = (*lease)->dev();
  if (n > 0) {
    std::memcpy(host, slot_mapping.data(), static_cast<size_t>(slots_bytes));
    int64_t h2d = slots_bytes;
    if (kv_op->where == Where::kHost) {
      std::memcpy(host + kv_op->offset, kv, static_cast<size_t>(kv_bytes));
      h2d = kv_op->offset + kv_bytes;
    }
    RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(dev, host, static_cast<size_t>(h2d),
                                         cudaMemcpyHostToDevice, st),
                         "staging slot_mapping and inline kv");
    if (kv_op->where == Where::kStagedDevice) {
      RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(dev + kv_op->offset, kv,
                                           static_cast<size_t>(kv_bytes),
                                           cudaMemcpyDeviceToDevice, st),
                           "staging a misaligned kv slice");
    }
    const void* kv_dev =
        kv_op->where == Where::kDevice ? kv : dev + kv_op->offset;
    gpu::LaunchOptions launch;
    launch.stream = st;
    // Programmatic Dependent Launch: after a kernel on the same stream
    // (chained calls) this one may start early; its griddepcontrol.wait
    // keeps the data dependency.
    launch.pdl = true;
    RETURN_IF_ERROR(
        gpu::Store(layout, (*mem)->data() + layout.layer_offset(layer), kv_dev,
                   dtype, reinterpret_cast<const int32_t*>(dev), n, launch));
  }
  const Operand* used[1] = {&*kv_op};
  return Finish(device, *mem, *stream, *lease, queued, ordering, {}, used,
                recorded_event);
}

absl::Status CudaBackend::LoadOrdered(const PoolLayout& layout,
                                      const Memory& pool, int64_t layer,
                                      absl::Span<const int32_t> segments,
                                      int64_t total_k, void* data, void* scales,
                                      const GpuOrdering& ordering,
                                      std::string* recorded_event) {
  if (recorded_event != nullptr) recorded_event->clear();
  absl::StatusOr<CudaAllocation*> mem = AsAllocation(pool);
  if (!mem.ok()) return mem.status();
  const int device = (*mem)->device_ordinal();
  absl::StatusOr<ScopedCudaDevice> scoped = ScopedCudaDevice::Enter(device);
  if (!scoped.ok()) return scoped.status();

  const KVCacheFormat& f = layout.format;
  const int64_t num_segments = static_cast<int64_t>(segments.size()) / 4;
  const int64_t seg_bytes =
      static_cast<int64_t>(segments.size() * sizeof(int32_t));
  const int64_t data_bytes = total_k * LoadDataRowBytes(f);
  const int64_t scale_bytes = f.do_cast ? 0 : total_k * LoadScaleRowBytes(f);
  absl::StatusOr<Operand> data_op =
      Classify(data, data_bytes, device, 16, "data");
  if (!data_op.ok()) return data_op.status();
  absl::StatusOr<Operand> scale_op =
      Classify(scales, scale_bytes, device, 4, "scales");
  if (!scale_op.ok()) return scale_op.status();
  // Staging: [segments | data when not in place | scales when not in place].
  int64_t staged = StagingRound(seg_bytes);
  Operand* outputs[2] = {&*data_op, &*scale_op};
  for (Operand* op : outputs) {
    if (op->bytes > 0 && op->where != Where::kDevice) {
      op->offset = staged;
      staged += StagingRound(op->bytes);
    }
  }
  // A direct caller's event (the service awaits it before the pool lock).
  RETURN_IF_ERROR(
      AwaitClientEvent(pool, ordering.wait_event, absl::InfiniteFuture()));
  absl::StatusOr<StagingPool::Lease> lease = staging_.Acquire(device, staged);
  if (!lease.ok()) return lease.status();

  absl::StatusOr<SessionStream*> stream =
      StreamFor(*mem, device, ordering.session);
  if (!stream.ok()) return stream.status();
  cudaStream_t st = (*stream)->stream();
  RETURN_IF_ERROR(OrderAfterOperands(st, {&*data_op, &*scale_op}));
  Queued queued{st};
  uint8_t* host = (*lease)->host();
  uint8_t* dev = (*lease)->dev();
  Operand host_outputs[2];  // copied back after the synchronize
  int num_host_outputs = 0;
  // total_k = 0 leaves nothing to write (every segment is empty).
  if (num_segments > 0 && total_k > 0) {
    // Inputs: the segments, and the current contents of staged outputs
    // (rows no segment covers keep them, SPEC §5).
    std::memcpy(host, segments.data(), static_cast<size_t>(seg_bytes));
    RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(dev, host, static_cast<size_t>(seg_bytes),
                        cudaMemcpyHostToDevice, st),
        "staging the plan segments");
    for (Operand* op : outputs) {
      if (op->bytes == 0 || op->where == Where::kDevice) continue;
      if (op->where == Where::kHost) {
        std::memcpy(host + op->offset, op->ptr, static_cast<size_t>(op->bytes));
        RETURN_IF_CUDA_ERROR(
            cudaMemcpyAsync(dev + op->offset, host + op->offset,
                            static_cast<size_t>(op->bytes),
                            cudaMemcpyHostToDevice, st),
            "staging an inline output");
      } else {
        RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(dev + op->offset, op->ptr,
                                             static_cast<size_t>(op->bytes),
                                             cudaMemcpyDeviceToDevice, st),
                             "staging a misaligned output slice");
      }
    }
    auto at = [&](const Operand& op) -> void* {
      if (op.bytes == 0) return op.ptr;
      return op.where == Where::kDevice ? op.ptr : dev + op.offset;
    };
    gpu::LaunchOptions launch;
    launch.stream = st;
    // Programmatic Dependent Launch: after a kernel on the same stream
    // (chained calls) this one may start early; its griddepcontrol.wait
    // keeps the data dependency.
    launch.pdl = true;
    RETURN_IF_ERROR(gpu::LoadSegments(
        layout, (*mem)->data() + layout.layer_offset(layer),
        reinterpret_cast<const int32_t*>(dev), num_segments, at(*data_op),
        f.do_cast ? nullptr : at(*scale_op), launch));
    for (Operand* op : outputs) {
      if (op->bytes == 0 || op->where == Where::kDevice) continue;
      if (op->where == Where::kHost) {
        RETURN_IF_CUDA_ERROR(
            cudaMemcpyAsync(host + op->offset, dev + op->offset,
                            static_cast<size_t>(op->bytes),
                            cudaMemcpyDeviceToHost, st),
            "copying an inline output back");
        host_outputs[num_host_outputs++] = *op;
      } else {
        RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(op->ptr, dev + op->offset,
                                             static_cast<size_t>(op->bytes),
                                             cudaMemcpyDeviceToDevice, st),
                             "copying a misaligned output slice back");
      }
    }
  }
  const Operand* used[2] = {&*data_op, &*scale_op};
  return Finish(device, *mem, *stream, *lease, queued, ordering,
                absl::MakeConstSpan(host_outputs, num_host_outputs), used,
                recorded_event);
}

absl::Status CudaBackend::RunIndex(
    const Memory& device_memory, absl::Span<IndexArray> arrays,
    int64_t fixed_bytes, int64_t scratch_bytes,
    const std::function<void(uint8_t*)>& fill,
    const std::function<absl::Status(const IndexDevice&)>& launch,
    uint8_t* invalid_word, const GpuOrdering& ordering, absl::Time deadline,
    int64_t* invalid, std::string* recorded_event) {
  if (recorded_event != nullptr) recorded_event->clear();
  absl::StatusOr<std::optional<DeviceRanges::Range>> home =
      ranges_->Find(device_memory.data(), device_memory.size());
  if (!home.ok()) return home.status();
  if (!home->has_value()) {
    return absl::InternalError("an index call's memory is not device memory");
  }
  const int device = (*home)->device;
  absl::StatusOr<ScopedCudaDevice> scoped = ScopedCudaDevice::Enter(device);
  if (!scoped.ok()) return scoped.status();
  // Where every operand lives; staging: [fixed | scratch | staged arrays |
  // counter].
  std::vector<Operand> device_ops;
  int64_t staged = StagingRound(fixed_bytes) + StagingRound(scratch_bytes);
  const int64_t scratch_at = StagingRound(fixed_bytes);
  std::vector<int64_t> array_at(arrays.size(), -1);
  std::vector<Operand> src_ops(arrays.size()), dst_ops(arrays.size());
  for (size_t i = 0; i < arrays.size(); ++i) {
    IndexArray& a = arrays[i];
    if (a.src != nullptr) {
      ASSIGN_OR_RETURN(src_ops[i], Classify(a.src, a.bytes, device, 4,
                                            absl::StrCat(a.field, " (in)")));
      if (src_ops[i].fence != nullptr) device_ops.push_back(src_ops[i]);
    }
    if (a.dst != nullptr) {
      ASSIGN_OR_RETURN(dst_ops[i], Classify(a.dst, a.bytes, device, 4,
                                            absl::StrCat(a.field, " (out)")));
      if (dst_ops[i].fence != nullptr) device_ops.push_back(dst_ops[i]);
    }
    const Operand& home_op = a.dst != nullptr ? dst_ops[i] : src_ops[i];
    if (a.bytes > 0 && home_op.where != Where::kDevice) {
      array_at[i] = staged;
      staged += StagingRound(a.bytes);
    } else if (a.bytes > 0 && a.src != nullptr &&
               src_ops[i].where == Where::kHost) {
      array_at[i] = staged;  // the pinned copy of a host input
      staged += StagingRound(a.bytes);
    }
  }
  absl::StatusOr<Operand> word;
  if (invalid_word != nullptr) {
    ASSIGN_OR_RETURN(
        word, Classify(invalid_word, 8, device, 1, "invalid_count_buffer"));
    if (word->fence != nullptr) device_ops.push_back(*word);
  }
  if (device_ops.empty()) {
    return absl::UnimplementedError("no operand in device memory");
  }
  const int64_t counter_at = staged;
  staged += StagingRound(16);
  RETURN_IF_ERROR(AwaitOnDevice(device, ordering.wait_event, deadline));
  absl::StatusOr<StagingPool::Lease> lease = staging_.Acquire(device, staged);
  if (!lease.ok()) return lease.status();
  absl::StatusOr<SessionStream*> stream =
      streams_.For(device, ordering.session);
  if (!stream.ok()) return stream.status();
  cudaStream_t st = (*stream)->stream();
  // After earlier work on every buffer involved (the daemon's streams).
  for (const Operand& op : device_ops) {
    RETURN_IF_ERROR(static_cast<UseFence*>(op.fence.get())->OrderAfter(st));
  }
  Queued queued{st};
  uint8_t* host = (*lease)->host();
  uint8_t* dev = (*lease)->dev();
  if (fixed_bytes > 0) {
    fill(host);
    RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(dev, host, static_cast<size_t>(fixed_bytes),
                        cudaMemcpyHostToDevice, st),
        "staging an index call's host arrays");
  }
  for (size_t i = 0; i < arrays.size(); ++i) {
    IndexArray& a = arrays[i];
    const Operand& home_op = a.dst != nullptr ? dst_ops[i] : src_ops[i];
    a.dev = home_op.where == Where::kDevice || a.bytes == 0 ? home_op.ptr
                                                            : dev + array_at[i];
    if (a.src == nullptr || a.bytes == 0 || a.src == a.dev) continue;
    const size_t n = static_cast<size_t>(a.bytes);
    if (src_ops[i].where == Where::kHost) {
      std::memcpy(host + array_at[i], a.src, n);
      RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(a.dev, host + array_at[i], n,
                                           cudaMemcpyHostToDevice, st),
                           absl::StrCat("staging an inline ", a.field));
    } else {
      RETURN_IF_CUDA_ERROR(
          cudaMemcpyAsync(a.dev, a.src, n, cudaMemcpyDeviceToDevice, st),
          absl::StrCat("copying ", a.field));
    }
  }
  auto* counter = reinterpret_cast<unsigned long long*>(dev + counter_at);
  RETURN_IF_CUDA_ERROR(cudaMemsetAsync(counter, 0, 8, st),
                       "zeroing the invalid counter");
  IndexDevice d;
  d.stream = st;
  d.fixed = dev;
  d.scratch = dev + scratch_at;
  d.counter = counter;
  RETURN_IF_ERROR(launch(d));
  std::vector<Operand> host_outputs;
  for (size_t i = 0; i < arrays.size(); ++i) {
    IndexArray& a = arrays[i];
    if (a.dst == nullptr || a.bytes == 0 || a.dev == a.dst) continue;
    const size_t n = static_cast<size_t>(a.bytes);
    if (dst_ops[i].where == Where::kHost) {
      RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(host + array_at[i], a.dev, n,
                                           cudaMemcpyDeviceToHost, st),
                           absl::StrCat("copying ", a.field, " back"));
      Operand out = dst_ops[i];
      out.offset = array_at[i];
      host_outputs.push_back(out);
    } else {
      RETURN_IF_CUDA_ERROR(
          cudaMemcpyAsync(a.dst, a.dev, n, cudaMemcpyDeviceToDevice, st),
          absl::StrCat("copying ", a.field, " to a misaligned slice"));
    }
  }
  int64_t count = -1;
  const bool want_count = invalid != nullptr && !ordering.record_event;
  if (want_count || (invalid_word != nullptr && word->where == Where::kHost)) {
    RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(host + counter_at, counter, 8,
                                         cudaMemcpyDeviceToHost, st),
                         "reading the invalid counter");
  }
  if (want_count) {
    Operand out;
    out.ptr = reinterpret_cast<uint8_t*>(&count);
    out.bytes = 8;
    out.offset = counter_at;
    host_outputs.push_back(out);
  }
  if (invalid_word != nullptr) {
    if (word->where == Where::kHost) {
      Operand out = *word;
      out.offset = counter_at;
      host_outputs.push_back(out);
    } else {
      RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(invalid_word, counter, 8,
                                           cudaMemcpyDeviceToDevice, st),
                           "writing invalid_count_buffer");
    }
  }
  std::vector<const Operand*> used;
  for (const Operand& op : device_ops) used.push_back(&op);
  RETURN_IF_ERROR(Finish(device, nullptr, *stream, *lease, queued, ordering,
                         host_outputs, used, recorded_event));
  if (invalid != nullptr) *invalid = count;
  return absl::OkStatus();
}

absl::Status CudaBackend::ConvertTopkOrdered(const Memory& device_memory,
                                             const ConvertTopkCall& call,
                                             const GpuOrdering& ordering,
                                             absl::Time deadline,
                                             int64_t* invalid,
                                             std::string* recorded_event) {
  const int64_t b = call.batch;
  IndexArray arrays[2];
  arrays[0].src = call.topk;
  arrays[0].dst = call.slots;
  arrays[0].bytes = b * call.k * 4;
  arrays[0].field = "topk";
  arrays[1].src = call.block_table;
  arrays[1].bytes = b * call.cols * 4;
  arrays[1].field = "block_table";
  // Host arrays: [valid_count | num_tokens].
  const int64_t tokens_at = StagingRound(b * 4);
  auto fill = [&](uint8_t* host) {
    std::memcpy(host, call.valid_count.data(), static_cast<size_t>(b * 4));
    std::memcpy(host + tokens_at, call.num_tokens.data(),
                static_cast<size_t>(b * 4));
  };
  auto launch = [&](const IndexDevice& d) {
    gpu::LaunchOptions options;
    options.stream = d.stream;
    options.pdl = true;
    return gpu::ConvertTopk(
        static_cast<int32_t*>(arrays[0].dev), b, call.k,
        reinterpret_cast<const int32_t*>(d.fixed),
        reinterpret_cast<const int32_t*>(d.fixed + tokens_at),
        static_cast<const int32_t*>(arrays[1].dev), nullptr, call.cols,
        call.cols, call.block_size, call.num_blocks, d.counter, options);
  };
  return RunIndex(device_memory, absl::MakeSpan(arrays), tokens_at + b * 4, 0,
                  fill, launch, call.invalid_word, ordering, deadline, invalid,
                  recorded_event);
}

absl::Status CudaBackend::SwaDecodeOrdered(const Memory& device_memory,
                                           const SwaDecodeCall& call,
                                           const GpuOrdering& ordering,
                                           absl::Time deadline,
                                           std::string* recorded_event) {
  const int64_t n = static_cast<int64_t>(call.queries.size()) / 3;
  IndexArray arrays[1];
  arrays[0].dst = call.slots;
  arrays[0].bytes = n * call.window * 4;
  arrays[0].field = "slots";
  // Host arrays: [state_ids | starts | valid_lens], from [n][3].
  const int64_t column = StagingRound(n * 4);
  auto fill = [&](uint8_t* host) {
    for (int f = 0; f < 3; ++f) {
      auto* out = reinterpret_cast<int32_t*>(host + f * column);
      for (int64_t i = 0; i < n; ++i) out[i] = call.queries[3 * i + f];
    }
  };
  auto launch = [&](const IndexDevice& d) {
    gpu::LaunchOptions options;
    options.stream = d.stream;
    options.pdl = true;
    return gpu::SwaDecodeIndex(
        reinterpret_cast<const int32_t*>(d.fixed),
        reinterpret_cast<const int32_t*>(d.fixed + column),
        reinterpret_cast<const int32_t*>(d.fixed + 2 * column), n, call.window,
        call.ring_size, static_cast<int32_t*>(arrays[0].dev), options);
  };
  return RunIndex(device_memory, absl::MakeSpan(arrays), 3 * column, 0, fill,
                  launch, nullptr, ordering, deadline, nullptr, recorded_event);
}

absl::Status CudaBackend::PrefillIndexOrdered(const Memory& device_memory,
                                              const PrefillIndexCall& call,
                                              const GpuOrdering& ordering,
                                              absl::Time deadline,
                                              int64_t* invalid,
                                              std::string* recorded_event) {
  const int64_t rows = call.rows;
  const int32_t width = call.window + call.topk_k;
  IndexArray arrays[2];
  arrays[0].src = call.compressed;
  arrays[0].bytes = rows * call.topk_k * 4;
  arrays[0].field = "compressed_index";
  arrays[1].dst = call.index;
  arrays[1].bytes = rows * width * 4;
  arrays[1].field = "index";
  // Host arrays: the pivots; scratch: the SWA index [rows][window].
  const int64_t pivot_bytes = static_cast<int64_t>(call.pivots.size()) * 4;
  auto fill = [&](uint8_t* host) {
    std::memcpy(host, call.pivots.data(), static_cast<size_t>(pivot_bytes));
  };
  auto launch = [&](const IndexDevice& d) -> absl::Status {
    gpu::LaunchOptions options;
    options.stream = d.stream;
    options.pdl = true;
    auto* swa = reinterpret_cast<int32_t*>(d.scratch);
    RETURN_IF_ERROR(
        gpu::ExpandSwaIndex(reinterpret_cast<const int32_t*>(d.fixed), rows,
                            call.window, swa, options));
    return gpu::KvIndexCatChecked(
        swa, call.window, static_cast<const int32_t*>(arrays[0].dev),
        call.topk_k, rows, call.main_kv_offset, call.compressed_rows,
        static_cast<int32_t*>(arrays[1].dev), d.counter, options);
  };
  return RunIndex(device_memory, absl::MakeSpan(arrays), pivot_bytes,
                  rows * call.window * 4, fill, launch, call.invalid_word,
                  ordering, deadline, invalid, recorded_event);
}
}  // namespace

absl::StatusOr<int> CudaDeviceCount() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    return absl::FailedPreconditionError(
        gpu::ToStatus(e, "cudaGetDeviceCount").message());
  }
  return count;
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(
    const BackendOptions& options) {
  // Before the first CUDA call: the driver reads these when it starts.
  if (absl::Status env = CheckCudaEnvironment(); !env.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--backend=cuda: ", env.message()));
  }
  absl::StatusOr<int> count = CudaDeviceCount();
  if (!count.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--backend=cuda: no usable CUDA driver: ", count.status().message()));
  }
  if (*count <= 0) {
    return absl::FailedPreconditionError(
        "--backend=cuda: no CUDA device is visible");
  }
  // The step path needs MPS to be fast (docs/STEP_PATH.md "Run it under
  // MPS"); say at start whether the driver shares contexts through it.
  for (int d = 0; d < *count; ++d) {
    int mps = 0;
    if (cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, d) != cudaSuccess) {
      spdlog::warn("cuda:{}: cannot tell whether MPS is on", d);
    } else if (mps == 1) {
      spdlog::info("cuda:{}: MPS on", d);
    } else {
      spdlog::warn(
          "cuda:{}: MPS is off: a step-path doorbell round trip then "
          "time-slices the daemon's and the worker's contexts (~285 us "
          "instead of ~19 us on the H200); start nvidia-cuda-mps-control -d "
          "with the same CUDA_MPS_PIPE_DIRECTORY for kvdepotd and the workers "
          "(docs/STEP_PATH.md)",
          d);
    }
  }
  // Before any context exists (cudaGetDeviceCount creates none): waiting
  // host threads sleep instead of spinning (BackendOptions).
  if (options.cuda_blocking_sync) {
    for (int d = 0; d < *count; ++d) {
      RETURN_IF_CUDA_ERROR(cudaSetDevice(d),
                           absl::StrCat("cudaSetDevice(", d, ")"));
      RETURN_IF_CUDA_ERROR(
          cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync),
          absl::StrCat("cudaSetDeviceFlags(BlockingSync) on cuda:", d));
    }
  }
  // The device budget: what each device has free now, minus the reserve.
  auto budget = std::make_shared<DeviceBudget>();
  if (options.cuda_memory_reserve_bytes >= 0) {
    for (int d = 0; d < *count; ++d) {
      absl::StatusOr<ScopedCudaDevice> scoped = ScopedCudaDevice::Enter(d);
      if (!scoped.ok()) return scoped.status();
      size_t free_bytes = 0, total_bytes = 0;
      RETURN_IF_CUDA_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes),
                           absl::StrCat("cudaMemGetInfo on cuda:", d));
      budget->SetDevice(d, static_cast<int64_t>(free_bytes),
                        options.cuda_memory_reserve_bytes);
    }
  }
  return std::unique_ptr<Backend>(
      new CudaBackend(*count, options, std::move(budget)));
}

}  // namespace kvdepot
