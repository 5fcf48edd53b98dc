// Hand-derived records (the derivation is in the comments), so the reference
// is checked against arithmetic done outside it, not only against itself.
// Pool: block_size 3, 2 blocks; token A -> slot 4 (block 1, offset 1),
// token B -> slot 0.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/format.h"
#include "kernels/format_host.h"
#include "kernels/reference/reference.h"

namespace kvdepot {
namespace {

struct Pool {
  PoolLayout layout;
  std::vector<uint8_t> bytes;
};

Pool StoreTwo(const char* name, const std::vector<float>& a,
              const std::vector<float>& b) {
  Pool p;
  p.layout = *MakePoolLayout(*FormatFromName(name), 3, 2, 1);
  p.bytes.assign(p.layout.layer_bytes, 0xEE);
  std::vector<float> kv = a;
  kv.insert(kv.end(), b.begin(), b.end());
  const absl::Status s =
      Store(p.layout, p.bytes.data(), kv.data(), InputDtype::kFP32, {4, 0});
  EXPECT_TRUE(s.ok()) << s;
  return p;
}

std::vector<uint16_t> LoadBf16(const Pool& p, int32_t block, int32_t t) {
  std::vector<uint16_t> out(p.layout.format.elements());
  const std::vector<int32_t> seg = {block, t, t + 1, 0};
  EXPECT_TRUE(
      LoadSegments(p.layout, p.bytes.data(), seg, 1, out.data(), nullptr).ok());
  return out;
}

TEST(GoldenTest, V41) {
  // Token A, groups of 32 (scale byte = ceil(log2(amax / 448)) + 127):
  //  g0: {1, -2, 0.5, 0.3, -1e-6, 0...}: amax 2, 2/448 = 2^-7.81 -> e = -7,
  //      byte 0x78, x * 2^7: 128 = 2^7 -> S.1110.000 = 0x70; -256 -> 0xF8;
  //      64 -> 0x68; 38.4 = 2^5 * 1.2, mantissa 1.6/8 -> 2/8 -> 40 = 0x62;
  //      -1.28e-4 < 2^-10 -> negative zero 0x80.
  //  g1: {448, 449, -0.0625, 0...}: 449/448 > 1 -> e = 1, byte 0x80; x/2:
  //      224 = 2^7 * 1.75 -> 0x76; 224.5 -> 0x76; -2^-5 -> S.0010.000 = 0x90.
  //  g2: {NaN, 3, 0...}: NaN ignored, amax 3 -> e = -7 (0x78); NaN -> 0x7F;
  //      384 = 2^8 * 1.5 -> 0x7C.
  //  g3..g15 zero: 1e-4 / 448 = 2^-22.09 -> e = -22, byte 105 = 0x69.
  // Token B: all -1: 1/448 = 2^-8.8 -> e = -8 (0x77); -256 -> 0xF8.
  std::vector<float> a(512, 0.0f), b(512, -1.0f);
  a[0] = 1.0f, a[1] = -2.0f, a[2] = 0.5f, a[3] = 0.3f, a[4] = -1e-6f;
  a[32] = 448.0f, a[33] = 449.0f, a[34] = -0.0625f;
  a[64] = std::numeric_limits<float>::quiet_NaN(), a[65] = 3.0f;
  const Pool p = StoreTwo("V41", a, b);
  // Interleaved, 528 B records; block_stride = round_up(3 * 528,
  // lcm(32, 528) = 1056) = 2112; slot 4 at 2112 + 528 = 2640.
  ASSERT_EQ(p.layout.block_stride, 2112);
  std::vector<uint8_t> want(528, 0x00);
  const uint8_t g0[] = {0x70, 0xF8, 0x68, 0x62, 0x80};
  memcpy(&want[0], g0, sizeof(g0));
  want[32] = 0x76, want[33] = 0x76, want[34] = 0x90;
  want[64] = 0x7F, want[65] = 0x7C;
  for (int g = 0; g < 16; ++g) want[512 + g] = 0x69;
  want[512] = 0x78, want[513] = 0x80, want[514] = 0x78;
  EXPECT_EQ(std::vector<uint8_t>(&p.bytes[2640], &p.bytes[2640 + 528]), want);
  std::vector<uint8_t> want_b(528, 0xF8);
  for (int g = 0; g < 16; ++g) want_b[512 + g] = 0x77;
  EXPECT_EQ(std::vector<uint8_t>(&p.bytes[0], &p.bytes[528]), want_b);
  EXPECT_EQ(p.bytes[528], 0xEE);  // slot 1 untouched

  // Load: 0x70 -> 128 * 2^-7 = 1 (bf16 0x3F80); 0xF8 -> -2 (0xC000);
  // 0x62 -> 40 * 2^-7 = 0.3125 (0x3EA0); 0x80 -> -0 (0x8000); 0x76 -> 224 * 2
  // = 448 (0x43E0); NaN stays NaN (0x7FC0); 0x7C -> 3 (0x4040).
  const std::vector<uint16_t> la = LoadBf16(p, 1, 1);
  EXPECT_EQ(la[0], 0x3F80);
  EXPECT_EQ(la[1], 0xC000);
  EXPECT_EQ(la[3], 0x3EA0);
  EXPECT_EQ(la[4], 0x8000);
  EXPECT_EQ(la[32], 0x43E0);
  EXPECT_EQ(la[33], 0x43E0);
  EXPECT_EQ(la[64], 0x7FC0);
  EXPECT_EQ(la[65], 0x4040);
  EXPECT_EQ(LoadBf16(p, 0, 0)[511], 0xBF80);  // token B: -1
}

TEST(GoldenTest, V41Fp4) {
  // Groups of 16, sf = e4m3(max(amax, 2^-9 * 6) * c), r = 1 / sf.
  //  g0: {3, -1, 0.25, 0.7, 1.25, -0.1, 0...}: 3 * c = 0.50000001 -> sf
  //      0.5 = 0x30, r = 2 -> 6 (code 7), -2 (0xC), 0.5 (1), 1.4 -> 1.5 (3),
  //      2.5 tie 2|3 -> even code 4 (2), -0.2 -> negative zero (0x8).
  //      Bytes (element 2i low nibble): 0xC7, 0x31, 0x84, 0...
  //  g1 zero: 0.01171875 * c = 2^-9 (+) -> sf code 0x01.
  //  g2: {100, -7, 0...}: 100 * c = 16.67 -> e4m3 16 = 0x58, r = 1/16:
  //      6.25 saturates to 6 (7); -0.4375 -> -0.5 (0x9). Byte 16 = 0x97.
  // Token B: all 1.5: sf = e4m3(0.25) = 0x28, r = 4 -> 6 (7): bytes 0x77.
  std::vector<float> a(512, 0.0f), b(512, 1.5f);
  const float g0[] = {3.0f, -1.0f, 0.25f, 0.7f, 1.25f, -0.1f};
  memcpy(a.data(), g0, sizeof(g0));
  a[32] = 100.0f, a[33] = -7.0f;
  const Pool p = StoreTwo("V41_FP4", a, b);
  // 288 B records, lcm(32, 288) = 288: block_stride 864, slot 4 at 1152.
  ASSERT_EQ(p.layout.block_stride, 864);
  std::vector<uint8_t> want(288, 0x00);
  want[0] = 0xC7, want[1] = 0x31, want[2] = 0x84, want[16] = 0x97;
  for (int g = 0; g < 32; ++g) want[256 + g] = 0x01;
  want[256] = 0x30, want[258] = 0x58;
  EXPECT_EQ(std::vector<uint8_t>(&p.bytes[1152], &p.bytes[1152 + 288]), want);
  std::vector<uint8_t> want_b(288, 0x77);
  for (int g = 0; g < 32; ++g) want_b[256 + g] = 0x28;
  EXPECT_EQ(std::vector<uint8_t>(&p.bytes[0], &p.bytes[288]), want_b);

  // Load: 6 * 0.5 = 3 (0x4040); 2 * 0.5 = 1 (0x3F80, 1.25 came back as 1);
  // -0 (0x8000); 6 * 16 = 96 (0x42C0); -0.5 * 16 = -8 (0xC100).
  const std::vector<uint16_t> la = LoadBf16(p, 1, 1);
  EXPECT_EQ(la[0], 0x4040);
  EXPECT_EQ(la[4], 0x3F80);
  EXPECT_EQ(la[5], 0x8000);
  EXPECT_EQ(la[32], 0x42C0);
  EXPECT_EQ(la[33], 0xC100);
  EXPECT_EQ(LoadBf16(p, 0, 0)[7], 0x3FC0);  // token B: 6 * 0.25 = 1.5
}

TEST(GoldenTest, Fp4IndexNibbleOrderAndPackedScales) {
  // g0 {6, 1, 0...}: 6/6 = 1 -> e = 0 (0x7F), codes 7 and 2: element 0 in
  // the low nibble -> 0x27. Zero groups: 1e-4/6 = 2^-15.6 -> e = -15 (0x70).
  // Block-split: 68 B tokens, block_stride round_up(204, 32) = 224; slot 4
  // data at 224 + 64, scales at 224 + 3 * 64 + 4.
  std::vector<float> a(128, 0.0f), b(128, 0.0f);
  a[0] = 6.0f, a[1] = 1.0f;
  const Pool p = StoreTwo("FP4_INDEX", a, b);
  EXPECT_EQ(p.bytes[288], 0x27);
  EXPECT_EQ(p.bytes[289], 0x00);
  const uint8_t want_sf[] = {0x7F, 0x70, 0x70, 0x70};
  EXPECT_EQ(0, memcmp(&p.bytes[420], want_sf, 4));
  std::vector<uint8_t> data(64);
  int32_t packed = 0;
  const std::vector<int32_t> seg = {1, 1, 2, 0};
  ASSERT_TRUE(
      LoadSegments(p.layout, p.bytes.data(), seg, 1, data.data(), &packed)
          .ok());
  EXPECT_EQ(data[0], 0x27);
  EXPECT_EQ(static_cast<uint32_t>(packed), 0x7070707Fu);  // four per int32
}

TEST(GoldenTest, Fp8Fp32ScaleIndex) {
  // amax 448 -> s = 448 / 448 = 1.0 (0x3F800000 little-endian), r = 1:
  // 448 -> 0x7E, -0.25 -> 2^-2 -> S.0101.000 = 0xA8.
  std::vector<float> a(128, 0.0f), b(128, 0.0f);
  a[0] = 448.0f, a[127] = -0.25f;
  const Pool p = StoreTwo("FP8_FP32SF_INDEX", a, b);
  // 132 B tokens, block_stride round_up(396, 32) = 416; slot 4: data at
  // 416 + 128, scale at 416 + 3 * 128 + 4.
  EXPECT_EQ(p.bytes[544], 0x7E);
  EXPECT_EQ(p.bytes[544 + 127], 0xA8);
  const uint8_t want_sf[] = {0x00, 0x00, 0x80, 0x3F};
  EXPECT_EQ(0, memcmp(&p.bytes[804], want_sf, 4));
  std::vector<uint8_t> data(128);
  float scale = 0.0f;
  const std::vector<int32_t> seg = {1, 1, 2, 0};
  ASSERT_TRUE(
      LoadSegments(p.layout, p.bytes.data(), seg, 1, data.data(), &scale).ok());
  EXPECT_EQ(scale, 1.0f);  // one fp32 per row
  EXPECT_EQ(data[127], 0xA8);
}

TEST(GoldenTest, ScaleRowsPadToWholeInt32s) {
  // Custom index formats: 2 UE8M0 scales (row padded to 4 bytes with zeros)
  // and 8 (two int32 per row). Groups of one value 2^k give byte k + 119
  // (2^k / 448 -> e = k - 8, +127).
  for (int32_t group : {64, 16}) {
    absl::StatusOr<KVCacheFormat> f = MakeFormat(
        QuantDtype::kE4M3, 128, group, 0, false, ScaleFormat::kUE8M0, false);
    ASSERT_TRUE(f.ok());
    absl::StatusOr<PoolLayout> l = MakePoolLayout(*f, 3, 1, 1);
    ASSERT_TRUE(l.ok());
    const int n = 128 / group;
    std::vector<float> x(128, 0.0f);
    std::vector<uint8_t> want(LoadScaleRowBytes(*f), 0x00);
    ASSERT_EQ(want.size(), n == 2 ? 4u : 8u);
    for (int g = 0; g < n; ++g) {
      x[g * group] = std::ldexp(1.0f, g);
      want[g] = static_cast<uint8_t>(g + 119);
    }
    std::vector<uint8_t> pool(l->layer_bytes, 0xEE);
    ASSERT_TRUE(
        Store(*l, pool.data(), x.data(), InputDtype::kFP32, {{2}}).ok());
    std::vector<uint8_t> data(128), scales(want.size(), 0xCC);
    const std::vector<int32_t> seg = {0, 2, 3, 0};
    ASSERT_TRUE(
        LoadSegments(*l, pool.data(), seg, 1, data.data(), scales.data()).ok());
    EXPECT_EQ(scales, want) << "group " << group;
  }
}

}  // namespace
}  // namespace kvdepot
