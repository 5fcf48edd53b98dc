// Speed of the CPU reference store and segment load per format, at 1, 64,
// 4K and 64K tokens. Reports bytes/s of traffic (bytes read + written: K/V
// input, slots, pool records, load outputs, segments) and `x_memcpy`, the
// ratio of a plain memcpy's time for the same traffic (memcpy of half the
// bytes: it reads and writes that half) to the operation's time, measured
// in the same run: 1.0 means as fast as memcpy.
//
//   bazel run -c opt //kernels/reference:reference_benchmark --
//       --benchmark_min_time=0.2   (one line)
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/format.h"
#include "kernels/format_host.h"
#include "kernels/quant.h"
#include "kernels/reference/reference.h"

namespace kvdepot {
namespace {

const char* const kFormats[] = {"V41",         "V41_FP4",
                                "FP4_INDEX",   "FP8_FP32SF_INDEX",
                                "MXFP8_INDEX", "BF16(512)"};
constexpr int64_t kBlockSize = 64;

// Thread CPU time: the development machine is shared, so wall time
// measures the neighbours; benchmark's own rates use CPU time too.
double CpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) +
         1e-9 * static_cast<double>(ts.tv_nsec);
}

// Seconds per memcpy that reads and writes `traffic` bytes in total: the
// best of five batches, each doubling its repetitions until it lasts at
// least 5 ms of CPU time (the clock is read once per batch pass, not per
// copy). Cached per size.
double MemcpySeconds(int64_t traffic) {
  static std::map<int64_t, double> cache;
  auto it = cache.find(traffic);
  if (it != cache.end()) return it->second;
  const size_t half = static_cast<size_t>(std::max<int64_t>(traffic / 2, 1));
  std::vector<uint8_t> src(half, 0x5A), dst(half, 0);
  double best = 1e30;
  for (int batch = 0; batch < 5; ++batch) {
    for (int64_t reps = 1;; reps *= 2) {
      const double t0 = CpuSeconds();
      for (int64_t r = 0; r < reps; ++r) {
        memcpy(dst.data(), src.data(), half);
        benchmark::ClobberMemory();
      }
      const double elapsed = CpuSeconds() - t0;
      if (elapsed >= 0.005) {
        best = std::min(best, elapsed / static_cast<double>(reps));
        break;
      }
    }
  }
  benchmark::DoNotOptimize(dst.data());
  cache[traffic] = best;
  return best;
}

struct Setup {
  PoolLayout layout;
  std::vector<uint8_t> pool;
  std::vector<uint16_t> kv;       // [n][elements] BF16
  std::vector<int32_t> slots;     // [n] distinct, shuffled
  std::vector<int32_t> segments;  // whole blocks in shuffled order
};

Setup MakeSetup(int format_index, int64_t n) {
  Setup s;
  const KVCacheFormat f = *FormatFromName(kFormats[format_index]);
  const int64_t blocks = (n + kBlockSize - 1) / kBlockSize + 1;
  s.layout = *MakePoolLayout(f, kBlockSize, blocks, 1);
  s.pool.assign(s.layout.layer_bytes, 0);
  std::mt19937 rng(301);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  s.kv.resize(static_cast<size_t>(n) * f.elements());
  for (auto& h : s.kv) h = FloatToBf16(normal(rng));
  std::vector<int32_t> order(blocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  // Token i goes to block order[i / B], offset i % B (a scattered store);
  // the load reads those blocks back in the same order.
  for (int64_t i = 0; i < n; ++i) {
    s.slots.push_back(static_cast<int32_t>(order[i / kBlockSize] * kBlockSize +
                                           i % kBlockSize));
  }
  for (int64_t i = 0; i < n; i += kBlockSize) {
    const int32_t len = static_cast<int32_t>(std::min(kBlockSize, n - i));
    s.segments.insert(s.segments.end(),
                      {order[i / kBlockSize], 0, len, static_cast<int32_t>(i)});
  }
  return s;
}

void Report(benchmark::State& state, int64_t traffic, double seconds) {
  const double per_iter = seconds / static_cast<double>(state.iterations());
  state.SetBytesProcessed(state.iterations() * traffic);
  state.counters["x_memcpy"] = MemcpySeconds(traffic) / per_iter;
  state.SetLabel(kFormats[state.range(0)]);
}

void BM_Store(benchmark::State& state) {
  const int64_t n = state.range(1);
  Setup s = MakeSetup(static_cast<int>(state.range(0)), n);
  const KVCacheFormat& f = s.layout.format;
  const int64_t traffic =
      n * (2 * int64_t{f.elements()} + 4 + f.bytes_per_token());
  const double t0 = CpuSeconds();
  for (auto _ : state) {
    const absl::Status st =
        Store(s.layout, s.pool.data(), s.kv.data(), InputDtype::kBF16, s.slots);
    if (!st.ok()) state.SkipWithError(st.ToString().c_str());
    benchmark::ClobberMemory();
  }
  Report(state, traffic, CpuSeconds() - t0);
}

void BM_Load(benchmark::State& state) {
  const int64_t n = state.range(1);
  Setup s = MakeSetup(static_cast<int>(state.range(0)), n);
  const KVCacheFormat& f = s.layout.format;
  if (!Store(s.layout, s.pool.data(), s.kv.data(), InputDtype::kBF16, s.slots)
           .ok()) {
    state.SkipWithError("store failed");
    return;
  }
  std::vector<uint8_t> out(n * LoadDataRowBytes(f));
  std::vector<uint8_t> out_scales(n * LoadScaleRowBytes(f) + 4);
  const int64_t traffic =
      n * (f.bytes_per_token() + LoadDataRowBytes(f) + LoadScaleRowBytes(f)) +
      4 * static_cast<int64_t>(s.segments.size());
  const double t0 = CpuSeconds();
  for (auto _ : state) {
    const absl::Status st = LoadSegments(s.layout, s.pool.data(), s.segments, n,
                                         out.data(), out_scales.data());
    if (!st.ok()) state.SkipWithError(st.ToString().c_str());
    benchmark::ClobberMemory();
  }
  Report(state, traffic, CpuSeconds() - t0);
}

BENCHMARK(BM_Store)
    ->ArgNames({"format", "tokens"})
    ->ArgsProduct({{0, 1, 2, 3, 4, 5}, {1, 64, 4096, 65536}});
BENCHMARK(BM_Load)
    ->ArgNames({"format", "tokens"})
    ->ArgsProduct({{0, 1, 2, 3, 4, 5}, {1, 64, 4096, 65536}});

}  // namespace
}  // namespace kvdepot

BENCHMARK_MAIN();
