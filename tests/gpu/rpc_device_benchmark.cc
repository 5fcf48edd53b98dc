// The daemon's request overhead on the CUDA backend as a GPU worker calls
// it (issue 13 item 2's CUDA variant): K/V in device buffers, no staging,
// the reply sent as soon as the kernel is queued (record_event) and the
// completion seen by waiting on the daemon's interprocess event.
//
// kvdepotd --backend=cuda --legacy_cuda_ipc runs in a child process (as
// deployed; legacy IPC only so this process can map the input buffer and
// fill it). Measured in one run:
//   - a 1-byte Unix-socket ping-pong (tests/rpc_timing.h), and Ping;
//   - Store of --tokens V41 tokens from a daemon device buffer, scattered
//     slots, record_event: the reply alone, and the reply plus a host wait
//     on the returned event (the completion a worker observes);
//   - Load of the same tokens (one segment each) into a device buffer, the
//     same two ways;
//   - the same kernels launched in this process (kernels/cuda/kernels.h) on
//     a pool of the same layout: mean GPU time over back-to-back launches.
// Reports the overhead beyond the kernel: completion p50 minus the kernel's
// mean GPU time, as a multiple of Ping's p50 (goal: <= 1.5).
//
//   rpc_device_benchmark --iterations=3000   (beside bin/kvdepotd)
#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "client/kvdepot_client.h"
#include "common/cuda/cuda_events.h"
#include "common/cuda/cuda_mappings.h"
#include "kernels/cuda/kernels.h"
#include "kernels/format_host.h"
#include "kernels/quant.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"
#include "tests/gpu/cuda_call_costs.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/malloc_flag.h"
#include "tests/rpc_timing.h"

ABSL_FLAG(int, iterations, 2000, "Measured requests per kind.");
ABSL_FLAG(int, warmup, 200, "Unmeasured requests per kind first.");
ABSL_FLAG(int, tokens, 256, "Tokens per Store/Load (a decode step).");
ABSL_FLAG(std::string, json, "", "Also write the results to this JSON file.");
ABSL_FLAG(int, call_cost_iterations, 1000,
          "Sequences of the backend's CUDA calls timed in this process "
          "(0 = skip), back to back and after --call_cost_idle_us idle.");
ABSL_FLAG(int, call_cost_idle_us, 100,
          "Idle time before each timed sequence (the gap between requests).");

namespace kvdepot::testing {
namespace {

constexpr int64_t kBlockSize = 64;
constexpr int64_t kNumBlocks = 1024;

void Die(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "%s: %s\n", what.c_str(), s.ToString().c_str());
  std::exit(1);
}

template <typename T>
T Must(const std::string& what, absl::StatusOr<T> v) {
  if (!v.ok()) Die(what, v.status());
  return *std::move(v);
}

// Mean GPU time of `launch` over `count` back-to-back launches on `stream`.
double KernelUs(cudaStream_t stream, int count,
                const std::function<absl::Status()>& launch) {
  cudaEvent_t a, b;
  if (cudaEventCreate(&a) != cudaSuccess || cudaEventCreate(&b) != cudaSuccess)
    Die("cudaEventCreate", absl::InternalError("failed"));
  for (int i = 0; i < 20; ++i) {
    if (absl::Status s = launch(); !s.ok()) Die("warm-up launch", s);
  }
  cudaEventRecord(a, stream);
  for (int i = 0; i < count; ++i) {
    if (absl::Status s = launch(); !s.ok()) Die("launch", s);
  }
  cudaEventRecord(b, stream);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return 1e3 * ms / count;
}

void Print(const Timing& t) {
  std::printf("%-58s %9.1f %9.1f %9.1f\n", t.name.c_str(), t.p50_us, t.p99_us,
              t.mean_us);
}

int Run() {
  const int warmup = absl::GetFlag(FLAGS_warmup);
  const int iters = absl::GetFlag(FLAGS_iterations);
  const int tokens = absl::GetFlag(FLAGS_tokens);
  if (tokens < 1 || tokens > kBlockSize * kNumBlocks || iters < 1) {
    std::fprintf(stderr, "--tokens in [1, %lld], --iterations >= 1\n",
                 static_cast<long long>(kBlockSize * kNumBlocks));
    return 2;
  }
  if (absl::Status s = Cuda(cudaSetDevice(0), "cudaSetDevice(0)"); !s.ok()) {
    Die("this benchmark needs a CUDA device", s);
  }
  std::unique_ptr<DaemonProcess> daemon =
      Must("starting kvdepotd --backend=cuda",
           DaemonProcess::Start(
               {"--backend=cuda", "--legacy_cuda_ipc", "--log_level=warn"},
               DaemonBinary()));
  std::unique_ptr<KVCacheClient> client = ConnectOrDie(daemon->socket_path());

  const std::string pool = "rpc-device-bench";
  v1::CreatePoolRequest cp;
  cp.set_name(pool);
  cp.set_format("V41");
  cp.set_block_size(kBlockSize);
  cp.set_num_blocks(kNumBlocks);
  cp.set_num_layers(1);
  Must("CreatePool", client->CreatePool(cp));
  const PoolLayout layout =
      *MakePoolLayout(*FormatFromName("V41"), kBlockSize, kNumBlocks, 1);
  const int64_t elements = layout.format.elements();
  const int64_t kv_bytes = int64_t{tokens} * elements * 2;

  // Inputs: random BF16 K/V written into the daemon's input buffer.
  std::mt19937 rng(301);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> kv(static_cast<size_t>(tokens * elements));
  for (uint16_t& h : kv) h = FloatToBf16(normal(rng));
  const v1::BufferInfo in_info =
      Must("AllocateBuffer (input)", AllocateCudaBuffer(*client, kv_bytes));
  const v1::BufferInfo out_info =
      Must("AllocateBuffer (output)", AllocateCudaBuffer(*client, kv_bytes));
  {
    CudaIpcMapping in = Must("mapping the input buffer",
                             CudaIpcMapping::Open(in_info.handle()));
    if (absl::Status s = Cuda(
            cudaMemcpy(in.data(), kv.data(), kv_bytes, cudaMemcpyHostToDevice),
            "writing the input");
        !s.ok()) {
      Die("input", s);
    }
  }
  std::vector<int32_t> all(kBlockSize * kNumBlocks);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  const std::vector<int32_t> slots(all.begin(), all.begin() + tokens);
  std::vector<int32_t> segs;
  for (int i = 0; i < tokens; ++i) {
    const int32_t b = slots[i] / kBlockSize, t = slots[i] % kBlockSize;
    segs.insert(segs.end(), {b, t, t + 1, i});
  }

  v1::StoreRequest store = StoreRequest(pool, 0, slots, v1::INPUT_DTYPE_BF16);
  *store.mutable_kv() = SliceRef(in_info.buffer_id(), 0, kv_bytes);
  store.set_record_event(true);
  v1::LoadRequest load;
  load.set_pool(pool);
  *load.mutable_segments() = SegmentsProto(segs, tokens);
  *load.mutable_data() = SliceRef(out_info.buffer_id(), 0, kv_bytes);
  load.set_record_event(true);

  // The daemon's event, opened once (the same one every time per pool).
  std::optional<CudaIpcEvent> store_event, load_event;
  auto wait_on = [](std::optional<CudaIpcEvent>& ev, const std::string& handle,
                    const char* field) -> absl::Status {
    if (!ev.has_value() || ev->handle() != handle) {
      absl::StatusOr<CudaIpcEvent> e = CudaIpcEvent::Open(field, handle, 0);
      if (!e.ok()) return e.status();
      ev.emplace(*std::move(e));
    }
    return ev->Synchronize();
  };
  auto store_call = [&](bool wait) -> absl::Status {
    absl::StatusOr<v1::StoreResponse> r = client->Store(store);
    if (!r.ok()) return r.status();
    if (r->tokens_written() != tokens) {
      return absl::InternalError("Store wrote fewer tokens than asked");
    }
    return wait ? wait_on(store_event, r->recorded_event_ipc_handle(),
                          "recorded_event_ipc_handle")
                : absl::OkStatus();
  };
  auto load_call = [&](bool wait) -> absl::Status {
    absl::StatusOr<v1::LoadResponse> r = client->Load(load);
    if (!r.ok()) return r.status();
    return wait ? wait_on(load_event, r->recorded_event_ipc_handle(),
                          "recorded_event_ipc_handle")
                : absl::OkStatus();
  };

  // The daemon's backend time per call (Stats: the backend calls' wall
  // clock; with record_event that is the host work and the launches).
  auto backend_us = [&](bool of_store) -> int64_t {
    const v1::StatsResponse st = Must("Stats", client->Stats());
    return of_store ? st.store_kernel_us() : st.load_kernel_us();
  };
  const int calls = warmup + iters;
  std::vector<Timing> rows;
  rows.push_back(SocketPingPong(warmup, iters));
  rows.push_back(MeasureCalls("Ping (client library)", warmup, iters,
                              [&] { return client->Ping(); }));
  const std::string st = absl::StrCat("Store ", tokens, " V41 (device buffer)");
  const std::string ld = absl::StrCat("Load ", tokens, " V41 (device buffer)");
  int64_t b0 = backend_us(true);
  rows.push_back(MeasureCalls(st + ", reply", warmup, iters,
                              [&] { return store_call(false); }));
  const double store_backend_us =
      static_cast<double>(backend_us(true) - b0) / calls;
  rows.push_back(MeasureCalls(st + ", reply + event wait", warmup, iters,
                              [&] { return store_call(true); }));
  b0 = backend_us(false);
  rows.push_back(MeasureCalls(ld + ", reply", warmup, iters,
                              [&] { return load_call(false); }));
  const double load_backend_us =
      static_cast<double>(backend_us(false) - b0) / calls;
  rows.push_back(MeasureCalls(ld + ", reply + event wait", warmup, iters,
                              [&] { return load_call(true); }));

  // The same kernels in this process, on a pool of the same layout.
  std::optional<Stream> stream;
  stream.emplace(Must("stream", Stream::Create()));
  void *pool_d = nullptr, *kv_d = nullptr, *rows_d = nullptr;
  int32_t *slots_d = nullptr, *segs_d = nullptr;
  auto alloc = [](void** p, int64_t n) {
    if (cudaMalloc(p, n) != cudaSuccess) {
      Die("cudaMalloc", absl::ResourceExhaustedError("device memory"));
    }
  };
  alloc(&pool_d, layout.total_bytes);
  alloc(&kv_d, kv_bytes);
  alloc(&rows_d, kv_bytes);
  alloc(reinterpret_cast<void**>(&slots_d), 4 * slots.size());
  alloc(reinterpret_cast<void**>(&segs_d), 4 * segs.size());
  cudaMemset(pool_d, 0, layout.total_bytes);
  cudaMemcpy(kv_d, kv.data(), kv_bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(slots_d, slots.data(), 4 * slots.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(segs_d, segs.data(), 4 * segs.size(), cudaMemcpyHostToDevice);
  gpu::LaunchOptions o;
  o.stream = stream->get();
  const double store_kernel_us = KernelUs(stream->get(), 1000, [&] {
    return gpu::Store(layout, pool_d, kv_d, InputDtype::kBF16, slots_d, tokens,
                      o);
  });
  const double load_kernel_us = KernelUs(stream->get(), 1000, [&] {
    return gpu::LoadSegments(layout, pool_d, segs_d, tokens, rows_d, nullptr,
                             o);
  });
  for (void* p : {pool_d, kv_d, rows_d, static_cast<void*>(slots_d),
                  static_cast<void*>(segs_d)}) {
    cudaFree(p);
  }

  std::printf("%-58s %9s %9s %9s\n", "request", "p50 us", "p99 us", "mean us");
  for (const Timing& t : rows) Print(t);
  std::printf("%-58s %9.2f\n", "  kernel: Store, mean GPU time (this process)",
              store_kernel_us);
  std::printf("%-58s %9.2f\n", "  kernel: Load, mean GPU time (this process)",
              load_kernel_us);
  std::printf("%-58s %9.2f\n", "  daemon: Store backend call (host, mean)",
              store_backend_us);
  std::printf("%-58s %9.2f\n", "  daemon: Load backend call (host, mean)",
              load_backend_us);
  const double socket = rows[0].p50_us, ping = rows[1].p50_us;
  const double store_over = rows[3].p50_us - store_kernel_us;
  const double load_over = rows[5].p50_us - load_kernel_us;
  if (const int n = absl::GetFlag(FLAGS_call_cost_iterations); n > 0) {
    std::printf(
        "\nThe backend's CUDA calls for one Store, in this process "
        "(host time per call):\n");
    for (const int idle : {0, absl::GetFlag(FLAGS_call_cost_idle_us)}) {
      for (const Timing& t :
           Must("timing the CUDA calls",
                MeasureCudaCallCosts(layout, tokens, n, idle))) {
        Print(t);
      }
      for (const int threads : {0, 8}) {
        Print(Must("timing CudaBackend::StoreOrdered",
                   MeasureBackendStore(layout, tokens, n, idle, threads)));
      }
    }
  }
  std::printf("\nPing / socket ping-pong: %.2fx\n", ping / socket);
  std::printf(
      "Store: completion p50 - kernel = %.1f us = %.2fx Ping (reply alone "
      "%.2fx)\n",
      store_over, store_over / ping, rows[2].p50_us / ping);
  std::printf(
      "Load:  completion p50 - kernel = %.1f us = %.2fx Ping (reply alone "
      "%.2fx)\n",
      load_over, load_over / ping, rows[4].p50_us / ping);

  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      return 1;
    }
    std::fprintf(f, "{\"rows\": [");
    for (size_t i = 0; i < rows.size(); ++i) {
      std::fprintf(f,
                   "%s{\"name\": \"%s\", \"p50_us\": %.3f, \"p99_us\": "
                   "%.3f, \"mean_us\": %.3f}",
                   i ? ", " : "", rows[i].name.c_str(), rows[i].p50_us,
                   rows[i].p99_us, rows[i].mean_us);
    }
    std::fprintf(f,
                 "], \"store_kernel_us\": %.3f, \"load_kernel_us\": %.3f, "
                 "\"store_overhead_x_ping\": %.3f, \"load_overhead_x_ping\": "
                 "%.3f}\n",
                 store_kernel_us, load_kernel_us, store_over / ping,
                 load_over / ping);
    std::fclose(f);
  }
  client.reset();
  absl::StatusOr<int> code = daemon->Signal(SIGTERM, absl::Seconds(60));
  if (!code.ok() || *code != 0) {
    std::fprintf(stderr, "the daemon did not stop cleanly\n");
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace kvdepot::testing

int main(int argc, char** argv) {
  // The in-process CudaBackend (MeasureBackendStore) refuses lazy loading,
  // as kvdepotd does; set before the first CUDA call.
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  absl::ParseCommandLine(argc, argv);
  kvdepot::testing::ApplyMallocKeepFreedFlag();
  return kvdepot::testing::Run();
}
