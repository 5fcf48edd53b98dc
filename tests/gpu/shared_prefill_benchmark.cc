// Issue 14 item 5: what a consumer layer of a shared compressed cache
// saves per layer, shared load vs full load, on the GPU kernels the CUDA
// backend runs for PrefillLoad (server/prefill_load.cc, CudaBackend):
//
//   full   = SWA history load + compressed load + cast-back of the chunk
//            (store into a scratch layer, load back as BF16) + SWA store
//   shared = the same without the compressed load
//
// One sequence as in SPEC §6's worked example (chunk q = 1024, window
// W = 4096 in a ring of 4096, V41 records of 528 bytes loaded as BF16 rows
// of 1024 bytes, compressed blocks of 16 compressed tokens), at 4K, 32K
// and 128K context, ratio 4 and 128. GPU time from CUDA events over
// --iters repetitions (L2 flushed before each); bytes from the model
// below; the same run's device-to-device copy bandwidth for the ratio.
//
// Byte model per layer (each byte counted once, plans and slots ignored):
//   SWA history    read W x 528        write W x 1024
//   cast-back      read q x 1024       write q x 528 (scratch)
//                  read q x 528        write q x 1024 (chunk rows)
//   SWA store      read q x 1024       write q x 528
//   compressed     read C x 528        write C x 1024, C = max(T / R, 1)
// A consumer saves exactly the compressed line: C x (528 + 1024) bytes.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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
#include "kernels/cuda/kernels.h"
#include "kernels/format.h"
#include "kernels/format_host.h"
#include "kernels/named_formats.h"
#include "planner/plan.h"

ABSL_FLAG(int, iters, 50, "timed repetitions per measurement");
ABSL_FLAG(std::string, json, "", "also write the results here as JSON");

namespace kvdepot {
namespace {

#define CHECK_CUDA(expr)                                                \
  do {                                                                  \
    const cudaError_t e_ = (expr);                                      \
    if (e_ != cudaSuccess) {                                            \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorString(e_));                             \
      std::exit(1);                                                     \
    }                                                                   \
  } while (false)

#define CHECK_OK(expr)                                                  \
  do {                                                                  \
    const absl::Status s_ = (expr);                                     \
    if (!s_.ok()) {                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, \
                   std::string(s_.message()).c_str());                  \
      std::exit(1);                                                     \
    }                                                                   \
  } while (false)

constexpr int32_t kQ = 1024, kWindow = 4096, kRing = 4096;
constexpr int32_t kCompressedBlock = 16;
constexpr int64_t kRecord = 528, kRow = 1024;

uint8_t* DeviceAlloc(int64_t bytes) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(bytes, 16))));
  return static_cast<uint8_t*>(p);
}

int32_t* Upload(const std::vector<int32_t>& v) {
  auto* d = reinterpret_cast<int32_t*>(DeviceAlloc(v.size() * 4));
  CHECK_CUDA(cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  return d;
}

std::vector<uint16_t> RandomBf16(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 2.0f);
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (uint16_t& h : v) {
    const float f = dist(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    h = static_cast<uint16_t>(bits >> 16);
  }
  return v;
}

struct Bench {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  uint8_t* flush = nullptr;
  int64_t flush_bytes = 0;
  int iters = 50;

  // Mean seconds of `work` on the stream, L2 flushed before each run.
  double Seconds(const std::function<void()>& work) {
    work();  // warm-up
    CHECK_CUDA(cudaStreamSynchronize(stream));
    float total_ms = 0;
    for (int i = 0; i < iters; ++i) {
      CHECK_CUDA(cudaMemsetAsync(flush, i & 0xff, flush_bytes, stream));
      CHECK_CUDA(cudaEventRecord(start, stream));
      work();
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      total_ms += ms;
    }
    return total_ms / 1e3 / iters;
  }
};

struct Row {
  int64_t context = 0;
  int32_t ratio = 0;
  int64_t compressed = 0;
  double full_us = 0, shared_us = 0;
  int64_t full_bytes = 0, shared_bytes = 0;
};

Row RunOne(Bench& bench, int64_t context, int32_t ratio, std::mt19937& rng) {
  const KVCacheFormat& f = kFormatV41;
  // Pools: the SWA ring (one state) and the compressed cache.
  const int64_t compressed_tokens = context / ratio;
  const int64_t main_blocks =
      std::max<int64_t>(
          (compressed_tokens + kCompressedBlock - 1) / kCompressedBlock, 1) +
      1;
  const PoolLayout swa = *MakePoolLayout(f, kRing, 1, 1);
  const PoolLayout main = *MakePoolLayout(f, kCompressedBlock, main_blocks, 1);
  const PoolLayout scratch =
      *MakePoolLayout(f, 64, (kQ + 63) / 64, 1);  // the cast-back's layer
  uint8_t* swa_mem = DeviceAlloc(swa.total_bytes);
  uint8_t* main_mem = DeviceAlloc(main.total_bytes);
  uint8_t* scratch_mem = DeviceAlloc(scratch.total_bytes);
  // Real records: every slot stored once from random BF16.
  for (auto [layout, mem] : {std::pair{&swa, swa_mem}, {&main, main_mem}}) {
    const int64_t n = layout->num_blocks * layout->block_size;
    std::vector<int32_t> slots(static_cast<size_t>(n));
    std::iota(slots.begin(), slots.end(), 0);
    const std::vector<uint16_t> kv = RandomBf16(n * f.elements(), rng);
    uint8_t* kv_dev = DeviceAlloc(kv.size() * 2);
    CHECK_CUDA(
        cudaMemcpy(kv_dev, kv.data(), kv.size() * 2, cudaMemcpyHostToDevice));
    int32_t* slots_dev = Upload(slots);
    gpu::LaunchOptions o;
    o.stream = bench.stream;
    CHECK_OK(
        gpu::Store(*layout, mem, kv_dev, InputDtype::kBF16, slots_dev, n, o));
    CHECK_CUDA(cudaStreamSynchronize(bench.stream));
    CHECK_CUDA(cudaFree(kv_dev));
    CHECK_CUDA(cudaFree(slots_dev));
  }
  // The plans, as PrefillLoad builds them.
  const std::vector<int32_t> seqlen_k = {static_cast<int32_t>(context)};
  const std::vector<int32_t> seqlen_q = {kQ};
  const std::vector<int32_t> state = {0};
  std::vector<int32_t> table(static_cast<size_t>(main_blocks));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  SequenceBatch batch;
  batch.seqlen_k = seqlen_k;
  batch.seqlen_q = seqlen_q;
  batch.state_ids = state;
  batch.block_table.data = table;
  batch.block_table.num_rows = 1;
  batch.block_table.num_cols = static_cast<int32_t>(table.size());
  batch.block_table.row_stride = static_cast<int64_t>(table.size());
  const PrefillLayout pl = *ComputePrefillLayout(batch, kWindow, ratio);
  SwaParams sp;
  sp.window = kWindow;
  sp.ring_size = kRing;
  sp.num_states = 1;
  CompressedParams cp;
  cp.ratio = ratio;
  cp.block_size = kCompressedBlock * ratio;
  cp.num_blocks = static_cast<int32_t>(main_blocks);
  BlockLoadPlanBuilder swa_builder(kRing, 1);
  CHECK_OK(BuildSwaPlan(batch, sp, &swa_builder));
  const absl::Span<const int32_t> swa_plan = swa_builder.Finish();
  BlockLoadPlanBuilder main_builder(kCompressedBlock,
                                    static_cast<int32_t>(main_blocks));
  std::vector<int32_t> cu(2);
  CHECK_OK(BuildCompressedPlan(batch, cp, &main_builder, absl::MakeSpan(cu)));
  const absl::Span<const int32_t> main_plan = main_builder.Finish();
  std::vector<int32_t> store_slots(kQ);
  CHECK_OK(BuildSwaStoreSlots(batch, sp, absl::MakeSpan(store_slots)));
  std::vector<int32_t> cast_slots(kQ), cast_segs;
  std::iota(cast_slots.begin(), cast_slots.end(), 0);
  for (int32_t b = 0; b * 64 < kQ; ++b) {
    cast_segs.insert(cast_segs.end(),
                     {b, 0, std::min(64, kQ - b * 64), b * 64});
  }
  int32_t* swa_plan_dev =
      Upload(std::vector<int32_t>(swa_plan.begin(), swa_plan.end()));
  int32_t* main_plan_dev =
      Upload(std::vector<int32_t>(main_plan.begin(), main_plan.end()));
  int32_t* store_dev = Upload(store_slots);
  int32_t* cast_slots_dev = Upload(cast_slots);
  int32_t* cast_segs_dev = Upload(cast_segs);
  const std::vector<uint16_t> chunk = RandomBf16(int64_t{kQ} * 512, rng);
  uint8_t* chunk_dev = DeviceAlloc(chunk.size() * 2);
  CHECK_CUDA(cudaMemcpy(chunk_dev, chunk.data(), chunk.size() * 2,
                        cudaMemcpyHostToDevice));
  uint8_t* out = DeviceAlloc(int64_t{pl.total_rows} * kRow);

  gpu::LaunchOptions o;
  o.stream = bench.stream;
  o.pdl = true;  // as the backend launches them
  auto layer = [&](bool with_compressed) {
    CHECK_OK(gpu::LoadSegments(swa, swa_mem, swa_plan_dev,
                               static_cast<int64_t>(swa_plan.size()) / 4, out,
                               nullptr, o));
    if (with_compressed) {
      CHECK_OK(gpu::LoadSegments(main, main_mem, main_plan_dev,
                                 static_cast<int64_t>(main_plan.size()) / 4,
                                 out + int64_t{pl.main_kv_offset} * kRow,
                                 nullptr, o));
    }
    CHECK_OK(gpu::Store(scratch, scratch_mem, chunk_dev, InputDtype::kBF16,
                        cast_slots_dev, kQ, o));
    CHECK_OK(gpu::LoadSegments(scratch, scratch_mem, cast_segs_dev,
                               static_cast<int64_t>(cast_segs.size()) / 4,
                               out + int64_t{pl.swa_history_rows} * kRow,
                               nullptr, o));
    CHECK_OK(gpu::Store(swa, swa_mem, chunk_dev, InputDtype::kBF16, store_dev,
                        kQ, o));
  };
  Row r;
  r.context = context;
  r.ratio = ratio;
  r.compressed = pl.compressed_rows;
  r.full_us = bench.Seconds([&] { layer(true); }) * 1e6;
  r.shared_us = bench.Seconds([&] { layer(false); }) * 1e6;
  int64_t stored = 0;
  for (int32_t s : store_slots) stored += s >= 0 ? 1 : 0;
  r.shared_bytes = kWindow * (kRecord + kRow) +
                   int64_t{kQ} * (kRow + kRecord + kRecord + kRow) +
                   stored * (kRow + kRecord);
  r.full_bytes = r.shared_bytes + r.compressed * (kRecord + kRow);
  for (void* p :
       {static_cast<void*>(swa_mem), static_cast<void*>(main_mem),
        static_cast<void*>(scratch_mem), static_cast<void*>(swa_plan_dev),
        static_cast<void*>(main_plan_dev), static_cast<void*>(store_dev),
        static_cast<void*>(cast_slots_dev), static_cast<void*>(cast_segs_dev),
        static_cast<void*>(chunk_dev), static_cast<void*>(out)}) {
    CHECK_CUDA(cudaFree(p));
  }
  return r;
}

int Main() {
  Bench bench;
  bench.iters = absl::GetFlag(FLAGS_iters);
  CHECK_CUDA(cudaStreamCreateWithFlags(&bench.stream, cudaStreamNonBlocking));
  CHECK_CUDA(cudaEventCreate(&bench.start));
  CHECK_CUDA(cudaEventCreate(&bench.stop));
  int device = 0, l2 = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  bench.flush_bytes = std::max<int64_t>(4LL * l2, 256 << 20);
  bench.flush = DeviceAlloc(bench.flush_bytes);
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));

  // The same run's copy bandwidth (bytes read + written).
  const int64_t copy_bytes = int64_t{256} << 20;
  uint8_t* src = DeviceAlloc(copy_bytes);
  uint8_t* dst = DeviceAlloc(copy_bytes);
  CHECK_CUDA(cudaMemset(src, 1, copy_bytes));
  const double copy_s = bench.Seconds([&] {
    CHECK_CUDA(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice,
                               bench.stream));
  });
  const double copy_bw = 2.0 * copy_bytes / copy_s;
  CHECK_CUDA(cudaFree(src));
  CHECK_CUDA(cudaFree(dst));
  std::printf("device: %s; D2D copy %.1f GB/s (read + write); iters %d\n\n",
              prop.name, copy_bw / 1e9, bench.iters);
  std::printf("%8s %5s %8s | %10s %10s %9s | %9s %9s %9s | %8s %8s\n",
              "context", "ratio", "C rows", "full us", "shared us", "saved us",
              "full MB", "shared MB", "saved MB", "full/cp", "saved/cp");
  std::mt19937 rng(301);
  std::vector<std::string> json;
  for (int32_t ratio : {4, 128}) {
    for (int64_t context : {int64_t{4096}, int64_t{32768}, int64_t{131072}}) {
      const Row r = RunOne(bench, context, ratio, rng);
      const double saved_us = r.full_us - r.shared_us;
      const int64_t saved = r.full_bytes - r.shared_bytes;
      // Achieved bandwidth over the copy's: the full layer, and the saved
      // part (its bytes over its time).
      const double full_frac = r.full_bytes / (r.full_us * 1e-6) / copy_bw;
      const double saved_frac =
          saved_us > 0 ? saved / (saved_us * 1e-6) / copy_bw : 0.0;
      std::printf(
          "%8lld %5d %8lld | %10.2f %10.2f %9.2f | %9.2f %9.2f %9.2f | "
          "%8.2f %8.2f\n",
          static_cast<long long>(r.context), r.ratio,
          static_cast<long long>(r.compressed), r.full_us, r.shared_us,
          saved_us, r.full_bytes / 1e6, r.shared_bytes / 1e6, saved / 1e6,
          full_frac, saved_frac);
      json.push_back(absl::StrFormat(
          "{\"context\": %d, \"ratio\": %d, \"compressed_rows\": %d, "
          "\"full_us\": %.3f, \"shared_us\": %.3f, \"full_bytes\": %d, "
          "\"shared_bytes\": %d}",
          r.context, r.ratio, r.compressed, r.full_us, r.shared_us,
          r.full_bytes, r.shared_bytes));
    }
  }
  const std::string path = absl::GetFlag(FLAGS_json);
  if (!path.empty()) {
    FILE* fp = std::fopen(path.c_str(), "w");
    if (fp != nullptr) {
      std::fprintf(fp,
                   "{\"device\": \"%s\", \"copy_bandwidth_gbps\": %.1f, "
                   "\"rows\": [%s]}\n",
                   prop.name, copy_bw / 1e9, absl::StrJoin(json, ", ").c_str());
      std::fclose(fp);
    }
  }
  return 0;
}

}  // namespace
}  // namespace kvdepot

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvdepot::Main();
}
