// The CUDA fused store (SPEC §8) against the CPU reference, bit for bit:
// every format, block sizes 1, 7, 64, 133, each stage on and off (norm on
// all or part of the token, NeoX and interleaved RoPE, every Hadamard
// length that fits), DeepSeek MLA's ranges, -1 slots, NaN / +-Inf inputs,
// and the cast_back output compared with a later GPU load of the slots.
#include "kernels/reference/fused.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/fused_internal.h"
#include "kernels/cuda/fused_kernels.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/test_util.h"
#include "kernels/format_host.h"
#include "kernels/fused_host.h"
#include "kernels/quant.h"

namespace kvdepot::gpu {
namespace {

constexpr const char* kFormats[] = {
    "V41",       "V41_FP4", "FP4_INDEX",  "FP8_FP32SF_INDEX", "MXFP8_INDEX",
    "BF16(512)", "BF16(8)", "BF16(1024)", "DS_MLA_FP8"};
constexpr int64_t kBlockSizes[] = {1, 7, 64, 133};
constexpr int64_t kMaxPosition = 4096;

// Stage sets, each applied where it fits the token (D elements).
enum class Stages {
  kNone,
  kNormAll,
  kNormPart,
  kNeox,
  kInterleaved,
  kHadamard64,
  kHadamard128,
  kHadamard256,
  kHadamard512,
  kAll,
  kMla,      // norm [0, D - 64), interleaved RoPE on the last 64, no Hadamard
  kMlaNeox,  // the same with NeoX RoPE (DS_MLA_FP8: both fused_mla.cu's)
  kHadamardOdd,  // Hadamard 128 (or 64) at element 3, not a multiple of 4
  // kMla with a Hadamard of 512 (D >= 512; V41 / V41_FP4: fused_h512.cu's
  // kernel with interleaved RoPE and a partial norm, as the reference
  // worker registers V41 plus a Hadamard)
  kMlaHadamard,
  // kNormPart with a Hadamard of 128 (at 0 on the 128-element index
  // formats, where RowKernelLoops also runs it through fused_row.cu's
  // kernel; at 8 elsewhere)
  kNormHadamard,
  // RoPE wider than DeepSeek's 64 (NeoX over the last 256 elements,
  // interleaved over the last 144; the whole token below 256): on the
  // 512-element formats more pairs than a warp has lanes (fused_h512.cu's
  // lanes rotate pairs k, k + 32, ...), 144 a number of them that is not a
  // multiple of 32.
  kWideNeox,
  kWideInterleaved,
};
constexpr Stages kAllStages[] = {Stages::kNone,
                                 Stages::kNormAll,
                                 Stages::kNormPart,
                                 Stages::kNeox,
                                 Stages::kInterleaved,
                                 Stages::kHadamard64,
                                 Stages::kHadamard128,
                                 Stages::kHadamard256,
                                 Stages::kHadamard512,
                                 Stages::kAll,
                                 Stages::kMla,
                                 Stages::kMlaNeox,
                                 Stages::kHadamardOdd,
                                 Stages::kMlaHadamard,
                                 Stages::kNormHadamard,
                                 Stages::kWideNeox,
                                 Stages::kWideInterleaved};

int HadamardOf(Stages s, int32_t d) {
  switch (s) {
    case Stages::kHadamard64:
      return 64;
    case Stages::kHadamardOdd:  // 128: pass A's scalar path
      return d >= 128 + 3 ? 128 : 64;
    case Stages::kHadamard128:
    case Stages::kNormHadamard:
      return 128;
    case Stages::kHadamard256:
      return 256;
    case Stages::kHadamard512:
    case Stages::kMlaHadamard:
      return 512;
    case Stages::kAll: {
      int len = 0;
      for (int l : kHadamardLengths) len = l <= d ? l : len;
      return len;
    }
    default:
      return 0;
  }
}

// Host inputs of one fused store.
struct Inputs {
  std::vector<uint16_t> kv;        // [n][D]
  std::vector<uint16_t> weight;    // [norm_end - norm_begin]
  std::vector<float> cos_sin;      // [kMaxPosition][rope_dim]
  std::vector<int64_t> positions;  // [n]
  std::vector<int32_t> slots;      // [n]
  FusedParams params;              // host pointers
};

// BF16 values around unit scale times a per-token magnitude; token t % 13
// == 5 gets a NaN, t % 17 == 3 a +-Inf, t % 23 == 7 is all zero.
std::vector<uint16_t> MakeKv(std::mt19937& rng, int64_t n, int32_t d) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exp10(-3, 2);
  std::uniform_int_distribution<int32_t> where(0, d - 1);
  std::vector<uint16_t> kv(static_cast<size_t>(n) * d);
  for (int64_t t = 0; t < n; ++t) {
    const float mag = std::pow(10.0f, static_cast<float>(exp10(rng)));
    uint16_t* row = kv.data() + t * d;
    for (int32_t i = 0; i < d; ++i) row[i] = FloatToBf16(normal(rng) * mag);
    if (t % 23 == 7) std::memset(row, 0, 2 * static_cast<size_t>(d));
    if (t % 13 == 5) row[where(rng)] = 0xFFC1;  // a NaN with sign + payload
    if (t % 17 == 3) row[where(rng)] = (t % 2) ? 0x7F80 : 0xFF80;
  }
  return kv;
}

// The cos/sin cache [kMaxPosition][rope_dim] of base 10000 (cos | sin).
const std::vector<float>& CosSin(int32_t rope_dim) {
  static auto* tables = new std::map<int32_t, std::vector<float>>();
  std::vector<float>& t = (*tables)[rope_dim];
  if (!t.empty()) return t;
  const int32_t half = rope_dim / 2;
  t.resize(kMaxPosition * rope_dim);
  for (int64_t pos = 0; pos < kMaxPosition; ++pos) {
    for (int32_t k = 0; k < half; ++k) {
      const double theta =
          pos * std::pow(10000.0, -2.0 * k / static_cast<double>(rope_dim));
      t[pos * rope_dim + k] = static_cast<float>(std::cos(theta));
      t[pos * rope_dim + half + k] = static_cast<float>(std::sin(theta));
    }
  }
  return t;
}

Inputs MakeInputs(std::mt19937& rng, const PoolLayout& layout, int64_t n,
                  Stages stages) {
  const int32_t d = layout.format.elements();
  Inputs in;
  in.kv = MakeKv(rng, n, d);
  in.slots = RandomSlots(rng, n, layout.num_slots(), 10);
  FusedParams& p = in.params;
  p.eps = 1e-6f;
  switch (stages) {
    case Stages::kNormAll:
    case Stages::kAll:
      p.norm_begin = 0;
      p.norm_end = d;
      break;
    case Stages::kNormPart:
    case Stages::kNormHadamard:
      p.norm_begin = d >= 24 ? 8 : 0;
      p.norm_end = d >= 24 ? d - 8 : d;
      break;
    case Stages::kMla:
    case Stages::kMlaNeox:
    case Stages::kMlaHadamard:
      p.norm_begin = 0;
      p.norm_end = d > 64 ? d - 64 : d;
      break;
    default:
      break;
  }
  if (stages == Stages::kNeox || stages == Stages::kAll ||
      stages == Stages::kMlaNeox) {
    p.rope = RopeStyle::kNeox;
    p.rope_dim = d >= 64 ? 64 : d;
    p.rope_offset = d - p.rope_dim;
  }
  if (stages == Stages::kInterleaved || stages == Stages::kMla ||
      stages == Stages::kMlaHadamard) {
    p.rope = RopeStyle::kInterleaved;
    p.rope_dim = d >= 64 ? 64 : d;
    p.rope_offset = d - p.rope_dim;
  }
  if (stages == Stages::kWideNeox || stages == Stages::kWideInterleaved) {
    const bool neox = stages == Stages::kWideNeox;
    p.rope = neox ? RopeStyle::kNeox : RopeStyle::kInterleaved;
    p.rope_dim = d >= 256 ? (neox ? 256 : 144) : d;
    p.rope_offset = d - p.rope_dim;
  }
  p.hadamard_len = HadamardOf(stages, d);
  p.hadamard_begin = p.hadamard_len > 0 && d - p.hadamard_len >= 8 ? 8 : 0;
  if (stages == Stages::kHadamardOdd) p.hadamard_begin = 3;
  if (p.norm()) {
    std::uniform_real_distribution<float> w(0.5f, 1.5f);
    in.weight.resize(p.norm_end - p.norm_begin);
    for (uint16_t& x : in.weight) x = FloatToBf16(w(rng));
    p.norm_weight = in.weight.data();
  }
  if (p.rope != RopeStyle::kNone) {
    in.cos_sin = CosSin(p.rope_dim);
    std::uniform_int_distribution<int64_t> pos(0, kMaxPosition - 1);
    in.positions.resize(n);
    for (int64_t& x : in.positions) x = pos(rng);
    p.positions = in.positions.data();
    p.cos_sin = in.cos_sin.data();
    p.max_position = kMaxPosition;
  }
  return in;
}

template <typename T>
DeviceBuffer Upload(const std::vector<T>& v) {
  absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Open(v.size() * sizeof(T));
  EXPECT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(b->CopyFrom(v.data(), v.size() * sizeof(T)).ok());
  return *std::move(b);
}

PoolLayout Layout(const std::string& name, int64_t block_size,
                  int64_t min_slots) {
  const absl::StatusOr<KVCacheFormat> f = FormatFromName(name);
  EXPECT_TRUE(f.ok()) << f.status();
  const int64_t blocks = (min_slots + block_size - 1) / block_size;
  const absl::StatusOr<PoolLayout> l =
      MakePoolLayout(*f, block_size, blocks, 1);
  EXPECT_TRUE(l.ok()) << l.status();
  return *l;
}

// How a check launches the fused store on device arrays (p's arrays
// uploaded): FusedStore, the launcher every caller uses, unless a test names
// a kernel.
using FusedRun = std::function<absl::Status(
    const PoolLayout& layout, uint8_t* layer, const uint16_t* kv,
    const FusedParams& p, const int32_t* slots, int64_t n, uint16_t* cast)>;

absl::Status RunFusedStore(const PoolLayout& layout, uint8_t* layer,
                           const uint16_t* kv, const FusedParams& p,
                           const int32_t* slots, int64_t n, uint16_t* cast) {
  return gpu::FusedStore(layout, layer, kv, p, slots, n, cast);
}

void CheckKernel(const PoolLayout& layout, int64_t n, const Inputs& in,
                 const std::vector<uint8_t>& initial,
                 const std::vector<uint8_t>& want,
                 const std::vector<uint16_t>& want_cast, const FusedRun& run);

// Runs the reference and the kernel on identical random pools; compares the
// whole layer and cast_back, then loads the stored slots on the GPU and
// compares them with cast_back (do_cast formats).
void CheckFused(const PoolLayout& layout, int64_t n, Stages stages,
                std::mt19937& rng, const FusedRun& run = RunFusedStore) {
  SCOPED_TRACE(testing::Message()
               << *FormatName(layout.format) << " bs=" << layout.block_size
               << " n=" << n << " stages=" << static_cast<int>(stages));
  const int32_t d = layout.format.elements();
  const Inputs in = MakeInputs(rng, layout, n, stages);
  ASSERT_TRUE(ValidateFused(layout.format, in.params, in.positions).ok());
  const std::vector<uint8_t> initial = RandomBytes(rng, layout.layer_bytes);
  ASSERT_FALSE(AllZero(initial));

  std::vector<uint8_t> want = initial;
  std::vector<uint16_t> want_cast(static_cast<size_t>(n) * d, 0x1234);
  const absl::Status ref = FusedStore(layout, want.data(), in.kv.data(),
                                      in.params, in.slots, want_cast.data());
  ASSERT_TRUE(ref.ok()) << ref;
  if (n > 1) {
    ASSERT_NE(want, initial) << "the reference wrote nothing";
  }

  CheckKernel(layout, n, in, initial, want, want_cast, run);
}

// The kernel against the reference's layer and cast_back.
void CheckKernel(const PoolLayout& layout, int64_t n, const Inputs& in,
                 const std::vector<uint8_t>& initial,
                 const std::vector<uint8_t>& want,
                 const std::vector<uint16_t>& want_cast, const FusedRun& run) {
  const int32_t d = layout.format.elements();
  DeviceBuffer pool = Upload(initial);
  DeviceBuffer kv = Upload(in.kv);
  DeviceBuffer slots = Upload(in.slots);
  DeviceBuffer cast = Upload(std::vector<uint16_t>(n * d, 0x5555));
  DeviceBuffer weight, cos_sin, positions;
  FusedParams p = in.params;
  if (p.norm()) {
    weight = Upload(in.weight);
    p.norm_weight = weight.as<uint16_t>();
  }
  if (p.rope != RopeStyle::kNone) {
    cos_sin = Upload(in.cos_sin);
    positions = Upload(in.positions);
    p.cos_sin = cos_sin.as<float>();
    p.positions = positions.as<int64_t>();
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const absl::Status s =
      run(layout, static_cast<uint8_t*>(pool.get()), kv.as<uint16_t>(), p,
          slots.as<int32_t>(), n, cast.as<uint16_t>());
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  std::vector<uint8_t> got(layout.layer_bytes);
  std::vector<uint16_t> got_cast(static_cast<size_t>(n) * d);
  ASSERT_TRUE(pool.CopyTo(got.data(), got.size()).ok());
  ASSERT_TRUE(cast.CopyTo(got_cast.data(), got_cast.size() * 2).ok());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], want[i]) << "layer byte " << i;
  }
  for (size_t i = 0; i < got_cast.size(); ++i) {
    ASSERT_EQ(got_cast[i], want_cast[i])
        << "cast_back token " << i / d << " element " << i % d;
  }

  if (!layout.format.do_cast) return;  // index loads are raw
  std::vector<int32_t> segments;
  for (int64_t t = 0; t < n; ++t) {
    const int32_t slot = in.slots[t];
    if (slot < 0) continue;
    const int32_t b = static_cast<int32_t>(slot / layout.block_size);
    const int32_t o = static_cast<int32_t>(slot % layout.block_size);
    segments.insert(segments.end(), {b, o, o + 1, static_cast<int32_t>(t)});
  }
  if (segments.empty()) return;
  DeviceBuffer seg = Upload(segments);
  DeviceBuffer loaded = Upload(std::vector<uint16_t>(n * d, 0));
  ASSERT_TRUE(LoadSegments(layout, pool.get(), seg.as<int32_t>(),
                           segments.size() / 4, loaded.get(), nullptr)
                  .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> rows(static_cast<size_t>(n) * d);
  ASSERT_TRUE(loaded.CopyTo(rows.data(), rows.size() * 2).ok());
  for (int64_t t = 0; t < n; ++t) {
    if (in.slots[t] < 0) continue;
    for (int32_t i = 0; i < d; ++i) {
      ASSERT_EQ(rows[t * d + i], got_cast[t * d + i])
          << "load of token " << t << " element " << i;
    }
  }
}

bool Fits(Stages s, int32_t d) {
  const int h = HadamardOf(s, d);
  if ((s >= Stages::kHadamard64 && s <= Stages::kHadamard512) ||
      s == Stages::kMlaHadamard || s == Stages::kNormHadamard) {
    return h <= d;
  }
  if (s == Stages::kHadamardOdd) return h + 3 <= d;
  return true;
}

class FusedCudaTest
    : public testing::TestWithParam<std::tuple<const char*, int64_t>> {};

TEST_P(FusedCudaTest, EveryStageSetMatchesTheReference) {
  const auto [name, block_size] = GetParam();
  std::mt19937 rng(1401 + static_cast<int>(block_size));
  const PoolLayout layout = Layout(name, block_size, 400);
  for (Stages s : kAllStages) {
    if (!Fits(s, layout.format.elements())) continue;
    for (int64_t n : {1, 7, 79}) CheckFused(layout, n, s, rng);
  }
}

// Enough tokens that every warp of the persistent grid loops (the next
// token's row is in flight while one is processed). For the 512-element
// formats this is also fused_h512.cu's one-warp kernel: up to one wave of
// tokens (every EveryStageSet case) takes its two-warp kernel.
TEST_P(FusedCudaTest, ManyTokensLoop) {
  const auto [name, block_size] = GetParam();
  if (block_size != 64) GTEST_SKIP() << "one block size is enough";
  std::mt19937 rng(1402);
  const PoolLayout layout = Layout(name, block_size, 24000);
  CheckFused(layout, 20000, Stages::kAll, rng);
  CheckFused(layout, 20000, Stages::kMla, rng);
  CheckFused(layout, 20000, Stages::kMlaNeox, rng);
  CheckFused(layout, 20000, Stages::kNormPart, rng);
  CheckFused(layout, 20000, Stages::kInterleaved, rng);
  CheckFused(layout, 20000, Stages::kWideNeox, rng);
  CheckFused(layout, 20000, Stages::kWideInterleaved, rng);
  if (Fits(Stages::kMlaHadamard, layout.format.elements())) {
    CheckFused(layout, 20000, Stages::kMlaHadamard, rng);
  }
}

// fused_mla.cu's three kernels by name (FusedStore takes the bulk one only
// from kFusedMlaBulkMinTokens tokens), each against the reference at every
// block size: the bulk kernel's 16-token tiles with n not a multiple of
// them, more tiles than its grid has CTAs, -1 slots (their cast_back rows
// still written), RoPE interleaved or none (NeoX too for the warp kernels),
// the norm on or off; the load-ahead warp kernel with n below, at and
// above its grid's warps. NeoX RoPE has no bulk kernel: refused, nothing
// launched.
TEST_P(FusedCudaTest, MlaKernelsByName) {
  const auto [name, block_size] = GetParam();
  if (std::string(name) != "DS_MLA_FP8") GTEST_SKIP() << "DS_MLA_FP8 only";
  std::mt19937 rng(1404);
  const PoolLayout layout = Layout(name, block_size, 24000);
  using gpu::internal::FusedMlaPath;
  for (const FusedMlaPath path : {FusedMlaPath::kWarps, FusedMlaPath::kAhead,
                                  FusedMlaPath::kAhead5, FusedMlaPath::kBulk}) {
    SCOPED_TRACE(path == FusedMlaPath::kBulk     ? "bulk"
                 : path == FusedMlaPath::kAhead  ? "ahead"
                 : path == FusedMlaPath::kAhead5 ? "ahead5"
                                                 : "warps");
    const FusedRun run = [path](const PoolLayout& l, uint8_t* layer,
                                const uint16_t* kv, const FusedParams& p,
                                const int32_t* slots, int64_t n,
                                uint16_t* cast) -> absl::Status {
      const cudaError_t e = gpu::internal::LaunchFusedMla(
          l, layer, kv, p, slots, n, cast, gpu::internal::Launch{}, path);
      if (e != cudaSuccess) return absl::InternalError(cudaGetErrorString(e));
      return absl::OkStatus();
    };
    for (const int64_t n : {1, 17, 2000, 20000}) {
      CheckFused(layout, n, Stages::kMla, rng, run);
      CheckFused(layout, n, Stages::kInterleaved, rng, run);
      CheckFused(layout, n, Stages::kNone, rng, run);
      if (path != FusedMlaPath::kBulk && n <= 2000) {
        CheckFused(layout, n, Stages::kMlaNeox, rng, run);
      }
    }
  }
  const Inputs in = MakeInputs(rng, layout, 64, Stages::kMlaNeox);
  ASSERT_TRUE(gpu::internal::FusedMlaApplies(in.params));
  EXPECT_EQ(gpu::internal::LaunchFusedMla(
                layout, nullptr, nullptr, in.params, nullptr, 64, nullptr,
                gpu::internal::Launch{}, gpu::internal::FusedMlaPath::kBulk),
            cudaErrorNotSupported);
}

// FusedStore's own choice at fused_mla.cu's thresholds: the load-ahead
// warp kernel from kFusedMlaAheadMinTokens tokens and, past
// kFusedMlaBulkMinTokens, the bulk kernel or the load-ahead one by the
// device's bandwidth per SM; NeoX stays on the one-token warp kernel.
TEST_P(FusedCudaTest, MlaAutoPathAtItsThresholds) {
  const auto [name, block_size] = GetParam();
  if (std::string(name) != "DS_MLA_FP8" || block_size != 64) {
    GTEST_SKIP() << "DS_MLA_FP8 at one block size";
  }
  std::mt19937 rng(1407);
  const PoolLayout layout =
      Layout(name, block_size, gpu::internal::kFusedMlaBulkMinTokens + 1000);
  for (const int64_t n : {gpu::internal::kFusedMlaAheadMinTokens - 1,
                          gpu::internal::kFusedMlaAheadMinTokens,
                          gpu::internal::kFusedMlaBulkMinTokens + 5}) {
    SCOPED_TRACE(n);
    CheckFused(layout, n, Stages::kMla, rng);
    if (n == gpu::internal::kFusedMlaAheadMinTokens) {
      CheckFused(layout, n, Stages::kMlaNeox, rng);
    }
  }
}

// The sizes RowKernelLoops runs: one for each of fused_row.cu's shapes.
constexpr int64_t kPairShapeTokens = 130011;
constexpr int64_t kOneLaneShapeTokens = 300007;
static_assert(kPairShapeTokens > gpu::internal::kMaxQuadTokens &&
                  kPairShapeTokens <= gpu::internal::kMaxPairTokens,
              "RowKernelLoops must run the two-lane kernel");
static_assert(kOneLaneShapeTokens > gpu::internal::kMaxPairTokens,
              "RowKernelLoops must run the one-lane kernel");

// fused_row.cu's kernels (the 128-element index formats without RoPE,
// above 23K tokens; two lanes per token up to 256K tokens, or always for
// FP8_FP32SF_INDEX, one above) with more tiles than their grids have warps
// (an H200 holds 132 x 12 or 132 x 16 of them), so each warp processes a
// tile while the next one arrives, and n is not a multiple of the tile:
// the last tile is partial. Each of the kernels' paths: no stage (the row
// quantized as it arrived), the norm alone (chunk by chunk), the Hadamard,
// both.
TEST_P(FusedCudaTest, RowKernelLoops) {
  const auto [name, block_size] = GetParam();
  if (block_size != 64) GTEST_SKIP() << "one block size is enough";
  std::mt19937 rng(1403);
  const PoolLayout layout = Layout(name, block_size, 310000);
  if (layout.format.elements() != 128)
    GTEST_SKIP() << "not a 128-element format";
  for (int64_t n : {kPairShapeTokens, kOneLaneShapeTokens}) {
    for (Stages s : {Stages::kNone, Stages::kNormPart, Stages::kHadamard128,
                     Stages::kNormHadamard}) {
      CheckFused(layout, n, s, rng);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, FusedCudaTest,
                         testing::Combine(testing::ValuesIn(kFormats),
                                          testing::ValuesIn(kBlockSizes)),
                         [](const auto& info) {
                           std::string s = std::get<0>(info.param);
                           for (char& c : s) {
                             if (c == '(' || c == ')') c = '_';
                           }
                           return s + "_bs" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(FusedCudaLaunchTest, NoTokensLaunchesNothing) {
  const PoolLayout layout = Layout("V41", 64, 64);
  EXPECT_TRUE(gpu::FusedStore(layout, nullptr, nullptr, FusedParams{}, nullptr,
                              0, nullptr)
                  .ok());
}

}  // namespace
}  // namespace kvdepot::gpu
