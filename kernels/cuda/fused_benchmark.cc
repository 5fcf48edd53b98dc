// The fused store (SPEC §8) on the GPU host, against the same stages as
// separate kernels (fused_stages.h: RMSNorm, RoPE, Hadamard, each writing
// BF16, then the plain store) and against the plain store alone, as ratios
// of the same run's device-to-device copy bandwidth:
//  1. bandwidth at 64K and 1M tokens (--bandwidth_tokens), L2 flushed
//     before every timed launch and before the copy (--l2_flush: rewritten
//     or read, bench_ceiling.h); for DS_MLA_FP8 in the MLA configuration
//     also fused_mla.cu's kernels by name (f_warps, f_ahead, f_ahead5,
//     f_bulk);
//  2. GPU time at 1..1024 tokens in CUDA-graph replay (goal: <= 3 us),
//     also with PDL on (fused+pdl), as the step path chains its launches,
//     next to the plain store of the same tokens and an empty kernel (the
//     graph's launch floor); first in a fresh process, then again after
//     the bandwidth table.
// Inputs are finite activations (normal values times a per-token
// magnitude); --specials adds the tests' NaN / Inf / huge values (about 1
// in 256), whose tiles take the kernels' rare paths: with the norm on, one
// NaN or Inf makes its whole token's normalized range NaN.
// Byte model of the fused kernel (each counted once):
//   per token: input 2D + record bytes_per_token + slot 4
//              + RoPE on: position 8 + its cos/sin row 4 rope_dim
//              + cast_back on: 2D
//   once: norm weights 2 (norm_end - norm_begin)
// (prefill positions 0..n-1, so every token reads a distinct cos/sin row).
// Prints a table and writes JSON to --json.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/cuda/cuda_status.h"
#include "kernels/cuda/bench_ceiling.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/fused_internal.h"
#include "kernels/cuda/fused_kernels.h"
#include "kernels/cuda/fused_stages.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/test_util.h"
#include "kernels/format_host.h"
#include "kernels/quant.h"

ABSL_FLAG(std::string, json, "", "write results as JSON to this file");
ABSL_FLAG(int, iters, 20, "timed launches per bandwidth point");
ABSL_FLAG(int, graph_launches, 200, "launches per CUDA graph (latency)");
ABSL_FLAG(int64_t, profile_tokens, 0,
          "> 0: only launch the fused kernel of each config at this many "
          "tokens, three times, and exit (for a profiler such as ncu)");
ABSL_FLAG(bool, bandwidth, true,
          "also the copy and the bandwidth table (--bandwidth_tokens), then "
          "the latency table again (--nobandwidth: the latency table alone)");
ABSL_FLAG(std::vector<std::string>, bandwidth_tokens,
          std::vector<std::string>({"65536", "1048576"}),
          "token counts of the bandwidth table (e.g. 65536,65537 puts "
          "fused_row.cu's threshold between two rows)");
ABSL_FLAG(std::vector<std::string>, configs,
          std::vector<std::string>({"mla", "mla+cast_back", "all_stages",
                                    "hadamard", "norm+rope"}),
          "configurations to run, in this order; also hadamard_fp4 and "
          "hadamard_fp32sf (the Hadamard of 128 on FP4_INDEX and "
          "FP8_FP32SF_INDEX)");
ABSL_FLAG(std::string, l2_flush, "write",
          "how L2 is emptied before each timed launch: write (rewrite a "
          "buffer larger than L2: dirty lines) or read (read it: clean "
          "lines; bench_ceiling.h)");
ABSL_FLAG(bool, specials, false,
          "inputs with about 1 in 256 values special (NaN, +-Inf, ...), as "
          "the tests use; default: finite activations");

namespace kvdepot::gpu {
namespace {

constexpr int kWarpLanes = 32;
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

cudaStream_t g_stream = nullptr;
DeviceBuffer* g_flush = nullptr;
ceiling::L2Flush g_flush_mode = ceiling::L2Flush::kWrite;

cudaError_t FlushL2(int salt) {
  return ceiling::FlushL2(g_flush_mode, g_flush->get(), g_flush->bytes(), salt,
                          g_stream);
}

double TimeReplays(cudaGraphExec_t exec, int replays) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  CHECK_CUDA(cudaEventRecord(a, g_stream));
  for (int r = 0; r < replays; ++r) CHECK_CUDA(cudaGraphLaunch(exec, g_stream));
  CHECK_CUDA(cudaEventRecord(b, g_stream));
  CHECK_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms * 1e-3 / replays;
}

// Seconds per replay of a graph of `count` x (flush?, f).
double Replay(const Launcher& f, int count, bool flush, bool with_kernel) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < count; ++i) {
    if (flush) {
      CHECK_CUDA(FlushL2(i));
    }
    if (with_kernel) CHECK_OK(f(g_stream));
  }
  CHECK_CUDA(cudaStreamEndCapture(g_stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  CHECK_CUDA(cudaGraphLaunch(exec, g_stream));  // warm-up
  const double s = TimeReplays(exec, 3);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return s;
}

// Mean GPU time of one launch with a cold L2 (flush rewrites subtracted).
double ColdSeconds(const Launcher& f, int iters) {
  return (Replay(f, iters, true, true) - Replay(f, iters, true, false)) / iters;
}

// Mean GPU time per launch, warm, in graph replay.
double GraphSeconds(const Launcher& f, int launches) {
  return Replay(f, launches, false, true) / launches;
}

struct Config {
  std::string name;
  std::string format;
  FusedParams p;  // ranges only; arrays are filled per workload
  bool cast_back = false;
};

// Every configuration --configs can name.
std::vector<Config> AllConfigs() {
  std::vector<Config> c;
  Config mla{"mla", "DS_MLA_FP8"};
  mla.p.norm_end = 512;
  mla.p.rope = RopeStyle::kInterleaved;
  mla.p.rope_offset = 512;
  mla.p.rope_dim = 64;
  c.push_back(mla);
  Config mla_cast = mla;
  mla_cast.name = "mla+cast_back";
  mla_cast.cast_back = true;
  c.push_back(mla_cast);
  Config v41{"all_stages", "V41"};
  v41.p.norm_end = 512;
  v41.p.rope = RopeStyle::kNeox;
  v41.p.rope_offset = 448;
  v41.p.rope_dim = 64;
  v41.p.hadamard_len = 512;
  c.push_back(v41);
  Config idx{"hadamard", "MXFP8_INDEX"};
  idx.p.hadamard_len = 128;
  c.push_back(idx);
  Config bf{"norm+rope", "BF16(512)"};
  bf.p.norm_end = 512;
  bf.p.rope = RopeStyle::kNeox;
  bf.p.rope_offset = 448;
  bf.p.rope_dim = 64;
  c.push_back(bf);
  Config fp4{"hadamard_fp4", "FP4_INDEX"};
  fp4.p.hadamard_len = 128;
  c.push_back(fp4);
  Config fp32sf{"hadamard_fp32sf", "FP8_FP32SF_INDEX"};
  fp32sf.p.hadamard_len = 128;
  c.push_back(fp32sf);
  return c;
}

// The configurations of --configs; exits on a name it does not know.
const std::vector<Config>& Configs() {
  static const std::vector<Config>* configs = [] {
    const std::vector<Config> all = AllConfigs();
    auto* chosen = new std::vector<Config>();
    for (const std::string& name : absl::GetFlag(FLAGS_configs)) {
      const auto it =
          std::find_if(all.begin(), all.end(),
                       [&](const Config& c) { return c.name == name; });
      if (it == all.end()) {
        std::fprintf(stderr, "--configs: no configuration '%s'\n",
                     name.c_str());
        std::exit(2);
      }
      chosen->push_back(*it);
    }
    return chosen;
  }();
  return *configs;
}

struct Workload {
  PoolLayout layout;
  FusedParams p;
  int64_t n = 0;
  DeviceBuffer pool, kv, tmp, slots, weight, positions, cos_sin, cast;
  double bytes = 0;  // the byte model above
};

template <typename T>
DeviceBuffer Upload(const std::vector<T>& v) {
  DeviceBuffer b = *DeviceBuffer::Open(v.size() * sizeof(T));
  CHECK_OK(b.CopyFrom(v.data(), v.size() * sizeof(T)));
  return b;
}

Workload Make(const Config& c, int64_t n) {
  std::mt19937 rng(1406);
  Workload w;
  const KVCacheFormat f = *FormatFromName(c.format);
  const int64_t bs = 64, d = f.elements();
  w.layout = *MakePoolLayout(f, bs, (n + bs - 1) / bs, 1);
  w.n = n;
  w.p = c.p;
  w.pool = *DeviceBuffer::Open(w.layout.layer_bytes);
  CHECK_CUDA(cudaMemset(w.pool.get(), 0, w.layout.layer_bytes));
  w.kv = Upload(RandomKv(rng, n, static_cast<int32_t>(d), InputDtype::kBF16,
                         absl::GetFlag(FLAGS_specials)));
  w.tmp = *DeviceBuffer::Open(n * d * 2);
  // Prefill slots: consecutive tokens fill shuffled blocks.
  std::vector<int32_t> blocks(w.layout.num_blocks);
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = static_cast<int>(i);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  std::vector<int32_t> slots(n);
  for (int64_t t = 0; t < n; ++t) {
    slots[t] = static_cast<int32_t>(blocks[t / bs] * bs + t % bs);
  }
  w.slots = Upload(slots);
  double per_token = 2.0 * d + f.bytes_per_token() + 4;
  double once = 0;
  if (w.p.norm()) {
    std::vector<uint16_t> weight(w.p.norm_end - w.p.norm_begin);
    for (uint16_t& x : weight) x = FloatToBf16(0.5f + (rng() % 100) / 100.0f);
    w.weight = Upload(weight);
    w.p.norm_weight = w.weight.as<uint16_t>();
    once += 2.0 * weight.size();
  }
  if (w.p.rope != RopeStyle::kNone) {
    std::vector<int64_t> pos(n);
    for (int64_t t = 0; t < n; ++t) pos[t] = t;
    std::vector<float> cs(n * w.p.rope_dim);
    for (size_t i = 0; i < cs.size(); ++i) cs[i] = (rng() % 2001) / 1000.0f - 1;
    w.positions = Upload(pos);
    w.cos_sin = Upload(cs);
    w.p.positions = w.positions.as<int64_t>();
    w.p.cos_sin = w.cos_sin.as<float>();
    w.p.max_position = n;
    per_token += 8 + 4.0 * w.p.rope_dim;
  }
  if (c.cast_back) {
    w.cast = *DeviceBuffer::Open(n * d * 2);
    per_token += 2.0 * d;
  }
  w.bytes = per_token * n + once;
  return w;
}

// The fused kernel; with `pdl`, launched as the step path launches it
// (Programmatic Dependent Launch: in a graph of back-to-back launches each
// one starts while the previous runs and waits in the kernel for it).
Launcher FusedOf(Workload& w, bool pdl = false) {
  return [&w, pdl](cudaStream_t s) {
    LaunchOptions o;
    o.stream = s;
    o.pdl = pdl;
    return FusedStore(
        w.layout, w.pool.get(), w.kv.as<uint16_t>(), w.p, w.slots.as<int32_t>(),
        w.n, w.cast.get() != nullptr ? w.cast.as<uint16_t>() : nullptr, o);
  };
}

// The unfused pipeline: each stage a kernel writing BF16, then the store
// (and, for cast_back, a load of the stored tokens is not modelled: the
// separate pipeline's cast_back is its BF16 input to the store).
Launcher StagesOf(Workload& w) {
  return [&w](cudaStream_t s) -> absl::Status {
    const int32_t d = w.layout.format.elements();
    const FusedParams& p = w.p;
    uint16_t* x = w.tmp.as<uint16_t>();
    if (p.norm()) {
      RETURN_IF_CUDA_ERROR(
          stages::RmsNorm(w.kv.as<uint16_t>(), x, w.n, d, p.norm_begin,
                          p.norm_end, p.norm_weight, p.eps, s),
          "rmsnorm");
    } else {
      RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(x, w.kv.get(), w.n * d * 2,
                                           cudaMemcpyDeviceToDevice, s),
                           "copy");
    }
    if (p.rope != RopeStyle::kNone) {
      RETURN_IF_CUDA_ERROR(stages::Rope(x, w.n, d, p.rope, p.rope_offset,
                                        p.rope_dim, p.positions, p.cos_sin, s),
                           "rope");
    }
    if (p.hadamard()) {
      RETURN_IF_CUDA_ERROR(
          stages::Hadamard(x, w.n, d, p.hadamard_begin, p.hadamard_len, s),
          "hadamard");
    }
    LaunchOptions o;
    o.stream = s;
    return Store(w.layout, w.pool.get(), x, InputDtype::kBF16,
                 w.slots.as<int32_t>(), w.n, o);
  };
}

// DS_MLA_FP8 in the MLA configuration: one of fused_mla.cu's two kernels
// by name (FusedOf takes the bulk one from kFusedMlaBulkMinTokens tokens).
Launcher FusedMlaOf(Workload& w, internal::FusedMlaPath path) {
  return [&w, path](cudaStream_t s) -> absl::Status {
    RETURN_IF_CUDA_ERROR(
        internal::LaunchFusedMla(
            w.layout, static_cast<uint8_t*>(w.pool.get()), w.kv.as<uint16_t>(),
            w.p, w.slots.as<int32_t>(), w.n,
            w.cast.get() != nullptr ? w.cast.as<uint16_t>() : nullptr,
            internal::Launch{s, false}, path),
        "fused_mla.cu");
    return absl::OkStatus();
  };
}

Launcher PlainStoreOf(Workload& w) {
  return [&w](cudaStream_t s) {
    LaunchOptions o;
    o.stream = s;
    return Store(w.layout, w.pool.get(), w.kv.get(), InputDtype::kBF16,
                 w.slots.as<int32_t>(), w.n, o);
  };
}

}  // namespace

// Copy bandwidth (bytes read + written) from events on the stream, then
// the fused kernel, the separate stages and the plain store at 64K and 1M
// tokens, L2 flushed before every launch.
void BandwidthTable(const cudaDeviceProp& prop,
                    std::vector<std::string>& json) {
  const int iters = absl::GetFlag(FLAGS_iters);
  std::vector<int64_t> tokens;
  for (const std::string& t : absl::GetFlag(FLAGS_bandwidth_tokens)) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(t, &n) || n <= 0 || n > (int64_t{1} << 24)) {
      std::fprintf(stderr, "--bandwidth_tokens: '%s' is not in [1, 2^24]\n",
                   t.c_str());
      std::exit(2);
    }
    tokens.push_back(n);
  }
  const int64_t copy_bytes = int64_t{1} << 30;
  DeviceBuffer src = *DeviceBuffer::Open(copy_bytes);
  DeviceBuffer dst = *DeviceBuffer::Open(copy_bytes);
  CHECK_CUDA(cudaMemset(src.get(), 1, copy_bytes));
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  double copy_s = 0;
  for (int i = 0; i <= iters; ++i) {
    CHECK_CUDA(FlushL2(i));
    CHECK_CUDA(cudaEventRecord(a, g_stream));
    CHECK_CUDA(cudaMemcpyAsync(dst.get(), src.get(), copy_bytes,
                               cudaMemcpyDeviceToDevice, g_stream));
    CHECK_CUDA(cudaEventRecord(b, g_stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    if (i > 0) copy_s += ms * 1e-3 / iters;  // the first is a warm-up
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  const double copy_bw = 2.0 * copy_bytes / copy_s;
  std::printf(
      "device: %s\ncudaMemcpy D2D: %.1f GB/s (read + write)\nL2 flushed by: "
      "%s\n\n",
      prop.name, copy_bw / 1e9, ceiling::L2FlushName(g_flush_mode));
  json.push_back(absl::StrFormat(
      "\"device\": \"%s\", \"copy_bandwidth_gbps\": %.1f, \"l2_flush\": "
      "\"%s\"",
      prop.name, copy_bw / 1e9, ceiling::L2FlushName(g_flush_mode)));

  std::printf("%-14s %-12s %-8s %8s %10s %10s %8s\n", "config", "format",
              "kernel", "tokens", "us", "GB/s", "of copy");
  std::vector<std::string> rows;
  for (const Config& c : Configs()) {
    for (int64_t n : tokens) {
      Workload w = Make(c, n);
      std::vector<std::pair<const char*, Launcher>> ks = {
          {"fused", FusedOf(w)},
          {"stages", StagesOf(w)},
          {"store", PlainStoreOf(w)}};
      if (c.format == "DS_MLA_FP8" && internal::FusedMlaApplies(w.p) &&
          w.p.rope != RopeStyle::kNeox) {
        ks.push_back(
            {"f_warps", FusedMlaOf(w, internal::FusedMlaPath::kWarps)});
        ks.push_back(
            {"f_ahead", FusedMlaOf(w, internal::FusedMlaPath::kAhead)});
        ks.push_back(
            {"f_ahead5", FusedMlaOf(w, internal::FusedMlaPath::kAhead5)});
        ks.push_back({"f_bulk", FusedMlaOf(w, internal::FusedMlaPath::kBulk)});
      }
      for (const auto& [kernel, f] : ks) {
        const double t = ColdSeconds(f, iters);
        // The fused byte model for every row: the same work, so the ratio
        // compares times (the plain store does less work).
        const double bw = w.bytes / t;
        std::printf("%-14s %-12s %-8s %8lld %10.1f %10.1f %7.1f%%\n",
                    c.name.c_str(), c.format.c_str(), kernel,
                    static_cast<long long>(n), t * 1e6, bw / 1e9,
                    100.0 * bw / copy_bw);
        rows.push_back(absl::StrFormat(
            "{\"config\": \"%s\", \"format\": \"%s\", \"kernel\": \"%s\", "
            "\"tokens\": %d, \"seconds\": %.9g, \"model_bytes\": %.0f, "
            "\"gbps\": %.1f, \"fraction_of_copy\": %.4f}",
            c.name, c.format, kernel, n, t, w.bytes, bw / 1e9, bw / copy_bw));
      }
    }
  }
  json.push_back(
      absl::StrCat("\"bandwidth\": [", absl::StrJoin(rows, ", "), "]"));
}

// GPU time per launch at 1..1024 tokens in graph replay, warm, with its
// floors: an empty kernel in the same graph and a warp's code fetch
// (bench_ceiling.h). `when` tags the rows ("fresh": before the bandwidth
// table; "after_bandwidth": after it).
void LatencyTable(const char* when, std::vector<std::string>& json) {
  const int launches = absl::GetFlag(FLAGS_graph_launches);
  std::vector<std::string> lat;
  const double empty_s = GraphSeconds(
      [](cudaStream_t s) {
        return ToStatus(ceiling::EmptyKernel(s), "empty kernel");
      },
      launches);
  std::printf("\n[%s] empty kernel: %.2f us per launch (graph replay, warm)\n",
              when, empty_s * 1e6);
  lat.push_back(absl::StrFormat(
      "{\"config\": \"empty_kernel\", \"kernel\": \"empty\", \"tokens\": 0, "
      "\"us\": %.3f, \"when\": \"%s\"}",
      empty_s * 1e6, when));
  DeviceBuffer fetch_out = *DeviceBuffer::Open(4 * kWarpLanes);
  for (const bool unrolled : {false, true}) {
    const double t = GraphSeconds(
        [&](cudaStream_t s) {
          return ToStatus(
              ceiling::CodeFetchKernel(unrolled, fetch_out.as<float>(), s),
              "code fetch kernel");
        },
        launches);
    std::printf("[%s] 4096 fmas, %s: %.2f us per launch\n", when,
                unrolled ? "straight code (64 KB)" : "a loop", t * 1e6);
    lat.push_back(absl::StrFormat(
        "{\"config\": \"fmas_%s\", \"kernel\": \"fmas\", \"tokens\": 0, "
        "\"us\": %.3f, \"when\": \"%s\"}",
        unrolled ? "straight" : "loop", t * 1e6, when));
  }
  std::printf("\n%-14s %-10s %7s %9s  (graph replay, warm, %s)\n", "config",
              "kernel", "tokens", "us", when);
  for (const Config& c : Configs()) {
    for (int64_t n : {1, 16, 128, 1024}) {
      Workload w = Make(c, n);
      for (const auto& [kernel, f] :
           {std::pair<const char*, Launcher>{"fused", FusedOf(w)},
            {"fused+pdl", FusedOf(w, true)},
            {"stages", StagesOf(w)},
            {"store", PlainStoreOf(w)}}) {
        const double t = GraphSeconds(f, launches);
        std::printf("%-14s %-10s %7lld %9.2f\n", c.name.c_str(), kernel,
                    static_cast<long long>(n), t * 1e6);
        lat.push_back(absl::StrFormat(
            "{\"config\": \"%s\", \"kernel\": \"%s\", \"tokens\": %d, "
            "\"us\": %.3f, \"when\": \"%s\"}",
            c.name, kernel, n, t * 1e6, when));
      }
    }
  }
  json.push_back(
      absl::StrFormat("\"latency_%s\": [%s]", when, absl::StrJoin(lat, ", ")));
}

int Main() {
  CHECK_CUDA(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  int device = 0, l2 = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  DeviceBuffer flush =
      *DeviceBuffer::Open(std::max<int64_t>(4LL * l2, 256 << 20));
  g_flush = &flush;
  if (!ceiling::ParseL2Flush(absl::GetFlag(FLAGS_l2_flush).c_str(),
                             &g_flush_mode)) {
    std::fprintf(stderr, "--l2_flush: '%s' is neither write nor read\n",
                 absl::GetFlag(FLAGS_l2_flush).c_str());
    return 2;
  }
  // Defined bytes for the read flush (bench_ceiling.h).
  CHECK_CUDA(cudaMemset(flush.get(), 0, flush.bytes()));
  std::vector<std::string> json = {
      absl::StrFormat("\"special_inputs\": %s",
                      absl::GetFlag(FLAGS_specials) ? "true" : "false")};
  if (const int64_t n = absl::GetFlag(FLAGS_profile_tokens); n > 0) {
    for (const Config& c : Configs()) {
      Workload w = Make(c, n);
      const Launcher f = FusedOf(w);
      for (int i = 0; i < 3; ++i) CHECK_OK(f(g_stream));
      CHECK_CUDA(cudaStreamSynchronize(g_stream));
      std::printf("profiled %s at %lld tokens\n", c.name.c_str(),
                  static_cast<long long>(n));
    }
    return 0;
  }
  // Every launch in graph replay measured ~0.17 us slower after the
  // bandwidth table than in a fresh process (the empty kernel too: 0.68
  // against 0.51 us on the H200, BENCHMARKS.md, 2026-12-02 ~18:04), so the
  // latency table runs in both states and reports both.
  LatencyTable("fresh", json);
  if (absl::GetFlag(FLAGS_bandwidth)) {
    BandwidthTable(prop, json);
    LatencyTable("after_bandwidth", json);
  }

  const std::string path = absl::GetFlag(FLAGS_json);
  if (!path.empty()) {
    FILE* out = std::fopen(path.c_str(), "w");
    if (out == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      return 1;
    }
    std::fprintf(out, "{%s}\n", absl::StrJoin(json, ",\n ").c_str());
    std::fclose(out);
  }
  cudaStreamDestroy(g_stream);
  return 0;
}

}  // namespace kvdepot::gpu

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvdepot::gpu::Main();
}
