#include "tests/gpu/cuda_call_costs.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "kernels/cuda/kernels.h"
#include "server/cuda/cuda_backend.h"
#include "tests/gpu/gpu_test_util.h"

namespace kvdepot::testing {
namespace {

Timing Summarize(const std::string& name, std::vector<double>& us) {
  Timing t;
  t.name = name;
  std::sort(us.begin(), us.end());
  t.p50_us = us[us.size() / 2];
  t.p99_us = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  t.mean_us = std::accumulate(us.begin(), us.end(), 0.0) / us.size();
  return t;
}

// Threads that run one job each in turn (job i on thread i mod n), asleep
// on a condition variable in between.
class TurnTakers {
 public:
  explicit TurnTakers(int n) {
    for (int t = 0; t < n; ++t) {
      threads_.emplace_back([this, t, n] {
        for (int64_t turn = t;; turn += n) {
          std::function<absl::Status()> job;
          {
            absl::MutexLock lock(&mu_);
            while (!stop_ && turn_ != turn) cv_.Wait(&mu_);
            if (stop_) return;
            job = std::move(job_);
          }
          absl::Status s = job();
          absl::MutexLock lock(&mu_);
          result_ = std::move(s);
          done_ = true;
          cv_.SignalAll();
        }
      });
    }
  }
  ~TurnTakers() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      cv_.SignalAll();
    }
    for (std::thread& t : threads_) t.join();
  }
  // Runs `job` as turn number `turn` (consecutive from 0) and waits.
  absl::Status Run(int64_t turn, std::function<absl::Status()> job) {
    absl::MutexLock lock(&mu_);
    job_ = std::move(job);
    done_ = false;
    turn_ = turn;
    cv_.SignalAll();
    while (!done_) cv_.Wait(&mu_);
    turn_ = -1;
    return result_;
  }

 private:
  absl::Mutex mu_;
  absl::CondVar cv_;
  std::vector<std::thread> threads_;
  std::function<absl::Status()> job_;
  absl::Status result_;
  int64_t turn_ = -1;
  bool done_ = false;
  bool stop_ = false;
};

}  // namespace

absl::StatusOr<std::vector<Timing>> MeasureCudaCallCosts(
    const PoolLayout& layout, int tokens, int iterations, int idle_us) {
  if (tokens < 1 || iterations < 1 || idle_us < 0 ||
      tokens > layout.block_size * layout.num_blocks) {
    return absl::InvalidArgumentError("tokens, iterations or idle_us");
  }
  absl::StatusOr<Stream> stream = Stream::Create();
  if (!stream.ok()) return stream.status();
  cudaStream_t st = stream->get();
  const int64_t kv_bytes = int64_t{tokens} * layout.format.elements() * 2;
  const int64_t slot_bytes = int64_t{tokens} * 4;
  void *pool = nullptr, *kv = nullptr, *slots_d = nullptr, *pinned = nullptr;
  cudaEvent_t plain = nullptr, ipc = nullptr, used = nullptr;
  absl::Cleanup free_all = [&] {
    (void)cudaStreamSynchronize(st);
    for (void* p : {pool, kv, slots_d}) (void)cudaFree(p);
    (void)cudaFreeHost(pinned);
    for (cudaEvent_t e : {plain, ipc, used}) {
      if (e != nullptr) (void)cudaEventDestroy(e);
    }
  };
  RETURN_IF_ERROR(Cuda(cudaMalloc(&pool, layout.total_bytes), "cudaMalloc"));
  RETURN_IF_ERROR(Cuda(cudaMalloc(&kv, kv_bytes), "cudaMalloc"));
  RETURN_IF_ERROR(Cuda(cudaMalloc(&slots_d, slot_bytes), "cudaMalloc"));
  RETURN_IF_ERROR(Cuda(cudaHostAlloc(&pinned, slot_bytes, cudaHostAllocDefault),
                       "cudaHostAlloc"));
  RETURN_IF_ERROR(Cuda(cudaMemset(pool, 0, layout.total_bytes), "memset"));
  RETURN_IF_ERROR(Cuda(cudaMemset(kv, 0, kv_bytes), "memset"));
  RETURN_IF_ERROR(
      Cuda(cudaEventCreateWithFlags(&plain, cudaEventDisableTiming), "event"));
  RETURN_IF_ERROR(
      Cuda(cudaEventCreateWithFlags(&used, cudaEventDisableTiming), "event"));
  RETURN_IF_ERROR(
      Cuda(cudaEventCreateWithFlags(
               &ipc, cudaEventDisableTiming | cudaEventInterprocess),
           "event"));
  std::vector<int32_t> slots(static_cast<size_t>(tokens));
  std::iota(slots.begin(), slots.end(), 0);
  gpu::LaunchOptions launch;
  launch.stream = st;
  launch.pdl = true;

  struct Step {
    std::string name;
    std::function<absl::Status()> call;
  };
  const std::vector<Step> steps = {
      {"cudaEventSynchronize (staging, done)",
       [&] { return Cuda(cudaEventSynchronize(used), "sync"); }},
      {"memcpy to pinned + cudaMemcpyAsync H2D (slots)",
       [&] {
         std::memcpy(pinned, slots.data(), static_cast<size_t>(slot_bytes));
         return Cuda(cudaMemcpyAsync(slots_d, pinned, slot_bytes,
                                     cudaMemcpyHostToDevice, st),
                     "cudaMemcpyAsync");
       }},
      {"gpu::Store launch (PDL)",
       [&] {
         return gpu::Store(layout, pool, kv, InputDtype::kBF16,
                           static_cast<const int32_t*>(slots_d), tokens,
                           launch);
       }},
      {"cudaEventRecord (staging)",
       [&] { return Cuda(cudaEventRecord(used, st), "record"); }},
      {"cudaEventRecord (a fence)",
       [&] { return Cuda(cudaEventRecord(plain, st), "record"); }},
      {"cudaEventRecord (interprocess)",
       [&] { return Cuda(cudaEventRecord(ipc, st), "record"); }},
  };
  std::vector<std::vector<double>> us(steps.size() + 1);
  for (int i = -20; i < iterations; ++i) {
    if (idle_us > 0) absl::SleepFor(absl::Microseconds(idle_us));
    const int64_t begin = absl::GetCurrentTimeNanos();
    int64_t before = begin;
    for (size_t s = 0; s < steps.size(); ++s) {
      RETURN_IF_ERROR(steps[s].call());
      const int64_t after = absl::GetCurrentTimeNanos();
      if (i >= 0) us[s].push_back(1e-3 * static_cast<double>(after - before));
      before = after;
    }
    if (i >= 0) us.back().push_back(1e-3 * static_cast<double>(before - begin));
    RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(st), "cudaStreamSynchronize"));
  }
  std::vector<Timing> out;
  const std::string idle =
      idle_us > 0 ? absl::StrCat(", after ", idle_us, " us idle") : "";
  for (size_t s = 0; s < steps.size(); ++s) {
    out.push_back(Summarize(absl::StrCat("  ", steps[s].name, idle), us[s]));
  }
  out.push_back(
      Summarize(absl::StrCat("  the whole sequence", idle), us.back()));
  return out;
}

absl::StatusOr<Timing> MeasureBackendStore(const PoolLayout& layout, int tokens,
                                           int iterations, int idle_us,
                                           int threads) {
  if (tokens < 1 || iterations < 1 || idle_us < 0 || threads < 0 ||
      tokens > layout.block_size * layout.num_blocks) {
    return absl::InvalidArgumentError("tokens, iterations or idle_us");
  }
  BackendOptions options;
  options.cuda_memory_reserve_bytes = -1;
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, MakeCudaBackend(options));
  ASSIGN_OR_RETURN(std::unique_ptr<Memory> pool,
                   backend->Allocate(layout.total_bytes, "cuda:0"));
  const int64_t kv_bytes = int64_t{tokens} * layout.format.elements() * 2;
  ASSIGN_OR_RETURN(std::unique_ptr<Memory> kv,
                   backend->Allocate(kv_bytes, "cuda:0"));
  std::vector<int32_t> slots(static_cast<size_t>(tokens));
  std::iota(slots.begin(), slots.end(), 0);
  GpuOrdering ordering;
  ordering.record_event = true;
  ordering.session = 1;
  std::vector<double> us;
  std::string event;
  // One call, timed on the thread that runs it.
  auto call = [&](int64_t* ns) -> absl::Status {
    RETURN_IF_ERROR(Cuda(cudaSetDevice(0), "cudaSetDevice"));
    const int64_t begin = absl::GetCurrentTimeNanos();
    RETURN_IF_ERROR(backend->StoreOrdered(layout, *pool, 0, kv->data(),
                                          InputDtype::kBF16, slots, ordering,
                                          &event));
    *ns = absl::GetCurrentTimeNanos() - begin;
    return absl::OkStatus();
  };
  TurnTakers takers(threads);
  for (int i = -20; i < iterations; ++i) {
    if (idle_us > 0) absl::SleepFor(absl::Microseconds(idle_us));
    int64_t ns = 0;
    RETURN_IF_ERROR(threads == 0 ? call(&ns) : takers.Run(i + 20, [&] {
      return call(&ns);
    }));
    if (i >= 0) us.push_back(1e-3 * static_cast<double>(ns));
    // As a worker would: the call's work done before the next request
    // (not timed).
    RETURN_IF_ERROR(Cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
  }
  return Summarize(
      absl::StrCat(
          "  CudaBackend::StoreOrdered",
          threads > 0 ? absl::StrCat(", ", threads, " threads in turn") : "",
          idle_us > 0 ? absl::StrCat(", after ", idle_us, " us idle") : ""),
      us);
}

}  // namespace kvdepot::testing
