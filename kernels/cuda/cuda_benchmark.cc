// Bandwidth and latency of the CUDA kernels, as ratios measured in the same
// run (GPU_HOST.md):
//  1. device-to-device cudaMemcpy bandwidth (bytes read + written);
//  2. per kernel and format, achieved bandwidth (bytes the kernel reads +
//     writes) over that copy bandwidth at 64K and 1M tokens, with L2 flushed
//     (a buffer larger than L2 rewritten, or read: --l2_flush,
//     bench_ceiling.h) before every timed launch and before the copy;
//  3. GPU time at 1..8192 tokens (and the index kernels at 1K..128K
//     indices), averaged over CUDA-graph replays of many launches, also as a
//     multiple of an empty kernel's time.
// Inputs are finite activations; --specials adds the tests' NaN / Inf / huge
// values (about 1 in 256), whose tiles take the kernels' rare paths.
// Prints a table and writes JSON to --json.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/cuda/cuda_status.h"
#include "kernels/cuda/bench_ceiling.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/diagnostics.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch_internal.h"
#include "kernels/cuda/test_util.h"
#include "kernels/format_host.h"
#include "kernels/reference/reference.h"

ABSL_FLAG(std::string, json, "", "write results as JSON to this file");
ABSL_FLAG(int, iters, 20, "timed launches per bandwidth point");
ABSL_FLAG(int, graph_launches, 200, "launches per CUDA graph (latency)");
ABSL_FLAG(std::string, l2_flush, "write",
          "how L2 is emptied before each timed launch: write (rewrite a "
          "buffer larger than L2: dirty lines) or read (read it: clean "
          "lines; bench_ceiling.h)");
ABSL_FLAG(bool, specials, false,
          "inputs with about 1 in 256 values special (NaN, +-Inf, ...), as "
          "the tests use; default: finite activations");

namespace kvdepot::gpu {
namespace {

#define CHECK_OK(expr)                                        \
  do {                                                        \
    const absl::Status s_ = (expr);                           \
    if (!s_.ok()) {                                           \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, \
                   s_.ToString().c_str());                    \
      std::exit(1);                                           \
    }                                                         \
  } while (false)
#define CHECK_CUDA(expr) CHECK_OK(ToStatus((expr), #expr))

using Launcher = std::function<absl::Status(cudaStream_t)>;

struct Bench {
  cudaStream_t stream = nullptr;
  DeviceBuffer flush;  // > L2: rewritten or read before each timed launch
  ceiling::L2Flush flush_mode = ceiling::L2Flush::kWrite;

  cudaError_t FlushL2(int salt) {
    return ceiling::FlushL2(flush_mode, flush.get(), flush.bytes(), salt,
                            stream);
  }
  std::vector<std::string> json;

  // Mean GPU time of one launch in seconds with a cold L2: graph replays
  // of `iters` x (rewrite the flush buffer, launch) minus those of the
  // rewrites alone.
  double ColdSeconds(const Launcher& f, int iters) {
    auto replay = [&](bool with_kernel) {
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < iters; ++i) {
        CHECK_CUDA(FlushL2(i));
        if (with_kernel) CHECK_OK(f(stream));
      }
      CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
      CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      CHECK_CUDA(cudaGraphLaunch(exec, stream));  // warm-up
      const double s = TimeReplays(exec, 3);
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      return s;
    };
    const double with = replay(true);
    const double without = replay(false);
    return (with - without) / iters;
  }

  // Mean time of one stream launch between two events, L2 flushed before.
  double EventSeconds(const Launcher& f, int iters) {
    cudaEvent_t a, b;
    CHECK_CUDA(cudaEventCreate(&a));
    CHECK_CUDA(cudaEventCreate(&b));
    CHECK_OK(f(stream));  // warm-up
    double total = 0;
    for (int i = 0; i < iters; ++i) {
      CHECK_CUDA(FlushL2(i));
      CHECK_CUDA(cudaEventRecord(a, stream));
      CHECK_OK(f(stream));
      CHECK_CUDA(cudaEventRecord(b, stream));
      CHECK_CUDA(cudaEventSynchronize(b));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
      total += ms * 1e-3;
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return total / iters;
  }

  // Seconds per replay of an instantiated graph.
  double TimeReplays(cudaGraphExec_t exec, int replays) {
    cudaEvent_t a, b;
    CHECK_CUDA(cudaEventCreate(&a));
    CHECK_CUDA(cudaEventCreate(&b));
    CHECK_CUDA(cudaEventRecord(a, stream));
    for (int r = 0; r < replays; ++r) CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaEventRecord(b, stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return ms * 1e-3 / replays;
  }

  // Mean GPU time per launch over graph replays of `launches` launches.
  double GraphSeconds(const Launcher& f, int launches) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < launches; ++i) CHECK_OK(f(stream));
    CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));  // warm-up
    const double s = TimeReplays(exec, 5);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    return s / launches;
  }
};

struct Workload {
  PoolLayout layout;
  DeviceBuffer pool, kv, slots, random_slots, segments, data, scales;
  int64_t n = 0;
  int64_t num_segments = 0;
  double store_bytes = 0, load_bytes = 0;
};

Workload MakeWorkload(const std::string& name, int64_t n) {
  std::mt19937 rng(301);
  Workload w;
  const KVCacheFormat f = *FormatFromName(name);
  const int64_t bs = 64;
  w.layout = *MakePoolLayout(f, bs, (n + bs - 1) / bs, 1);
  w.n = n;
  w.pool = *DeviceBuffer::Open(w.layout.layer_bytes);
  CHECK_CUDA(cudaMemset(w.pool.get(), 0, w.layout.layer_bytes));
  const std::vector<uint8_t> kv = RandomKv(
      rng, n, f.elements(), InputDtype::kBF16, absl::GetFlag(FLAGS_specials));
  w.kv = *DeviceBuffer::Open(kv.size());
  CHECK_OK(w.kv.CopyFrom(kv.data(), kv.size()));
  // Store slots as a prefill writes them: token t goes to offset t % bs of
  // the (t / bs)-th block of a shuffled block list; the load plan reads the
  // same paged range back. random_slots scatters tokens over all slots.
  std::vector<int32_t> blocks(w.layout.num_blocks);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  std::vector<int32_t> slots(n);
  for (int64_t t = 0; t < n; ++t) {
    slots[t] = static_cast<int32_t>(blocks[t / bs] * bs + t % bs);
  }
  w.slots = *DeviceBuffer::Open(slots.size() * 4);
  CHECK_OK(w.slots.CopyFrom(slots.data(), slots.size() * 4));
  const std::vector<int32_t> random =
      RandomSlots(rng, n, w.layout.num_slots(), 0);
  w.random_slots = *DeviceBuffer::Open(random.size() * 4);
  CHECK_OK(w.random_slots.CopyFrom(random.data(), random.size() * 4));
  std::vector<int32_t> seg;
  for (int64_t t = 0; t < n; t += bs) {
    const int32_t len = static_cast<int32_t>(std::min<int64_t>(bs, n - t));
    seg.insert(seg.end(), {blocks[t / bs], 0, len, static_cast<int32_t>(t)});
  }
  w.num_segments = static_cast<int64_t>(seg.size() / 4);
  w.segments = *DeviceBuffer::Open(seg.size() * 4);
  CHECK_OK(w.segments.CopyFrom(seg.data(), seg.size() * 4));
  const int64_t data_row = LoadDataRowBytes(f);
  const int64_t scale_row = LoadScaleRowBytes(f);
  w.data = *DeviceBuffer::Open(n * data_row);
  w.scales = *DeviceBuffer::Open(std::max<int64_t>(n * scale_row, 4));
  w.store_bytes =
      static_cast<double>(n) * (2.0 * f.elements() + 4 + f.bytes_per_token());
  w.load_bytes =
      static_cast<double>(n) * (f.bytes_per_token() + data_row + scale_row) +
      16.0 * w.num_segments;
  return w;
}

Launcher StoreOf(Workload& w, bool hw, bool random_slots = false) {
  return [&w, hw, random_slots](cudaStream_t s) {
    LaunchOptions o;
    o.stream = s;
    o.hw_e4m3 = hw;
    return Store(w.layout, w.pool.get(), w.kv.get(), InputDtype::kBF16,
                 (random_slots ? w.random_slots : w.slots).as<int32_t>(), w.n,
                 o);
  };
}

using Path = internal::DsMlaStorePath;

// One of DS_MLA_FP8's two store kernels, named (launch_internal.h).
Launcher DsMlaStoreOf(Workload& w, Path path) {
  return [&w, path](cudaStream_t s) {
    return ToStatus(internal::LaunchDsMlaStore(
                        w.layout, w.pool.as<uint8_t>(), w.kv.as<uint16_t>(),
                        w.slots.as<int32_t>(), w.n, /*hw_cvt=*/true,
                        internal::Launch{s, false}, path),
                    "DS_MLA_FP8 store");
  };
}

Launcher LoadOf(Workload& w) {
  return [&w](cudaStream_t s) {
    LaunchOptions o;
    o.stream = s;
    return LoadSegments(w.layout, w.pool.get(), w.segments.as<int32_t>(),
                        w.num_segments, w.data.get(), w.scales.get(), o);
  };
}

}  // namespace

int Main() {
  Bench bench;
  CHECK_CUDA(cudaStreamCreateWithFlags(&bench.stream, cudaStreamNonBlocking));
  int device = 0, l2 = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  bench.flush = *DeviceBuffer::Open(std::max<int64_t>(4LL * l2, 256 << 20));
  if (!ceiling::ParseL2Flush(absl::GetFlag(FLAGS_l2_flush).c_str(),
                             &bench.flush_mode)) {
    std::fprintf(stderr, "--l2_flush: '%s' is neither write nor read\n",
                 absl::GetFlag(FLAGS_l2_flush).c_str());
    return 2;
  }
  // Defined bytes for the read flush (bench_ceiling.h).
  CHECK_CUDA(cudaMemset(bench.flush.get(), 0, bench.flush.bytes()));
  const int iters = absl::GetFlag(FLAGS_iters);
  const int launches = absl::GetFlag(FLAGS_graph_launches);

  // 1. Copy bandwidth.
  const int64_t copy_bytes = int64_t{1} << 30;
  DeviceBuffer src = *DeviceBuffer::Open(copy_bytes);
  DeviceBuffer dst = *DeviceBuffer::Open(copy_bytes);
  CHECK_CUDA(cudaMemset(src.get(), 1, copy_bytes));
  // Timed on the stream with events (a graph memcpy node may run on a copy
  // engine, slower than the stream's device-to-device copy).
  const double copy_s = bench.EventSeconds(
      [&](cudaStream_t s) {
        return ToStatus(cudaMemcpyAsync(dst.get(), src.get(), copy_bytes,
                                        cudaMemcpyDeviceToDevice, s),
                        "copy");
      },
      iters);
  const double copy_bw = 2.0 * copy_bytes / copy_s;
  std::printf("device: %s, L2 %d MiB\n", prop.name, l2 >> 20);
  std::printf("cudaMemcpy D2D: %.1f GB/s (read + write)\nL2 flushed by: %s\n\n",
              copy_bw / 1e9, ceiling::L2FlushName(bench.flush_mode));
  bench.json.push_back(
      absl::StrFormat("\"device\": \"%s\", \"copy_bandwidth_gbps\": %.1f, "
                      "\"special_inputs\": %s, \"l2_flush\": \"%s\"",
                      prop.name, copy_bw / 1e9,
                      absl::GetFlag(FLAGS_specials) ? "true" : "false",
                      ceiling::L2FlushName(bench.flush_mode)));

  // 2. Bandwidth at 64K and 1M tokens.
  const std::vector<std::string> formats = {
      "V41",         "V41_FP4",   "FP4_INDEX", "FP8_FP32SF_INDEX",
      "MXFP8_INDEX", "BF16(512)", "DS_MLA_FP8"};
  std::printf("%-18s %-16s %9s %10s %9s\n", "format", "kernel", "tokens",
              "GB/s", "of copy");
  std::vector<std::string> bw_rows;
  for (const std::string& name : formats) {
    for (int64_t n : {int64_t{1} << 16, int64_t{1} << 20}) {
      Workload w = MakeWorkload(name, n);
      struct K {
        const char* kernel;
        Launcher f;
        double bytes;
      };
      std::vector<K> ks = {{"store", StoreOf(w, true), w.store_bytes},
                           {"load", LoadOf(w), w.load_bytes}};
      if (name == "V41" || name == "MXFP8_INDEX") {
        ks.push_back({"store_int_e4m3", StoreOf(w, false), w.store_bytes});
      }
      ks.push_back({"store_rand_slots", StoreOf(w, true, true), w.store_bytes});
      if (name == "DS_MLA_FP8") {
        // The same traffic with no math (bench_ceiling.h): what the memory
        // system gives these accesses; and with the records in slot order.
        ks.push_back({"store_ceiling",
                      [&w](cudaStream_t s) {
                        return ToStatus(ceiling::DsMlaStoreTraffic(
                                            w.layout, w.pool.as<uint8_t>(),
                                            w.kv.as<uint16_t>(),
                                            w.slots.as<int32_t>(), w.n, s),
                                        "store ceiling");
                      },
                      w.store_bytes});
        ks.push_back({"store_ceil_seq",
                      [&w](cudaStream_t s) {
                        return ToStatus(
                            ceiling::DsMlaStoreTraffic(
                                w.layout, w.pool.as<uint8_t>(),
                                w.kv.as<uint16_t>(), nullptr, w.n, s),
                            "store ceiling, slots in order");
                      },
                      w.store_bytes});
        ks.push_back(
            {"store_warps", DsMlaStoreOf(w, Path::kWarps), w.store_bytes});
        ks.push_back(
            {"store_bulk", DsMlaStoreOf(w, Path::kBulk), w.store_bytes});
        ks.push_back({"store_ceil_bulk",
                      [&w](cudaStream_t s) {
                        return ToStatus(ceiling::DsMlaStoreTrafficBulk(
                                            w.layout, w.pool.as<uint8_t>(),
                                            w.kv.as<uint16_t>(),
                                            w.slots.as<int32_t>(), w.n, s),
                                        "store ceiling, bulk copies");
                      },
                      w.store_bytes});
        ks.push_back({"store_ceil_flat",
                      [&w](cudaStream_t s) {
                        return ToStatus(ceiling::DsMlaStoreTrafficFlat(
                                            w.pool.as<uint8_t>(),
                                            w.kv.as<uint16_t>(), w.n, s),
                                        "store ceiling, contiguous copies");
                      },
                      w.store_bytes});
        ks.push_back({"load_ceiling",
                      [&w](cudaStream_t s) {
                        return ToStatus(
                            ceiling::DsMlaLoadTraffic(
                                w.layout, w.pool.as<uint8_t>(),
                                w.segments.as<int32_t>(), w.num_segments,
                                w.data.as<uint16_t>(), s),
                            "load ceiling");
                      },
                      w.load_bytes});
        ks.push_back({"load_ceil_pers",
                      [&w](cudaStream_t s) {
                        return ToStatus(
                            ceiling::DsMlaLoadTrafficPersistent(
                                w.layout, w.pool.as<uint8_t>(),
                                w.segments.as<int32_t>(), w.num_segments,
                                w.data.as<uint16_t>(), s),
                            "load ceiling, persistent grid");
                      },
                      w.load_bytes});
        ks.push_back({"load_ceil_flat",
                      [&w](cudaStream_t s) {
                        return ToStatus(
                            ceiling::DsMlaLoadTrafficFlat(
                                w.layout, w.pool.as<uint8_t>(),
                                w.segments.as<int32_t>(), w.num_segments,
                                w.data.as<uint16_t>(), s),
                            "load ceiling, contiguous copies");
                      },
                      w.load_bytes});
      }
      for (const K& k : ks) {
        const double t = bench.ColdSeconds(k.f, iters);
        const double bw = k.bytes / t;
        std::printf("%-18s %-16s %9lld %10.1f %8.1f%%\n", name.c_str(),
                    k.kernel, static_cast<long long>(n), bw / 1e9,
                    100.0 * bw / copy_bw);
        bw_rows.push_back(absl::StrFormat(
            "{\"format\": \"%s\", \"kernel\": \"%s\", \"tokens\": %d, "
            "\"seconds\": %.9g, \"gbps\": %.1f, \"fraction_of_copy\": %.4f}",
            name, k.kernel, n, t, bw / 1e9, bw / copy_bw));
      }
    }
  }
  bench.json.push_back(
      absl::StrCat("\"bandwidth\": [", absl::StrJoin(bw_rows, ", "), "]"));

  // DS_MLA_FP8's two store kernels by batch size (the store takes the bulk
  // one from internal::kDsMlaBulkMinTokens tokens).
  std::printf("\nDS_MLA_FP8 store, %% of copy: %9s %8s %8s\n", "tokens",
              "warps", "bulk");
  std::vector<std::string> by_tokens;
  for (int64_t n = int64_t{1} << 13; n <= int64_t{1} << 20; n *= 2) {
    Workload w = MakeWorkload("DS_MLA_FP8", n);
    const double warps =
        w.store_bytes / bench.ColdSeconds(DsMlaStoreOf(w, Path::kWarps), iters);
    const double bulk =
        w.store_bytes / bench.ColdSeconds(DsMlaStoreOf(w, Path::kBulk), iters);
    std::printf("%38lld %7.1f%% %7.1f%%\n", static_cast<long long>(n),
                100.0 * warps / copy_bw, 100.0 * bulk / copy_bw);
    by_tokens.push_back(
        absl::StrFormat("{\"tokens\": %d, \"warps\": %.4f, \"bulk\": %.4f}", n,
                        warps / copy_bw, bulk / copy_bw));
  }
  bench.json.push_back(absl::StrCat("\"ds_mla_store_by_tokens\": [",
                                    absl::StrJoin(by_tokens, ", "), "]"));

  // 3. Latency.
  const double empty_s = bench.GraphSeconds(
      [](cudaStream_t s) {
        LaunchOptions o;
        o.stream = s;
        return LaunchEmptyKernel(o);
      },
      launches);
  std::printf("\nempty kernel: %.2f us per launch (graph replay)\n",
              empty_s * 1e6);
  bench.json.push_back(
      absl::StrFormat("\"empty_kernel_us\": %.3f", empty_s * 1e6));
  std::printf("%-18s %-8s %7s %9s %8s\n", "format", "kernel", "tokens", "us",
              "x empty");
  std::vector<std::string> lat_rows;
  for (const std::string& name : formats) {
    for (int64_t n : {1, 16, 128, 1024, 8192}) {
      Workload w = MakeWorkload(name, n);
      for (auto [kernel, f] :
           {std::pair<const char*, Launcher>{"store", StoreOf(w, true)},
            {"load", LoadOf(w)}}) {
        const double t = bench.GraphSeconds(f, launches);
        std::printf("%-18s %-8s %7lld %9.2f %8.2f\n", name.c_str(), kernel,
                    static_cast<long long>(n), t * 1e6, t / empty_s);
        lat_rows.push_back(absl::StrFormat(
            "{\"format\": \"%s\", \"kernel\": \"%s\", \"tokens\": %d, "
            "\"us\": %.3f, \"x_empty\": %.2f}",
            name, kernel, n, t * 1e6, t / empty_s));
      }
    }
  }
  // Index kernels at 1K, 16K, 128K indices.
  for (int64_t n : {int64_t{1} << 10, int64_t{1} << 14, int64_t{1} << 17}) {
    std::mt19937 rng(302);
    const int32_t k = 512, width = 512;
    const int64_t rows = n / k;
    std::vector<int32_t> topk(n), valid(rows, k), tokens(rows, 1 << 20),
        table(rows * 2048), ids(rows, 1), starts(rows, 12345),
        lens(rows, width), pivots(rows * 4);
    for (int32_t& x : topk) x = static_cast<int32_t>(rng() % (1 << 17));
    for (int32_t& x : table) x = static_cast<int32_t>(rng() % 4096);
    for (int64_t r = 0; r < rows; ++r) {
      pivots[4 * r] = 10;
      pivots[4 * r + 1] = 300;
      pivots[4 * r + 2] = 5000;
      pivots[4 * r + 3] = 100;
    }
    std::vector<DeviceBuffer> keep;
    auto up = [&keep](const std::vector<int32_t>& v) {
      keep.push_back(*DeviceBuffer::Open(v.size() * 4));
      CHECK_OK(keep.back().CopyFrom(v.data(), v.size() * 4));
      return keep.back().as<int32_t>();
    };
    int32_t* d_topk = up(topk);
    int32_t *d_valid = up(valid), *d_tokens = up(tokens), *d_table = up(table);
    int32_t *d_ids = up(ids), *d_starts = up(starts), *d_lens = up(lens);
    int32_t* d_pivots = up(pivots);
    int32_t* d_out = up(std::vector<int32_t>(2 * n, 0));
    int32_t* d_out2 = up(std::vector<int32_t>(2 * n, 0));
    DeviceBuffer counter = *DeviceBuffer::Open(8);
    CHECK_CUDA(cudaMemset(counter.get(), 0, 8));
    auto opts = [](cudaStream_t s) {
      LaunchOptions o;
      o.stream = s;
      return o;
    };
    const std::vector<std::pair<const char*, Launcher>> ops = {
        {"convert_topk",
         [&](cudaStream_t s) {
           return ConvertTopk(d_topk, rows, k, d_valid, d_tokens, d_table,
                              nullptr, 2048, 2048, 64, 4096,
                              counter.as<unsigned long long>(), opts(s));
         }},
        {"swa_decode_index",
         [&](cudaStream_t s) {
           return SwaDecodeIndex(d_ids, d_starts, d_lens, rows, width, 4096,
                                 d_out, opts(s));
         }},
        {"expand_swa_index",
         [&](cudaStream_t s) {
           return ExpandSwaIndex(d_pivots, rows, width, d_out, opts(s));
         }},
        {"kv_index_cat",
         [&](cudaStream_t s) {
           return KvIndexCat(d_out, width / 2, d_topk, width / 2, 2 * rows,
                             5120, d_out2, opts(s));
         }},
    };
    for (const auto& [kernel, f] : ops) {
      const double t = bench.GraphSeconds(f, launches);
      std::printf("%-18s %-8s %7lld %9.2f %8.2f\n", "index", kernel,
                  static_cast<long long>(n), t * 1e6, t / empty_s);
      lat_rows.push_back(absl::StrFormat(
          "{\"format\": \"index\", \"kernel\": \"%s\", \"tokens\": %d, "
          "\"us\": %.3f, \"x_empty\": %.2f}",
          kernel, n, t * 1e6, t / empty_s));
    }
  }
  bench.json.push_back(
      absl::StrCat("\"latency\": [", absl::StrJoin(lat_rows, ", "), "]"));

  const std::string path = absl::GetFlag(FLAGS_json);
  if (!path.empty()) {
    FILE* out = std::fopen(path.c_str(), "w");
    if (out == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      return 1;
    }
    std::fprintf(out, "{%s}\n", absl::StrJoin(bench.json, ",\n ").c_str());
    std::fclose(out);
  }
  cudaStreamDestroy(bench.stream);
  return 0;
}

}  // namespace kvdepot::gpu

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvdepot::gpu::Main();
}
