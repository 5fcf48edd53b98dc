#include "server/record_check.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/format_host.h"
#include "kernels/reference/reference.h"

namespace kvdepot {
namespace {

// A one-block layout of `format` with `block_size` slots, each slot encoded
// from random values.
struct Block {
  PoolLayout layout;
  std::vector<uint8_t> bytes;
};

Block EncodedBlock(absl::string_view format, int64_t block_size) {
  absl::StatusOr<KVCacheFormat> f = FormatFromName(format);
  EXPECT_TRUE(f.ok()) << f.status();
  Block b;
  b.layout = ComputePoolLayout(*f, block_size, 1, 1);
  b.bytes.assign(static_cast<size_t>(b.layout.block_stride), 0);
  std::mt19937 rng(301);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  std::vector<float> x(static_cast<size_t>(f->elements()));
  for (int64_t t = 0; t < block_size; ++t) {
    for (float& v : x) v = dist(rng);
    EncodeToken(*f, x.data(), b.bytes.data() + b.layout.data_offset(0, t),
                b.bytes.data() + b.layout.scale_offset(0, t));
  }
  return b;
}

TEST(RecordCheck, EncodedRecordsAreHealthy) {
  for (const char* name : {"V41", "V41_FP4", "FP4_INDEX", "FP8_FP32SF_INDEX",
                           "MXFP8_INDEX", "BF16(6)"}) {
    for (int64_t bs : {1, 3, 7, 17, 64, 133}) {
      Block b = EncodedBlock(name, bs);
      std::vector<float> v(static_cast<size_t>(b.layout.format.elements()));
      for (int64_t t = 0; t < bs; ++t) {
        const RecordHealth h =
            CheckRecord(b.layout, b.bytes.data(), t, v.data());
        EXPECT_TRUE(h.ok()) << name << " block_size " << bs << " t " << t;
        EXPECT_FALSE(h.all_zero) << name;
      }
    }
  }
}

TEST(RecordCheck, Ue8m0ScaleOf255IsFoundAndNamed) {
  Block b = EncodedBlock("MXFP8_INDEX", 7);
  ASSERT_EQ(b.layout.format.sf_format, ScaleFormat::kUE8M0);
  b.bytes[b.layout.scale_offset(0, 3) + 1] = 255;
  std::vector<float> v(static_cast<size_t>(b.layout.format.elements()));
  const RecordHealth h = CheckRecord(b.layout, b.bytes.data(), 3, v.data());
  EXPECT_EQ(h.bad_scales, 1);
  EXPECT_EQ(h.first_bad_scale, 1);
  const std::string d = DescribeProblem(b.layout, b.bytes.data(), 3, 10, h);
  EXPECT_TRUE(absl::StrContains(d, "slot 10: UE8M0 scale[1] = 0xff")) << d;
  EXPECT_TRUE(CheckRecord(b.layout, b.bytes.data(), 2, v.data()).ok());
}

TEST(RecordCheck, NegativeAndNanScalesAreImpossible) {
  const uint8_t e4m3_nan = 0x7F, e4m3_neg = 0xB8, e4m3_one = 0x38;
  EXPECT_FALSE(ScaleIsPossible(ScaleFormat::kE4M3, &e4m3_nan));
  EXPECT_FALSE(ScaleIsPossible(ScaleFormat::kE4M3, &e4m3_neg));
  EXPECT_TRUE(ScaleIsPossible(ScaleFormat::kE4M3, &e4m3_one));
  for (float f : {-1.0f, NAN, INFINITY}) {
    uint8_t b[4];
    std::memcpy(b, &f, 4);
    EXPECT_FALSE(ScaleIsPossible(ScaleFormat::kFP32, b)) << f;
  }
  const float one = 1.0f;
  uint8_t b[4];
  std::memcpy(b, &one, 4);
  EXPECT_TRUE(ScaleIsPossible(ScaleFormat::kFP32, b));
  const uint8_t u254 = 254, u255 = 255;
  EXPECT_TRUE(ScaleIsPossible(ScaleFormat::kUE8M0, &u254));
  EXPECT_FALSE(ScaleIsPossible(ScaleFormat::kUE8M0, &u255));
}

TEST(RecordCheck, Bf16NanAndInfAreCounted) {
  Block b = EncodedBlock("BF16(6)", 3);
  uint8_t* data = b.bytes.data() + b.layout.data_offset(0, 2);
  const uint16_t nan = 0x7FC0, inf = 0xFF80;
  std::memcpy(data + 2, &nan, 2);
  std::memcpy(data + 8, &inf, 2);
  std::vector<float> v(6);
  const RecordHealth h = CheckRecord(b.layout, b.bytes.data(), 2, v.data());
  EXPECT_EQ(h.nan_values, 1);
  EXPECT_EQ(h.inf_values, 1);
  EXPECT_EQ(h.bad_scales, 0);
  EXPECT_TRUE(std::isnan(v[1]));
  EXPECT_TRUE(std::isinf(v[4]));
  EXPECT_TRUE(absl::StrContains(
      DescribeProblem(b.layout, b.bytes.data(), 2, 5, h), "1 NaN and 1 Inf"));
}

TEST(RecordCheck, ZeroRecordIsAllZeroAndHealthy) {
  // DS_MLA_FP8: a zero fp32 scale is no encoder's, but an all-zero record
  // is a slot never written (a new pool), not a problem.
  for (const char* name : {"V41", "DS_MLA_FP8"}) {
    Block b = EncodedBlock(name, 1);
    std::fill(b.bytes.begin(), b.bytes.end(), 0);
    std::vector<float> v(static_cast<size_t>(b.layout.format.elements()));
    const RecordHealth h = CheckRecord(b.layout, b.bytes.data(), 0, v.data());
    EXPECT_TRUE(h.all_zero) << name;
    EXPECT_TRUE(h.ok()) << name;
  }
}

TEST(RecordCheck, DsMlaZeroScaleInAWrittenRecordIsBad) {
  Block b = EncodedBlock("DS_MLA_FP8", 1);
  uint8_t* scales = b.bytes.data() + b.layout.scale_offset(0, 0);
  std::memset(scales, 0, 4);  // tile 0's scale of a written record
  std::vector<float> v(static_cast<size_t>(b.layout.format.elements()));
  const RecordHealth h = CheckRecord(b.layout, b.bytes.data(), 0, v.data());
  EXPECT_FALSE(h.all_zero);
  EXPECT_EQ(h.bad_scales, 1);
  EXPECT_EQ(h.first_bad_scale, 0);
}

}  // namespace
}  // namespace kvdepot
