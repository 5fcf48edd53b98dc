// GPU store and segment load against the CPU reference, bit for bit: every
// format, block sizes 1, 7, 64, 133, BF16 and fp32 input, hardware and
// integer e4m3 encoding, PDL on a caller's stream, zero / one / many tokens.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/diagnostics.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch_internal.h"
#include "kernels/cuda/test_util.h"
#include "kernels/format_host.h"
#include "kernels/reference/reference.h"

namespace kvdepot::gpu {
namespace {

using ::testing::HasSubstr;

constexpr const char* kFormats[] = {
    "V41",       "V41_FP4", "FP4_INDEX", "FP8_FP32SF_INDEX", "MXFP8_INDEX",
    "BF16(512)", "BF16(6)", "BF16(4)",   "DS_MLA_FP8"};
constexpr int64_t kBlockSizes[] = {1, 7, 64, 133};

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

// Stores n random tokens on the GPU and with the reference into identical
// random pools, then compares the whole layer.
// DS_MLA_FP8 only: path names one of its two store kernels (launched
// directly, past the launcher's checks, which CheckStore has made).
void CheckStore(
    const PoolLayout& layout, int64_t n, InputDtype dtype,
    const LaunchOptions& options, std::mt19937& rng,
    internal::DsMlaStorePath path = internal::DsMlaStorePath::kAuto) {
  SCOPED_TRACE(testing::Message() << *FormatName(layout.format)
                                  << " bs=" << layout.block_size << " n=" << n);
  const std::vector<uint8_t> kv =
      RandomKv(rng, n, layout.format.elements(), dtype);
  const std::vector<int32_t> slots =
      RandomSlots(rng, n, layout.num_slots(), 10);
  const std::vector<uint8_t> initial = RandomBytes(rng, layout.layer_bytes);
  if (n > 0) {
    ASSERT_FALSE(AllZero(kv));
  }
  ASSERT_FALSE(AllZero(initial));
  ASSERT_TRUE(ValidateStore(layout, slots).ok());

  std::vector<uint8_t> want = initial;
  ASSERT_TRUE(Store(layout, want.data(), kv.data(), dtype, slots).ok());

  auto pool = DeviceBuffer::Open(layout.layer_bytes);
  auto in = DeviceBuffer::Open(kv.size());
  auto dslots = DeviceBuffer::Open(slots.size() * 4);
  ASSERT_TRUE(pool.ok() && in.ok() && dslots.ok());
  ASSERT_TRUE(pool->CopyFrom(initial.data(), initial.size()).ok());
  ASSERT_TRUE(in->CopyFrom(kv.data(), kv.size()).ok());
  ASSERT_TRUE(dslots->CopyFrom(slots.data(), slots.size() * 4).ok());
  // The copies ran on the legacy stream; a non-blocking stream does not wait.
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (path == internal::DsMlaStorePath::kAuto) {
    ASSERT_TRUE(gpu::Store(layout, pool->get(), in->get(), dtype,
                           dslots->as<int32_t>(), n, options)
                    .ok());
  } else {
    ASSERT_EQ(internal::LaunchDsMlaStore(
                  layout, pool->as<uint8_t>(), in->as<uint16_t>(),
                  dslots->as<int32_t>(), n, options.hw_e4m3,
                  internal::Launch{static_cast<cudaStream_t>(options.stream),
                                   options.pdl},
                  path),
              cudaSuccess);
  }
  ASSERT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(options.stream)),
            cudaSuccess);
  std::vector<uint8_t> got(layout.layer_bytes);
  ASSERT_TRUE(pool->CopyTo(got.data(), got.size()).ok());
  if (n > 1) {
    ASSERT_NE(want, initial) << "the store wrote nothing";
  }
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], want[i]) << "layer byte " << i;
  }
}

// Loads a random plan from a pool of random bytes (every code point, NaN
// codes and scale byte 255 included) into outputs of random bytes.
void CheckLoad(const PoolLayout& layout, int64_t num_segments,
               const LaunchOptions& options, std::mt19937& rng) {
  SCOPED_TRACE(testing::Message()
               << *FormatName(layout.format) << " bs=" << layout.block_size
               << " S=" << num_segments);
  int64_t total_k = 0;
  const std::vector<int32_t> segments =
      RandomSegments(rng, layout, num_segments, &total_k);
  ASSERT_TRUE(ValidateLoad(layout, segments, total_k).ok());
  const std::vector<uint8_t> pool_bytes = RandomBytes(rng, layout.layer_bytes);
  const int64_t data_row = LoadDataRowBytes(layout.format);
  const int64_t scale_row = LoadScaleRowBytes(layout.format);
  std::vector<uint8_t> want_data = RandomBytes(rng, total_k * data_row);
  std::vector<uint8_t> want_scales = RandomBytes(rng, total_k * scale_row);
  const std::vector<uint8_t> init_data = want_data;
  const std::vector<uint8_t> init_scales = want_scales;
  ASSERT_FALSE(AllZero(pool_bytes));
  ASSERT_TRUE(LoadSegments(layout, pool_bytes.data(), segments, total_k,
                           want_data.data(),
                           scale_row > 0 ? want_scales.data() : nullptr)
                  .ok());

  auto pool = DeviceBuffer::Open(layout.layer_bytes);
  auto seg = DeviceBuffer::Open(segments.size() * 4);
  auto data = DeviceBuffer::Open(init_data.size());
  auto scales = DeviceBuffer::Open(init_scales.size());
  ASSERT_TRUE(pool.ok() && seg.ok() && data.ok() && scales.ok());
  ASSERT_TRUE(pool->CopyFrom(pool_bytes.data(), pool_bytes.size()).ok());
  ASSERT_TRUE(seg->CopyFrom(segments.data(), segments.size() * 4).ok());
  ASSERT_TRUE(data->CopyFrom(init_data.data(), init_data.size()).ok());
  ASSERT_TRUE(scales->CopyFrom(init_scales.data(), init_scales.size()).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_TRUE(gpu::LoadSegments(
                  layout, pool->get(), seg->as<int32_t>(), segments.size() / 4,
                  data->get(), scale_row > 0 ? scales->get() : nullptr, options)
                  .ok());
  ASSERT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(options.stream)),
            cudaSuccess);
  std::vector<uint8_t> got_data(init_data.size());
  std::vector<uint8_t> got_scales(init_scales.size());
  ASSERT_TRUE(data->CopyTo(got_data.data(), got_data.size()).ok());
  ASSERT_TRUE(scales->CopyTo(got_scales.data(), got_scales.size()).ok());
  if (num_segments > 4) {
    ASSERT_NE(want_data, init_data);
  }
  for (size_t i = 0; i < got_data.size(); ++i) {
    ASSERT_EQ(got_data[i], want_data[i])
        << "data row " << i / data_row << " byte " << i % data_row;
  }
  for (size_t i = 0; i < got_scales.size(); ++i) {
    ASSERT_EQ(got_scales[i], want_scales[i]) << "scales row " << i / scale_row;
  }
}

class StoreLoadTest
    : public ::testing::TestWithParam<std::tuple<const char*, int64_t>> {};

TEST_P(StoreLoadTest, StoreMatchesReference) {
  const auto [name, bs] = GetParam();
  std::mt19937 rng(301);
  const PoolLayout layout = Layout(name, bs, 700);
  for (InputDtype dtype : {InputDtype::kBF16, InputDtype::kFP32}) {
    if (!ValidateInputDtype(layout.format, dtype).ok()) {  // DS_MLA_FP8
      const int32_t slot = 0;
      EXPECT_EQ(gpu::Store(layout, nullptr, nullptr, dtype, &slot, 1).code(),
                absl::StatusCode::kInvalidArgument);
      continue;
    }
    for (bool hw : {true, false}) {
      LaunchOptions options;
      options.hw_e4m3 = hw;
      for (int64_t n : {0, 1, 517}) {
        CheckStore(layout, n, dtype, options, rng);
      }
    }
  }
}

TEST_P(StoreLoadTest, LoadMatchesReference) {
  const auto [name, bs] = GetParam();
  std::mt19937 rng(302);
  const PoolLayout layout = Layout(name, bs, 700);
  for (int64_t s : {0, 1, 150}) CheckLoad(layout, s, {}, rng);
}

TEST_P(StoreLoadTest, PdlOnAStreamMatchesReference) {
  const auto [name, bs] = GetParam();
  std::mt19937 rng(303);
  const PoolLayout layout = Layout(name, bs, 300);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
            cudaSuccess);
  LaunchOptions options;
  options.stream = stream;
  options.pdl = true;
  ASSERT_TRUE(LaunchEmptyKernel(options).ok());
  CheckStore(layout, 200, InputDtype::kBF16, options, rng);
  CheckLoad(layout, 60, options, rng);
  cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(Formats, StoreLoadTest,
                         ::testing::Combine(::testing::ValuesIn(kFormats),
                                            ::testing::ValuesIn(kBlockSizes)),
                         [](const auto& info) {
                           std::string s = std::get<0>(info.param);
                           for (char& c : s) {
                             if (c == '(' || c == ')') c = '_';
                           }
                           return s + "_bs" +
                                  std::to_string(std::get<1>(info.param));
                         });

// One million tokens through store then load: far more than one round of
// the persistent grids, so every CTA loops.
TEST(StoreLoadLargeTest, MillionTokens) {
  std::mt19937 rng(304);
  for (const char* name : {"V41", "V41_FP4", "FP4_INDEX", "MXFP8_INDEX"}) {
    const PoolLayout layout = Layout(name, 64, 1 << 20);
    CheckStore(layout, 1 << 20, InputDtype::kBF16, {}, rng);
    CheckLoad(layout, (1 << 20) / 32, {}, rng);
  }
}

// Blocks of 1000 tokens: an index-format load CTA takes several rounds of
// one segment (grid.y is capped by the resident CTAs) and several segments
// (grid.x); a do_cast load CTA loops over its segment's steps.
TEST(StoreLoadLargeTest, LongSegmentsTakeSeveralRounds) {
  std::mt19937 rng(306);
  for (const char* name :
       {"V41", "V41_FP4", "FP4_INDEX", "FP8_FP32SF_INDEX", "MXFP8_INDEX"}) {
    const PoolLayout layout = Layout(name, 1000, 300 * 1000);
    CheckLoad(layout, 2, {}, rng);
    CheckLoad(layout, 400, {}, rng);
    CheckStore(layout, 20000, InputDtype::kBF16, {}, rng);
  }
}

// DS_MLA_FP8's kernels give the reference's bytes on small batches, many
// rounds of the persistent store and long segments that take several load
// steps.
TEST(StoreLoadLargeTest, DsMlaLargeShapes) {
  std::mt19937 rng(307);
  const LaunchOptions options;
  for (int64_t bs : {1, 7, 64, 133, 1000}) {
    const PoolLayout layout = Layout("DS_MLA_FP8", bs, 40000);
    for (int64_t n : {1, 3, 517, 30000}) {
      CheckStore(layout, n, InputDtype::kBF16, options, rng);
    }
    for (int64_t s : {1, 5, 150}) CheckLoad(layout, s, options, rng);
  }
}

// Both DS_MLA_FP8 store kernels named directly (kAuto picks the bulk one
// only for large batches): the reference's bytes for every block size,
// -1 slots, partial last tiles, one token, many rounds of the persistent
// grids, software and hardware e4m3, PDL on a stream; and kAuto past its
// switch to the bulk kernel.
TEST(StoreLoadLargeTest, DsMlaBothStoreKernels) {
  std::mt19937 rng(308);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
            cudaSuccess);
  for (const internal::DsMlaStorePath path :
       {internal::DsMlaStorePath::kWarps, internal::DsMlaStorePath::kBulk}) {
    SCOPED_TRACE(path == internal::DsMlaStorePath::kBulk ? "bulk" : "warps");
    for (int64_t bs : {1, 7, 64, 133}) {
      for (int64_t n : {1, 15, 17, 517, 30000}) {
        const PoolLayout layout = Layout("DS_MLA_FP8", bs, n + n / 4 + 1);
        for (const bool hw : {true, false}) {
          LaunchOptions options;
          options.hw_e4m3 = hw;
          CheckStore(layout, n, InputDtype::kBF16, options, rng, path);
        }
      }
      LaunchOptions pdl;
      pdl.stream = stream;
      pdl.pdl = true;
      CheckStore(Layout("DS_MLA_FP8", bs, 6000), 4099, InputDtype::kBF16, pdl,
                 rng, path);
    }
  }
  const PoolLayout layout =
      Layout("DS_MLA_FP8", 64, internal::kDsMlaBulkMinTokens + 1000);
  CheckStore(layout, internal::kDsMlaBulkMinTokens + 5, InputDtype::kBF16, {},
             rng);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// A layer past 4 GiB: tokens stored into and loaded from the last blocks.
TEST(StoreLoadLargeTest, LayerBeyondFourGiB) {
  std::mt19937 rng(305);
  const int64_t bs = 64;
  const absl::StatusOr<KVCacheFormat> f = FormatFromName("V41");
  ASSERT_TRUE(f.ok());
  const int64_t blocks =
      (int64_t{17} << 28) / ComputePoolLayout(*f, bs, 1, 1).block_stride;
  const absl::StatusOr<PoolLayout> l = MakePoolLayout(*f, bs, blocks, 1);
  ASSERT_TRUE(l.ok());
  const PoolLayout& layout = *l;
  ASSERT_GT(layout.layer_bytes, int64_t{1} << 32);
  const int64_t tail_blocks = 64;
  const int64_t first_block = blocks - tail_blocks;
  const int64_t tail_offset = layout.block_offset(first_block);
  const int64_t tail_bytes = layout.layer_bytes - tail_offset;

  // Slots only in the tail blocks, plus slot 0.
  std::vector<int32_t> slots = RandomSlots(rng, 3000, tail_blocks * bs, 10);
  for (int32_t& s : slots) {
    if (s >= 0) s += static_cast<int32_t>(first_block * bs);
  }
  slots.push_back(0);
  const int64_t n = static_cast<int64_t>(slots.size());
  const std::vector<uint8_t> kv = RandomKv(rng, n, 512, InputDtype::kBF16);
  ASSERT_FALSE(AllZero(kv));

  std::vector<uint8_t> want_tail(tail_bytes, 0),
      want_head(layout.block_stride, 0);
  {
    // The reference writes a host layer of the full size (untouched pages
    // stay unallocated).
    uint8_t* host = static_cast<uint8_t*>(calloc(layout.layer_bytes, 1));
    ASSERT_NE(host, nullptr);
    ASSERT_TRUE(Store(layout, host, kv.data(), InputDtype::kBF16, slots).ok());
    std::copy(host + tail_offset, host + layout.layer_bytes, want_tail.begin());
    std::copy(host, host + layout.block_stride, want_head.begin());
    free(host);
  }
  auto pool = DeviceBuffer::Open(layout.layer_bytes);
  auto in = DeviceBuffer::Open(kv.size());
  auto dslots = DeviceBuffer::Open(slots.size() * 4);
  ASSERT_TRUE(pool.ok() && in.ok() && dslots.ok());
  ASSERT_EQ(cudaMemset(pool->get(), 0, layout.layer_bytes), cudaSuccess);
  ASSERT_TRUE(in->CopyFrom(kv.data(), kv.size()).ok());
  ASSERT_TRUE(dslots->CopyFrom(slots.data(), slots.size() * 4).ok());
  ASSERT_TRUE(gpu::Store(layout, pool->get(), in->get(), InputDtype::kBF16,
                         dslots->as<int32_t>(), n)
                  .ok());
  std::vector<uint8_t> got_tail(tail_bytes), got_head(layout.block_stride);
  ASSERT_TRUE(pool->CopyTo(got_tail.data(), tail_bytes, tail_offset).ok());
  ASSERT_TRUE(pool->CopyTo(got_head.data(), got_head.size()).ok());
  ASSERT_FALSE(AllZero(want_tail));
  ASSERT_TRUE(got_tail == want_tail) << "tail blocks differ";
  ASSERT_TRUE(got_head == want_head) << "block 0 differs";

  // Load the tail blocks back and compare with the input's round trip.
  std::vector<int32_t> segments;
  for (int64_t b = 0; b < tail_blocks; ++b) {
    segments.insert(segments.end(),
                    {static_cast<int32_t>(first_block + b), 0,
                     static_cast<int32_t>(bs), static_cast<int32_t>(b * bs)});
  }
  const int64_t total_k = tail_blocks * bs;
  std::vector<uint8_t> want(total_k * 1024, 0);
  {
    // Reference load from a host copy holding only the tail (offsets shift).
    const absl::StatusOr<PoolLayout> small =
        MakePoolLayout(*f, bs, tail_blocks, 1);
    ASSERT_TRUE(small.ok());
    std::vector<int32_t> local = segments;
    for (size_t i = 0; i < local.size(); i += 4) local[i] -= first_block;
    ASSERT_TRUE(LoadSegments(*small, want_tail.data(), local, total_k,
                             want.data(), nullptr)
                    .ok());
  }
  auto seg = DeviceBuffer::Open(segments.size() * 4);
  auto out = DeviceBuffer::Open(want.size());
  ASSERT_TRUE(seg.ok() && out.ok());
  ASSERT_TRUE(seg->CopyFrom(segments.data(), segments.size() * 4).ok());
  ASSERT_EQ(cudaMemset(out->get(), 0, want.size()), cudaSuccess);
  ASSERT_TRUE(gpu::LoadSegments(layout, pool->get(), seg->as<int32_t>(),
                                tail_blocks, out->get(), nullptr)
                  .ok());
  std::vector<uint8_t> got(want.size());
  ASSERT_TRUE(out->CopyTo(got.data(), got.size()).ok());
  ASSERT_FALSE(AllZero(want));
  ASSERT_TRUE(got == want) << "load from beyond 4 GiB differs";
}

TEST(EncoderTest, FastEncodersEqualQuantHOverAllFloats) {
  const absl::StatusOr<EncoderCheck> c = CheckEncoders();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->e4m3_mismatches, 0u)
      << "first mismatch at fp32 bits 0x" << std::hex << c->first_e4m3;
  EXPECT_EQ(c->e2m1_mismatches, 0u)
      << "first mismatch at fp32 bits 0x" << std::hex << c->first_e2m1;
  EXPECT_EQ(c->ds_mla_scale_mismatches, 0u)
      << "first DS_MLA_FP8 scale mismatch at amax bits 0x" << std::hex
      << c->first_ds_mla_scale;
  EXPECT_EQ(c->ue8m0_scale_mismatches, 0u)
      << "first UE8M0 scale mismatch at amax bits 0x" << std::hex
      << c->first_ue8m0_scale;
}

TEST(LauncherTest, RejectsBadArgumentsBeforeLaunching) {
  const PoolLayout layout = Layout("V41", 64, 128);
  int32_t slot = 0;
  alignas(16) uint8_t buf[64] = {};
  absl::Status s =
      gpu::Store(layout, buf, buf + 4, InputDtype::kBF16, &slot, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("kv is not 16-byte aligned"));
  s = gpu::Store(layout, nullptr, buf, InputDtype::kBF16, &slot, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("layer is null"));
  s = gpu::Store(layout, buf, buf, InputDtype::kBF16, &slot, -1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("num_tokens = -1 is negative"));
  PoolLayout odd = layout;
  odd.format.quantized_elements = 256;
  s = gpu::Store(odd, buf, buf, InputDtype::kBF16, &slot, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("not one of the supported formats"));
  s = gpu::LoadSegments(layout, buf, &slot, -2, buf, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("num_segments = -2 is negative"));
  const PoolLayout index = Layout("MXFP8_INDEX", 64, 128);
  s = gpu::LoadSegments(index, buf, &slot, 1, buf, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("scales is null"));
  // Zero work launches nothing, whatever the pointers.
  EXPECT_TRUE(
      gpu::Store(layout, nullptr, nullptr, InputDtype::kBF16, nullptr, 0).ok());
  EXPECT_TRUE(
      gpu::LoadSegments(layout, nullptr, nullptr, 0, nullptr, nullptr).ok());
}

TEST(LauncherTest, ValidationIsTheReferences) {
  const PoolLayout layout = Layout("V41", 64, 128);
  const std::vector<int32_t> slots = {3, 9000};
  absl::Status s = ValidateStore(layout, slots);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("slot_mapping[1] = 9000"));
  const std::vector<int32_t> dup = {5, 5};
  EXPECT_EQ(ValidateStore(layout, dup).code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<int32_t> segments = {0, 0, 65, 0};
  s = ValidateLoad(layout, segments, 65);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("segments[0]"));
}

}  // namespace
}  // namespace kvdepot::gpu
