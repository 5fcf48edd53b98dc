// Planner throughput on one core. Workloads:
//   BM_DecodeMetadata  a decode step of 1K sequences: SWA store slots and
//                      the compact SWA decode windows (O(1) per sequence)
//   BM_ConvertTopk     the top-k conversion of a decode step, 1K sequences
//                      x 512 indices
//   BM_PrefillPlans    8 sequences with 1K-token chunks at 4K/32K/128K
//                      context: compressed + SWA plans
//   BM_PrefillAll      the same plus layout, SWA store slots and pivots
//   BM_CompressedPlan  the compressed plan alone
//   BM_PlanCopyBaseline  std::copy of a built plan of the same size (the
//                      baseline the ratios in docs/BENCHMARKS.md use)
// Counters: ns_per_segment (time / segments emitted), us_per_1k_seqs (time
// per 1024 sequences), ns_per_index (time / top-k entries),
// ns_per_query_row (time / prefill query rows). Google Benchmark prints
// these with an "s" suffix: the number is in the unit the name says.
// Run: bazel --output_base=... run //planner:plan_benchmark
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "planner/plan.h"

namespace kvdepot {
namespace {

constexpr int32_t kBlockSize = 64;  // logical tokens per table entry
constexpr int32_t kRatio = 4;       // 16 compressed tokens per pool block
constexpr int32_t kWindow = 128;
constexpr int32_t kRing = 128;
constexpr int32_t kNumBlocks = 1 << 20;

struct Batch {
  std::vector<int32_t> seqlen_k, seqlen_q, state_ids, valid_start, table;
  int32_t num_cols = 0;

  Batch(int64_t n, int32_t context, int32_t chunk) {
    std::mt19937 rng(301);
    std::uniform_int_distribution<int32_t> jitter(0, context / 8);
    num_cols = (context + kBlockSize - 1) / kBlockSize;
    for (int64_t b = 0; b < n; ++b) {
      const int32_t k = context - jitter(rng);
      seqlen_k.push_back(k);
      seqlen_q.push_back(std::min(chunk, k));
      state_ids.push_back(static_cast<int32_t>(b));
      valid_start.push_back(0);
    }
    std::uniform_int_distribution<int32_t> block(0, kNumBlocks - 1);
    table.resize(n * num_cols);
    for (int32_t& x : table) x = block(rng);
  }
  SequenceBatch view() const {
    SequenceBatch b;
    b.seqlen_k = seqlen_k;
    b.seqlen_q = seqlen_q;
    b.state_ids = state_ids;
    b.swa_valid_start = valid_start;
    b.block_table.data = table;
    b.block_table.num_rows = static_cast<int64_t>(seqlen_k.size());
    b.block_table.num_cols = num_cols;
    b.block_table.row_stride = num_cols;
    return b;
  }
};

// A counter of "time per unit": value = units per iteration x seconds
// per display unit (1e-9 for ns per item, 1e-6 for us).
benchmark::Counter TimePer(double units_times_scale) {
  return benchmark::Counter(units_times_scale,
                            benchmark::Counter::kIsIterationInvariantRate |
                                benchmark::Counter::kInvert);
}

void BM_DecodeMetadata(benchmark::State& state) {
  const int64_t n = 1024;
  const Batch batch(n, static_cast<int32_t>(state.range(0)), 1);
  const SwaParams swa{.window = kWindow,
                      .ring_size = kRing,
                      .num_states = static_cast<int32_t>(n)};
  std::vector<int32_t> slots(n), states(n), starts(n), lens(n);
  for (auto _ : state) {
    absl::Status a =
        BuildSwaStoreSlots(batch.view(), swa, absl::MakeSpan(slots));
    absl::Status b =
        ComputeSwaDecodeWindows(batch.view(), swa, absl::MakeSpan(states),
                                absl::MakeSpan(starts), absl::MakeSpan(lens));
    benchmark::DoNotOptimize(a.ok() && b.ok());
    benchmark::ClobberMemory();
  }
  state.counters["us_per_1k_seqs"] = TimePer(n / 1024.0 * 1e-6);
}
BENCHMARK(BM_DecodeMetadata)->Arg(4096)->Arg(32768)->Arg(131072);

void BM_ConvertTopk(benchmark::State& state) {
  const int64_t n = 1024;
  const int32_t k = 512;
  const Batch batch(n, static_cast<int32_t>(state.range(0)), 1);
  std::vector<int32_t> valid(n, k), tokens(n), src(n * k), topk(n * k);
  std::mt19937 rng(301);
  for (int64_t b = 0; b < n; ++b) {
    tokens[b] = batch.seqlen_k[b] / kRatio;
    std::uniform_int_distribution<int32_t> pick(0, tokens[b] - 1);
    for (int32_t c = 0; c < k; ++c) src[b * k + c] = pick(rng);
  }
  const BlockTableView table = batch.view().block_table;
  for (auto _ : state) {
    state.PauseTiming();
    std::copy(src.begin(), src.end(), topk.begin());
    state.ResumeTiming();
    absl::StatusOr<int64_t> bad =
        ConvertTopk(absl::MakeSpan(topk), k, valid, tokens, table,
                    kBlockSize / kRatio, kNumBlocks);
    benchmark::DoNotOptimize(bad.ok());
    benchmark::ClobberMemory();
  }
  state.counters["ns_per_index"] = TimePer(static_cast<double>(n) * k * 1e-9);
}
BENCHMARK(BM_ConvertTopk)->Arg(4096)->Arg(131072);

// Plans of a prefill batch: compressed + SWA.
void BM_PrefillPlans(benchmark::State& state) {
  const int64_t n = 8;
  const Batch batch(n, static_cast<int32_t>(state.range(0)), 1024);
  const SwaParams swa{.window = kWindow,
                      .ring_size = kRing,
                      .num_states = static_cast<int32_t>(n)};
  const CompressedParams compressed{
      .block_size = kBlockSize, .ratio = kRatio, .num_blocks = kNumBlocks};
  BlockLoadPlanBuilder main_plan(1, 1), swa_plan(1, 1);
  std::vector<int32_t> cu(n + 1);
  int64_t segments = 0;
  for (auto _ : state) {
    absl::Status a = BuildCompressedPlan(batch.view(), compressed, &main_plan,
                                         absl::MakeSpan(cu));
    absl::Status b = BuildSwaPlan(batch.view(), swa, &swa_plan);
    benchmark::DoNotOptimize(a.ok() && b.ok());
    segments = main_plan.num_segments() + swa_plan.num_segments();
  }
  state.counters["segments"] = static_cast<double>(segments);
  state.counters["ns_per_segment"] = TimePer(segments * 1e-9);
}
BENCHMARK(BM_PrefillPlans)->Arg(4096)->Arg(32768)->Arg(131072);

// Everything the planner does for a prefill batch: plans, layout, SWA store
// slots and the pivots of every query row (8 x 1K rows).
void BM_PrefillAll(benchmark::State& state) {
  const int64_t n = 8;
  const Batch batch(n, static_cast<int32_t>(state.range(0)), 1024);
  const SwaParams swa{.window = kWindow,
                      .ring_size = kRing,
                      .num_states = static_cast<int32_t>(n)};
  const CompressedParams compressed{
      .block_size = kBlockSize, .ratio = kRatio, .num_blocks = kNumBlocks};
  BlockLoadPlanBuilder main_plan(1, 1), swa_plan(1, 1);
  std::vector<int32_t> cu(n + 1), pivots, slots;
  int64_t rows = 0;
  for (auto _ : state) {
    absl::Status a = BuildCompressedPlan(batch.view(), compressed, &main_plan,
                                         absl::MakeSpan(cu));
    absl::Status b = BuildSwaPlan(batch.view(), swa, &swa_plan);
    absl::StatusOr<PrefillLayout> layout =
        ComputePrefillLayout(batch.view(), kWindow, kRatio);
    rows = layout->chunk_rows;
    pivots.resize(4 * rows);
    slots.resize(rows);
    absl::Status c =
        BuildSwaStoreSlots(batch.view(), swa, absl::MakeSpan(slots));
    absl::Status d =
        ComputeSwaPivots(batch.view(), *layout, absl::MakeSpan(pivots));
    benchmark::DoNotOptimize(a.ok() && b.ok() && c.ok() && d.ok());
  }
  state.counters["ns_per_query_row"] = TimePer(rows * 1e-9);
}
BENCHMARK(BM_PrefillAll)->Arg(4096)->Arg(32768)->Arg(131072);

// The compressed plan alone (the segment-bound path).
void BM_CompressedPlan(benchmark::State& state) {
  const int64_t n = 8;
  const Batch batch(n, static_cast<int32_t>(state.range(0)), 1024);
  const CompressedParams compressed{
      .block_size = kBlockSize, .ratio = kRatio, .num_blocks = kNumBlocks};
  BlockLoadPlanBuilder builder(1, 1);
  std::vector<int32_t> cu(n + 1);
  for (auto _ : state) {
    absl::Status s = BuildCompressedPlan(batch.view(), compressed, &builder,
                                         absl::MakeSpan(cu));
    benchmark::DoNotOptimize(s.ok());
  }
  state.counters["segments"] = static_cast<double>(builder.num_segments());
  state.counters["ns_per_segment"] = TimePer(builder.num_segments() * 1e-9);
}
BENCHMARK(BM_CompressedPlan)->Arg(4096)->Arg(32768)->Arg(131072);

// Baseline for the ratios in docs/BENCHMARKS.md: copying an already built
// plan of the same size (16 bytes per segment) with std::copy.
void BM_PlanCopyBaseline(benchmark::State& state) {
  const int64_t n = 8;
  const Batch batch(n, static_cast<int32_t>(state.range(0)), 1024);
  const CompressedParams compressed{
      .block_size = kBlockSize, .ratio = kRatio, .num_blocks = kNumBlocks};
  BlockLoadPlanBuilder builder(1, 1);
  std::vector<int32_t> cu(n + 1);
  if (!BuildCompressedPlan(batch.view(), compressed, &builder,
                           absl::MakeSpan(cu))
           .ok()) {
    state.SkipWithError("plan failed");
    return;
  }
  const absl::Span<const int32_t> plan = builder.Finish();
  std::vector<int32_t> copy(plan.size());
  for (auto _ : state) {
    std::copy(plan.begin(), plan.end(), copy.begin());
    benchmark::ClobberMemory();
  }
  state.counters["ns_per_segment"] = TimePer(builder.num_segments() * 1e-9);
}
BENCHMARK(BM_PlanCopyBaseline)->Arg(4096)->Arg(32768)->Arg(131072);

}  // namespace
}  // namespace kvdepot
