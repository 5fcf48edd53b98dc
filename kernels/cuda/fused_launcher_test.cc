// The fused store launcher's checks (no GPU needed: every call here is
// refused before anything touches the device). One test per rule, each
// asserting the message names the field.
#include <cstdint>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/fused_kernels.h"
#include "kernels/format_host.h"
#include "kernels/named_formats.h"

namespace kvdepot::gpu {
namespace {

using ::testing::HasSubstr;

// Never dereferenced: the launcher refuses before launching.
alignas(16) uint8_t fake[64];
uint8_t* const kLayer = fake;
const uint16_t* const kKv = reinterpret_cast<const uint16_t*>(fake);
const int32_t* const kSlots = reinterpret_cast<const int32_t*>(fake);
uint16_t* const kCast = reinterpret_cast<uint16_t*>(fake);

PoolLayout Layout(const KVCacheFormat& f) {
  const absl::StatusOr<PoolLayout> l = MakePoolLayout(f, 64, 4, 1);
  EXPECT_TRUE(l.ok()) << l.status();
  return *l;
}

std::string Refusal(const PoolLayout& layout, const FusedParams& p,
                    const void* layer = kLayer, const uint16_t* kv = kKv,
                    uint16_t* cast = nullptr, int64_t n = 3) {
  const absl::Status s =
      FusedStore(layout, const_cast<void*>(layer), kv, p, kSlots, n, cast);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  return std::string(s.message());
}

TEST(FusedLauncherTest, UnknownFormat) {
  PoolLayout l = Layout(kFormatV41);
  l.format.elements_per_sf = 64;  // not a named format
  EXPECT_THAT(Refusal(l, {}), HasSubstr("not one of the supported formats"));
}

TEST(FusedLauncherTest, BadLayout) {
  PoolLayout l = Layout(kFormatV41);
  l.block_size = 0;
  EXPECT_THAT(Refusal(l, {}), HasSubstr("block_size = 0"));
}

TEST(FusedLauncherTest, NegativeCount) {
  EXPECT_THAT(Refusal(Layout(kFormatV41), {}, kLayer, kKv, nullptr, -1),
              HasSubstr("num_tokens = -1"));
}

TEST(FusedLauncherTest, TokenTooLong) {
  EXPECT_THAT(Refusal(Layout(Bf16Format(1032)), {}), HasSubstr("at most 1024"));
}

TEST(FusedLauncherTest, NormRangeOffEights) {
  FusedParams p;
  p.norm_begin = 4;
  p.norm_end = 64;
  p.norm_weight = kKv;
  EXPECT_THAT(Refusal(Layout(kFormatV41), p), HasSubstr("multiples of 8"));
}

TEST(FusedLauncherTest, NormRangeOutsideTheToken) {
  FusedParams p;
  p.norm_end = 520;
  p.norm_weight = kKv;
  EXPECT_THAT(Refusal(Layout(kFormatV41), p), HasSubstr("norm range [0, 520)"));
}

TEST(FusedLauncherTest, NormWeightMissingOrMisaligned) {
  FusedParams p;
  p.norm_end = 512;
  EXPECT_THAT(Refusal(Layout(kFormatV41), p), HasSubstr("norm_weight is null"));
  p.norm_weight = reinterpret_cast<const uint16_t*>(fake + 2);
  EXPECT_THAT(Refusal(Layout(kFormatV41), p),
              HasSubstr("norm_weight is not 16-byte aligned"));
}

TEST(FusedLauncherTest, BadEps) {
  FusedParams p;
  p.norm_end = 512;
  p.norm_weight = kKv;
  p.eps = -1.0f;
  EXPECT_THAT(Refusal(Layout(kFormatV41), p), HasSubstr("eps = -1"));
}

TEST(FusedLauncherTest, RopeChecks) {
  FusedParams p;
  p.rope = RopeStyle::kNeox;
  p.rope_dim = 63;
  EXPECT_THAT(Refusal(Layout(kFormatV41), p), HasSubstr("rope_dim = 63"));
  p.rope_dim = 64;
  p.rope_offset = 480;
  EXPECT_THAT(Refusal(Layout(kFormatV41), p),
              HasSubstr("rope range [480, 544)"));
  p.rope_offset = 448;
  EXPECT_THAT(Refusal(Layout(kFormatV41), p), HasSubstr("cos_sin cache"));
  p.cos_sin = reinterpret_cast<const float*>(fake + 4);
  p.max_position = 16;
  p.positions = reinterpret_cast<const int64_t*>(fake);
  // Rows are read as float4: a 4-byte aligned cache is refused.
  EXPECT_THAT(Refusal(Layout(kFormatV41), p),
              HasSubstr("cos_sin is not 16-byte aligned"));
  p.cos_sin = reinterpret_cast<const float*>(fake);
  p.positions = nullptr;
  EXPECT_THAT(Refusal(Layout(kFormatV41), p), HasSubstr("positions is null"));
  p.rope = static_cast<RopeStyle>(7);
  EXPECT_THAT(Refusal(Layout(kFormatV41), p), HasSubstr("rope style = 7"));
}

TEST(FusedLauncherTest, HadamardChecks) {
  FusedParams p;
  p.hadamard_len = 96;
  EXPECT_THAT(Refusal(Layout(kFormatV41), p), HasSubstr("not a power of two"));
  p.hadamard_len = 1024;
  EXPECT_THAT(Refusal(Layout(Bf16Format(1024)), p),
              HasSubstr("does not support"));
  p.hadamard_len = 256;  // the index formats hold 128 elements
  EXPECT_THAT(Refusal(Layout(kFormatMxfp8Index), p),
              HasSubstr("hadamard range [0, 256)"));
  p.hadamard_len = 512;
  p.hadamard_begin = 65;  // DS_MLA_FP8: [64, 576) would fit
  EXPECT_THAT(Refusal(Layout(kFormatDsMlaFp8), p),
              HasSubstr("hadamard range [65, 577)"));
}

TEST(FusedLauncherTest, Pointers) {
  const PoolLayout l = Layout(kFormatV41);
  EXPECT_THAT(Refusal(l, {}, fake + 8), HasSubstr("layer is not 16-byte"));
  EXPECT_THAT(Refusal(l, {}, kLayer, nullptr), HasSubstr("kv is null"));
  EXPECT_THAT(Refusal(l, {}, kLayer, kKv, kCast + 1),
              HasSubstr("cast_back is not 16-byte"));
}

TEST(FusedLauncherTest, NoTokensIsANoOp) {
  EXPECT_TRUE(
      FusedStore(Layout(kFormatV41), nullptr, nullptr, {}, nullptr, 0, nullptr)
          .ok());
}

}  // namespace
}  // namespace kvdepot::gpu
