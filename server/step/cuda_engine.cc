#include "server/step/cuda_engine.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/cuda/cuda_status.h"
#include "common/cuda/driver_api.h"
#include "common/status_macros.h"
#include "kernels/cuda/fused_kernels.h"
#include "kernels/cuda/kernels.h"
#include "proto/step_doorbell.h"
#include "server/step/staging_pool.h"
#include "server/step/step_kernels.h"
#include "spdlog/spdlog.h"

namespace kvdepot::step {
namespace {

namespace db = ::kvdepot::doorbell;

constexpr int kSlots = kMaxInFlight;
constexpr int kHeaderWords = db::kWordsPerLine;

// What the step path may allocate for staging on one device, device
// memory and pinned host memory each (server/step/staging_pool.h): a
// registration of the largest maxima takes two areas of about 21 MiB of
// each kind, 32 MiB once rounded up, so about 60 of them fit.
constexpr int64_t kStagingCapBytes = int64_t{4} << 30;

// The process's staging pools, one per device and kind (they outlive the
// engines: areas are never freed).
StagingPool& StagingFor(int device, bool host) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* pools =
      new std::map<std::pair<int, bool>, std::unique_ptr<StagingPool>>();
  absl::MutexLock lock(&mu);
  std::unique_ptr<StagingPool>& p = (*pools)[{device, host}];
  if (p == nullptr) {
    StagingPool::Alloc alloc = [device,
                                host](size_t bytes) -> absl::StatusOr<void*> {
      void* ptr = nullptr;
      if (host) {
        RETURN_IF_CUDA_ERROR(cudaHostAlloc(&ptr, bytes, cudaHostAllocDefault),
                             "allocating the pinned staging area");
      } else {
        // The caller has made `device` current.
        RETURN_IF_CUDA_ERROR(cudaMalloc(&ptr, bytes),
                             "allocating the step staging area");
      }
      return ptr;
    };
    p = std::make_unique<StagingPool>(
        absl::StrCat(
            host ? "pinned host staging for cuda:" : "staging on cuda:",
            device),
        kStagingCapBytes, std::move(alloc));
  }
  return *p;
}

absl::Status KernelStatus(int error, absl::string_view what) {
  return gpu::ToStatus(static_cast<cudaError_t>(error), what);
}

absl::StatusOr<int> DeviceIndex(absl::string_view device) {
  int index = 0;
  if (!absl::ConsumePrefix(&device, "cuda:") ||
      !absl::SimpleAtoi(device, &index) || index < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the step path needs CUDA memory; the doorbell lives on ", device));
  }
  return index;
}

class CudaStepEngine : public StepEngine {
 public:
  CudaStepEngine(const RegistrationConfig& config, CompletionFn done,
                 const gpu::DriverApi* api, int device,
                 const CudaEngineOptions& options)
      : config_(config),
        done_(std::move(done)),
        api_(api),
        device_(device),
        graphs_(options.graphs),
        pdl_(options.pdl),
        timing_every_(options.timing_every),
        num_phases_(static_cast<int>(
            db::NumPhases(static_cast<int64_t>(config.layers.size())))) {}

  ~CudaStepEngine() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    if (thread_.joinable()) thread_.join();
    cudaSetDevice(device_);
    int in_flight = 0;
    {
      absl::MutexLock lock(&mu_);
      in_flight = gpu_in_flight_;
    }
    if (in_flight == 0) {
      for (int s = 0; s < kSlots; ++s) {
        StagingFor(device_, false).Give(device_staging_[s]);
        StagingFor(device_, true).Give(host_staging_[s]);
      }
      for (const StagingPool::Area& a : fused_arrays_) {
        StagingFor(device_, false).Give(a);
      }
      for (auto& slot : graph_exec_) {
        for (cudaGraphExec_t e : slot) {
          if (e != nullptr) cudaGraphExecDestroy(e);
        }
      }
      if (work_ != nullptr) cudaStreamDestroy(work_);
      if (control_ != nullptr) cudaStreamDestroy(control_);
    } else {
      // A stream still parked after every release: leak rather than free
      // memory a queued kernel may still touch.
      spdlog::error("step engine: {} steps never finished; leaking streams",
                    in_flight);
    }
  }

  absl::Status Init() {
    RETURN_IF_CUDA_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    RETURN_IF_CUDA_ERROR(
        cudaStreamCreateWithFlags(&work_, cudaStreamNonBlocking),
        "creating the work stream");
    RETURN_IF_CUDA_ERROR(
        cudaStreamCreateWithFlags(&control_, cudaStreamNonBlocking),
        "creating the control stream");
    blob_bytes_ = 4 * MaxBlobElements(config_);
    for (int s = 0; s < kSlots; ++s) {
      ASSIGN_OR_RETURN(device_staging_[s],
                       StagingFor(device_, false).Take(DeviceStagingBytes()));
      ASSIGN_OR_RETURN(host_staging_[s],
                       StagingFor(device_, true).Take(HostStagingBytes()));
    }
    RETURN_IF_ERROR(UploadFused());
    // Per slot-mapping row: the pools it feeds bound its entries.
    const int32_t rows =
        1 + static_cast<int32_t>(config_.compressed_ratios.size());
    for (int32_t row = 0; row < rows; ++row) {
      slot_capacity_[row] = MinSlots(config_, row - 1);
    }
    // The doorbell starts zeroed: no flag, no done, no cancel.
    doorbell_ = reinterpret_cast<uint64_t*>(config_.doorbell->memory->data());
    RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(doorbell_, 0, config_.doorbell_bytes, work_),
        "zeroing the doorbell");
    RETURN_IF_CU_ERROR(
        api_->cuStreamWriteValue64(
            reinterpret_cast<CUstream>(work_),
            reinterpret_cast<CUdeviceptr>(doorbell_ + db::kMagicWord),
            db::kDoorbellMagic, 0),
        "writing the doorbell's magic word");
    RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(work_),
                         "initializing the doorbell");
    thread_ = std::thread([this] { Loop(); });
    return absl::OkStatus();
  }

  absl::Status Enqueue(StepPlan plan) override {
    absl::MutexLock lock(&mu_);
    pending_.push_back(std::move(plan));
    return absl::OkStatus();
  }

  void Cancel() override {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return;
    cancelled_ = true;
    release_needed_ = true;
  }

 private:
  struct HostDone {
    CudaStepEngine* engine = nullptr;
    int slot = 0;
    uint64_t step_id = 0;
    absl::Time started;
    bool timed = false;         // the step stamps its phases
    bool instantiated = false;  // its graph was instantiated, not updated
  };

  // A slot's staging: the blob (blob_bytes_, a multiple of 16), then (a
  // timed step's) per phase the GPU timer at its start and end. Its host
  // twin: the blob, the doorbell header read back, the stamps read back.
  int64_t StampBytes() const { return 16 * int64_t{num_phases_}; }
  size_t DeviceStagingBytes() const {
    return static_cast<size_t>(blob_bytes_ + StampBytes());
  }
  size_t HostStagingBytes() const {
    return static_cast<size_t>(blob_bytes_ + 8 * kHeaderWords + StampBytes());
  }
  uint64_t* DeviceStamps(int slot) const {
    return reinterpret_cast<uint64_t*>(
        static_cast<uint8_t*>(device_staging_[slot].ptr) + blob_bytes_);
  }
  const uint64_t* HostStamps(int slot) const {
    return reinterpret_cast<const uint64_t*>(
        static_cast<uint8_t*>(host_staging_[slot].ptr) + blob_bytes_ +
        8 * kHeaderWords);
  }

  // The GPU time of each phase of a timed step from its stamps (end - start
  // of the global timer); empty when one is not plausible (0 or over 10 s).
  static std::vector<float> PhaseTimes(const uint64_t* stamps, int phases) {
    std::vector<float> us(phases);
    for (int p = 0; p < phases; ++p) {
      const uint64_t start = stamps[2 * p], end = stamps[2 * p + 1];
      if (start == 0 || end < start || end - start > 10'000'000'000ull) {
        return {};
      }
      us[p] = static_cast<float>(end - start) / 1000.0f;
    }
    return us;
  }

  uint64_t* Word(int64_t index) const { return doorbell_ + index; }
  CUdeviceptr Addr(int64_t index) const {
    return reinterpret_cast<CUdeviceptr>(doorbell_ + index);
  }
  CUstream Cu(cudaStream_t s) const { return reinterpret_cast<CUstream>(s); }

  void Loop() {
    cudaSetDevice(device_);
    absl::Time give_up = absl::InfiniteFuture();
    while (true) {
      std::deque<StepOutcome> finished;
      std::deque<StepPlan> plans;
      bool release = false;
      bool cancelled = false;
      {
        absl::MutexLock lock(&mu_);
        mu_.AwaitWithTimeout(
            absl::Condition(
                +[](CudaStepEngine* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(e->mu_) {
                  return e->stopping_ || !e->pending_.empty() ||
                         !e->finished_.empty() || e->release_needed_;
                },
                this),
            absl::Milliseconds(100));
        if (stopping_ && !cancelled_ && gpu_in_flight_ > 0) {
          // Stopping with work on the GPU: cancel it and wait for it.
          cancelled_ = true;
          release_needed_ = true;
        }
        finished.swap(finished_);
        gpu_in_flight_ -= static_cast<int>(finished.size());
        plans.swap(pending_);
        cancelled = cancelled_;
        // After a cancel every finished step lets the next queued one reach
        // its (reset) flags: release again while any is on the GPU.
        release = release_needed_ ||
                  (cancelled_ && !finished.empty() && gpu_in_flight_ > 0);
        release_needed_ = false;
      }
      if (release) Release();  // `finished` were reported by OnHostDone
      for (StepPlan& plan : plans) {
        absl::Status s =
            cancelled ? absl::CancelledError("cancelled") : EnqueueOnGpu(plan);
        if (s.ok()) continue;
        if (!cancelled) {
          spdlog::error("step engine: step {}: {}", plan.step_id, s.ToString());
        }
        StepOutcome o;
        o.step_id = plan.step_id;
        o.status_bits =
            cancelled ? db::kStatusCancelled : db::kStatusDaemonError;
        done_(o);
        if (!cancelled) Cancel();
      }
      absl::MutexLock lock(&mu_);
      if (!stopping_) continue;
      if (gpu_in_flight_ == 0 && pending_.empty() && finished_.empty()) {
        return;
      }
      if (give_up == absl::InfiniteFuture()) {
        give_up = absl::Now() + absl::Seconds(30);
      } else if (absl::Now() > give_up) {
        return;  // the destructor leaks what is still on the GPU
      }
    }
  }

  // The control stream: cancel word first, then every flag and done word
  // (the worker's waits and the daemon's). Memory writes only.
  void Release() {
    const int64_t phases =
        db::NumPhases(static_cast<int64_t>(config_.layers.size()));
    CUresult r =
        api_->cuStreamWriteValue64(Cu(control_), Addr(db::kCancelWord), 1, 0);
    for (int64_t p = 0; p < phases && r == CUDA_SUCCESS; ++p) {
      r = api_->cuStreamWriteValue64(Cu(control_), Addr(db::FlagWord(p)), 1, 0);
      if (r == CUDA_SUCCESS) {
        r = api_->cuStreamWriteValue64(Cu(control_), Addr(db::DoneWord(p)), 1,
                                       0);
      }
    }
    if (r != CUDA_SUCCESS) {
      spdlog::error("step engine: releasing the doorbell: {}",
                    gpu::DriverStatus(r, "cuStreamWriteValue64").ToString());
    }
  }

  static void CUDART_CB OnHostDone(void* arg) {
    HostDone* h = static_cast<HostDone*>(arg);
    CudaStepEngine* e = h->engine;
    const uint64_t* header = reinterpret_cast<const uint64_t*>(
        static_cast<uint8_t*>(e->host_staging_[h->slot].ptr) + e->blob_bytes_);
    StepOutcome o;
    o.step_id = h->step_id;
    o.status_bits = header[db::kStatusWord];
    o.out_of_range = header[db::kOutOfRange];
    o.step_us = absl::ToDoubleMicroseconds(absl::Now() - h->started);
    // A step cut short (cancelled, another step's id, released by a
    // watchdog, a failed launch) is left out; out-of-range entries are a
    // normal step's.
    constexpr uint64_t kCutShort =
        db::kStatusStepMismatch | db::kStatusCancelled |
        db::kStatusWorkerWatchdog | db::kStatusDaemonError;
    if (h->timed && (o.status_bits & kCutShort) == 0) {
      o.phase_us = PhaseTimes(e->HostStamps(h->slot), e->num_phases_);
    }
    o.graph_instantiated = h->instantiated;
    // The outcome reaches the registry from here (no CUDA call in it), not
    // through the enqueue thread: that one may spend milliseconds in the
    // launches of the next step (a stream parked on a flag fills the launch
    // queue), and meanwhile a scheduler's step s + 2, sent once the worker
    // passed step s, was refused as a third step in flight.
    e->done_(o);
    absl::MutexLock lock(&e->mu_);
    e->finished_.push_back(o);  // counted off gpu_in_flight_ by Loop
  }

  absl::Status Phase(int64_t phase) {
    RETURN_IF_CU_ERROR(
        api_->cuStreamWaitValue64(Cu(work_), Addr(db::FlagWord(phase)), 1,
                                  CU_STREAM_WAIT_VALUE_EQ),
        "cuStreamWaitValue64(flag)");
    RETURN_IF_CU_ERROR(
        api_->cuStreamWriteValue64(Cu(work_), Addr(db::FlagWord(phase)), 0, 0),
        "cuStreamWriteValue64(flag = 0)");
    return absl::OkStatus();
  }
  absl::Status Done(int64_t phase) {
    if (timed_now_) {
      RETURN_IF_ERROR(KernelStatus(
          device::LaunchStamp(DeviceStamps(slot_now_) + 2 * phase + 1, work_),
          "launching the phase stamp"));
    }
    RETURN_IF_CU_ERROR(
        api_->cuStreamWriteValue64(Cu(work_), Addr(db::DoneWord(phase)), 1, 0),
        "cuStreamWriteValue64(done = 1)");
    return absl::OkStatus();
  }

  // The fused caches' arrays in device memory (recycled like the staging
  // areas: cudaFree would synchronize the device), uploaded on the work
  // stream before Init's synchronize. fused_[layer][cache] = the params
  // with device pointers (positions set per step).
  absl::Status UploadFused() {
    fused_.resize(config_.layers.size());
    has_fused_.assign(config_.layers.size(), {false, false, false});
    for (size_t l = 0; l < config_.layers.size(); ++l) {
      const LayerConfig& layer = config_.layers[l];
      const CacheConfig* caches[3] = {&layer.main, &layer.swa, &layer.index};
      for (int c = 0; c < 3; ++c) {
        if (caches[c]->fused == nullptr) continue;
        const FusedCacheConfig& f = *caches[c]->fused;
        FusedParams p = f.params;
        ASSIGN_OR_RETURN(
            p.norm_weight,
            Upload<uint16_t>(f.norm_weight.data(), 2 * f.norm_weight.size()));
        ASSIGN_OR_RETURN(p.cos_sin,
                         Upload<float>(f.cos_sin.data(), 4 * f.cos_sin.size()));
        fused_[l][c] = p;
        has_fused_[l][c] = true;
      }
    }
    return absl::OkStatus();
  }
  template <typename T>
  absl::StatusOr<const T*> Upload(const void* host, size_t bytes) {
    if (bytes == 0) return static_cast<const T*>(nullptr);
    ASSIGN_OR_RETURN(StagingPool::Area a,
                     StagingFor(device_, false).Take(bytes));
    fused_arrays_.push_back(a);
    void* p = a.ptr;
    RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(p, host, bytes, cudaMemcpyHostToDevice, work_),
        "uploading the fused-store parameters");
    return static_cast<const T*>(p);
  }

  // Phase A's store of cache `kind` (0 main, 1 SWA, 2 index) of layer
  // `l`: the fused kernel when the cache was registered fused (positions
  // from the step's blob), else the plain store.
  // Every store follows a kernel on the work stream (the gate, or the
  // previous store): with PDL it is launched while that one drains and
  // waits for it on the GPU (griddepcontrol.wait) before reading anything.
  absl::Status Store(size_t l, int kind, const CacheConfig& c,
                     const int32_t* slots, int32_t n,
                     const int64_t* positions) {
    gpu::LaunchOptions o;
    o.stream = work_;
    o.pdl = pdl_;
    if (l < has_fused_.size() && has_fused_[l][kind]) {
      FusedParams p = fused_[l][kind];
      p.positions = positions;
      return gpu::FusedStore(c.layout, c.layer_base,
                             reinterpret_cast<const uint16_t*>(c.input.data()),
                             p, slots, n, nullptr, o);
    }
    return gpu::Store(c.layout, c.layer_base, c.input.data(), InputDtype::kBF16,
                      slots, n, o);
  }

  // One step on the work stream: directly, or (graphs_) captured into a
  // graph, which updates the slot's executable graph when only parameters
  // changed (the same batch shape: every step of a steady decode) and is
  // launched as one operation. Launching ~12 operations per layer into a
  // stream parked on a flag fills its launch queue, and the launches then
  // spin in the driver until the GPU drains it: milliseconds of CPU per
  // step (docs/BENCHMARKS.md).
  absl::Status EnqueueOnGpu(StepPlan& plan) {
    const int slot = next_slot_;
    next_slot_ = (next_slot_ + 1) % kSlots;
    HostDone& h = host_done_[slot];
    h.engine = this;
    h.slot = slot;
    h.step_id = plan.step_id;
    h.started = absl::Now();
    h.timed = timing_every_ > 0 && plan.step_id % timing_every_ == 0;
    h.instantiated = false;
    slot_now_ = slot;
    timed_now_ = h.timed;
    if (!graphs_) {
      {
        absl::MutexLock lock(&mu_);
        ++gpu_in_flight_;  // before the host function can run
      }
      absl::Status s = EnqueueStep(plan, slot);
      if (!s.ok()) {  // the host function (the last operation) is not queued
        absl::MutexLock lock(&mu_);
        --gpu_in_flight_;
      }
      return s;
    }
    RETURN_IF_CUDA_ERROR(
        cudaStreamBeginCapture(work_, cudaStreamCaptureModeThreadLocal),
        "capturing the step");
    const absl::Status captured = EnqueueStep(plan, slot);
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(work_, &graph);
    if (!captured.ok() || end != cudaSuccess) {
      if (graph != nullptr) cudaGraphDestroy(graph);
      return captured.ok() ? gpu::ToStatus(end, "capturing the step")
                           : captured;
    }
    // Timed steps have one more kernel per phase (and the stamps' copy):
    // their own executable graph, so neither kind's updates fail on the
    // other's.
    cudaGraphExec_t& exec = graph_exec_[slot][h.timed ? 1 : 0];
    // The slot's previous launch may still be in its host node: an update
    // takes effect at the next launch and leaves launches in flight as
    // they were, and a destroyed executable graph is freed when its
    // launch completes (CUDA programming guide, "Updating Instantiated
    // Graphs"; cudaGraphExecDestroy).
    if (exec != nullptr) {
      cudaGraphExecUpdateResultInfo info;
      if (cudaGraphExecUpdate(exec, graph, &info) != cudaSuccess) {
        cudaGetLastError();          // a different shape: instantiate anew
        cudaGraphExecDestroy(exec);  // freed when its launch completes
        exec = nullptr;
      }
    }
    cudaError_t e = cudaSuccess;
    if (exec == nullptr) {
      e = cudaGraphInstantiate(&exec, graph, 0);
      h.instantiated = true;
    }
    cudaGraphDestroy(graph);
    if (e != cudaSuccess) {
      exec = nullptr;
      return gpu::ToStatus(e, "instantiating the step's graph");
    }
    {
      absl::MutexLock lock(&mu_);
      ++gpu_in_flight_;
    }
    e = cudaGraphLaunch(exec, work_);
    if (e != cudaSuccess) {
      absl::MutexLock lock(&mu_);
      --gpu_in_flight_;
      return gpu::ToStatus(e, "launching the step's graph");
    }
    return absl::OkStatus();
  }

  // The import of a slot_mappings_in_buffer step's mappings from the
  // worker's buffer into the blob's slot sections (one kernel, with PDL
  // after the gate; the buffer's address is fixed per registration).
  absl::Status ImportSlots(const StepPlan& plan, int32_t* base,
                           const int32_t* gate) {
    static_assert(1 + kMaxCompressedRatios <= device::kMaxSlotRows);
    const StepSections& sec = plan.sections;
    device::SlotImport im;
    im.src = reinterpret_cast<const int32_t*>(config_.slot_mappings.data());
    im.src_stride = config_.slot_mappings.row_stride / 4;
    im.main = base + sec.slots;
    im.compressed =
        sec.compressed_count > 0 ? base + sec.compressed_slots : nullptr;
    im.compressed_stride = sec.compressed_stride;
    im.rows = 1 + sec.compressed_count;
    im.n = plan.num_tokens;
    std::copy(slot_capacity_.begin(), slot_capacity_.end(), im.capacity);
    return KernelStatus(
        device::LaunchSlotImport(gate, im, doorbell_, work_, pdl_),
        "launching the slot-mapping import");
  }

  // The step's operations on the work stream (or into its capture), the
  // completion host function last.
  absl::Status EnqueueStep(StepPlan& plan, int slot) {
    const StepSections& sec = plan.sections;
    plan.blob[sec.gate] = 1;
    const int64_t bytes = 4 * static_cast<int64_t>(plan.blob.size());
    if (bytes > blob_bytes_) {
      return absl::InternalError("step metadata larger than its staging area");
    }
    std::memcpy(host_staging_[slot].ptr, plan.blob.data(), bytes);
    int32_t* base = static_cast<int32_t*>(device_staging_[slot].ptr);
    auto at = [base](int64_t off) { return off < 0 ? nullptr : base + off; };
    RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(base, host_staging_[slot].ptr, bytes,
                                         cudaMemcpyHostToDevice, work_),
                         "uploading the step's metadata");
    const int32_t n = plan.num_tokens;
    int32_t* gate = at(sec.gate);
    int32_t* slots = at(sec.slots);
    // The compressed sections, [compressed_count][compressed_stride].
    int32_t* comp = at(sec.compressed_slots);
    const int64_t comp_n = sec.compressed_count * sec.compressed_stride;
    int32_t* swa = at(sec.swa_slots);
    // A timed step's gate stamps its phase's start.
    uint64_t* const stamps = timed_now_ ? DeviceStamps(slot) : nullptr;
    auto run_gate = [&](int64_t phase) {
      return KernelStatus(
          device::LaunchGate(
              doorbell_, plan.step_id, gate, slots, comp, swa, n, comp_n,
              stamps == nullptr ? nullptr : stamps + 2 * phase, work_),
          "launching the gate kernel");
    };

    // Phase S: the step begins; the SWA decode index.
    RETURN_IF_ERROR(Phase(db::BeginPhase()));
    RETURN_IF_ERROR(run_gate(db::BeginPhase()));
    if (config_.swa_index.set()) {
      const SwaIndexConfig& s = config_.swa_index;
      RETURN_IF_ERROR(KernelStatus(
          device::LaunchSwaIndex(gate, at(sec.swa_state), at(sec.swa_start),
                                 at(sec.swa_valid), n, s.window, s.ring_size,
                                 reinterpret_cast<int32_t*>(s.out.data()),
                                 s.out.row_stride / 4, work_, pdl_),
          "launching the SWA decode index"));
    }
    RETURN_IF_ERROR(Done(db::BeginPhase()));

    for (size_t i = 0; i < config_.layers.size(); ++i) {
      const LayerConfig& l = config_.layers[i];
      const int64_t a = db::PhaseA(static_cast<int64_t>(i));
      RETURN_IF_ERROR(Phase(a));
      RETURN_IF_ERROR(run_gate(a));
      if (i == 0 && plan.slot_mappings_in_buffer) {
        // The worker wrote the mappings before marking A_0 (the ordering
        // contract): copied into the blob before the first store reads it.
        RETURN_IF_ERROR(ImportSlots(plan, base, gate));
      }
      const int64_t* positions =
          reinterpret_cast<const int64_t*>(at(sec.positions));
      // Main and index caches of ratio > 1: compressed rows, stored from
      // the compressed slots of the layer's ratio (-1 = the token completes
      // no row).
      int32_t* const main_slots =
          l.compressed >= 0 ? at(sec.compressed(l.compressed)) : slots;
      if (l.main.set())
        RETURN_IF_ERROR(Store(i, 0, l.main, main_slots, n, positions));
      if (l.swa.set()) RETURN_IF_ERROR(Store(i, 1, l.swa, swa, n, positions));
      if (l.index.set()) {
        RETURN_IF_ERROR(Store(i, 2, l.index, main_slots, n, positions));
      }
      RETURN_IF_ERROR(Done(a));
      const int64_t b = db::PhaseB(static_cast<int64_t>(i));
      RETURN_IF_ERROR(Phase(b));
      // Every phase runs the gate (the same handshake cost everywhere, and
      // a mismatch is reported by the first phase that sees it).
      RETURN_IF_ERROR(run_gate(b));
      if (l.has_phase_b()) {
        // The step's tables: the blob's section (cols per row), or the
        // worker's registered device buffer (its row stride; the pointer is
        // fixed per registration, so the graph update keeps succeeding).
        const int32_t* tables =
            plan.block_tables_in_buffer
                ? reinterpret_cast<const int32_t*>(config_.block_tables.data())
                : at(sec.block_tables);
        const int64_t table_stride = plan.block_tables_in_buffer
                                         ? config_.block_tables.row_stride / 4
                                         : plan.block_table_cols;
        RETURN_IF_ERROR(KernelStatus(
            device::LaunchConvertTopk(
                gate, reinterpret_cast<const int32_t*>(l.topk.data()),
                l.topk.row_stride / 4,
                reinterpret_cast<int32_t*>(l.index_out.data()),
                l.index_out.row_stride / 4, n, plan.top_k, at(sec.row_seq),
                at(sec.seq_lens), l.ratio, tables, table_stride,
                plan.block_table_cols,
                static_cast<int32_t>(l.index.layout.block_size),
                static_cast<int32_t>(l.index.layout.num_blocks), doorbell_,
                work_, pdl_),
            "launching convert_topk"));
      }
      RETURN_IF_ERROR(Done(b));
    }
    RETURN_IF_CU_ERROR(api_->cuStreamWriteValue64(
                           Cu(work_), Addr(db::kDaemonDone), plan.step_id, 0),
                       "cuStreamWriteValue64(daemon done)");
    RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(
            static_cast<uint8_t*>(host_staging_[slot].ptr) + blob_bytes_,
            doorbell_, 8 * kHeaderWords, cudaMemcpyDeviceToHost, work_),
        "reading the doorbell's status");
    if (timed_now_) {
      RETURN_IF_CUDA_ERROR(
          cudaMemcpyAsync(const_cast<uint64_t*>(HostStamps(slot)),
                          DeviceStamps(slot), StampBytes(),
                          cudaMemcpyDeviceToHost, work_),
          "reading the phase stamps");
    }
    RETURN_IF_CUDA_ERROR(
        cudaLaunchHostFunc(work_, &OnHostDone, &host_done_[slot]),
        "cudaLaunchHostFunc");
    return absl::OkStatus();
  }

  const RegistrationConfig config_;
  const CompletionFn done_;
  const gpu::DriverApi* const api_;
  const int device_;
  const bool graphs_;
  cudaStream_t work_ = nullptr;
  cudaStream_t control_ = nullptr;
  uint64_t* doorbell_ = nullptr;
  int64_t blob_bytes_ = 0;
  std::array<StagingPool::Area, kSlots> device_staging_{};
  std::array<StagingPool::Area, kSlots> host_staging_{};  // + header readback
  std::array<HostDone, kSlots> host_done_{};
  // graphs_: per slot, untimed [0] and timed [1].
  std::array<std::array<cudaGraphExec_t, 2>, kSlots> graph_exec_{};
  const bool pdl_;
  const int timing_every_;
  const int num_phases_;
  int slot_now_ = 0;        // the enqueue thread's: the step being enqueued
  bool timed_now_ = false;  // ... and whether it stamps its phases
  std::vector<StagingPool::Area> fused_arrays_;  // device copies, recycled
  std::vector<std::array<FusedParams, 3>> fused_;
  std::vector<std::array<bool, 3>> has_fused_;
  int next_slot_ = 0;  // the enqueue thread's
  // Per slot-mapping row (main, then each compressed ratio): the smallest
  // pool it is stored into (MinSlots; 0 = none).
  std::array<int64_t, device::kMaxSlotRows> slot_capacity_{};
  std::thread thread_;

  absl::Mutex mu_;
  std::deque<StepPlan> pending_ ABSL_GUARDED_BY(mu_);
  std::deque<StepOutcome> finished_ ABSL_GUARDED_BY(mu_);
  int gpu_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool release_needed_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

class CudaFactory : public StepEngineFactory {
 public:
  explicit CudaFactory(const CudaEngineOptions& options) : options_(options) {}

  absl::StatusOr<std::unique_ptr<StepEngine>> Create(
      const RegistrationConfig& config, CompletionFn done) override {
    const std::string env = doorbell::CheckStepEnvironment();
    if (!env.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("RegisterWorker: kvdepotd's environment: ", env));
    }
    ASSIGN_OR_RETURN(const gpu::DriverApi* api, gpu::Driver());
    ASSIGN_OR_RETURN(int device, DeviceIndex(config.device));
    auto engine = std::make_unique<CudaStepEngine>(config, std::move(done), api,
                                                   device, options_);
    RETURN_IF_ERROR(engine->Init());
    return engine;
  }

 private:
  const CudaEngineOptions options_;
};

}  // namespace

std::unique_ptr<StepEngineFactory> MakeCudaEngineFactory(
    const CudaEngineOptions& options) {
  return std::make_unique<CudaFactory>(options);
}

}  // namespace kvdepot::step
