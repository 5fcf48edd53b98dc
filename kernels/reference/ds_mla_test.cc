// DS_MLA_FP8 (SPEC §2.1) in the CPU reference: golden records derived by
// hand from the definition (FlashMLA tests/quant.py @ 9241ae3), the
// non-finite tiles, the tail, the store/load round trip over awkward block
// sizes with -1 slots, and the BF16-only input rule.
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "kernels/format_host.h"
#include "kernels/named_formats.h"
#include "kernels/quant.h"
#include "kernels/reference/reference.h"
#include "kernels/store_load_host.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

constexpr KVCacheFormat kF = kFormatDsMlaFp8;
constexpr int kRec = 656;

uint32_t ScaleBits(const std::vector<uint8_t>& rec, int tile) {
  uint32_t b;
  memcpy(&b, rec.data() + 512 + 4 * tile, 4);
  return b;
}

std::vector<uint8_t> Encode(const std::vector<uint16_t>& x) {
  std::vector<uint8_t> rec(kRec, 0xAA);
  EncodeTokenBf16(kF, reinterpret_cast<const uint8_t*>(x.data()), rec.data(),
                  rec.data() + 512);
  return rec;
}

std::vector<uint16_t> Decode(const std::vector<uint8_t>& rec) {
  std::vector<uint16_t> out(576, 0xAAAA);
  DecodeTokenBf16(kF, rec.data(), rec.data() + 512,
                  reinterpret_cast<uint8_t*>(out.data()));
  return out;
}

TEST(DsMlaFormatTest, NameLayoutAndRules) {
  EXPECT_EQ(*FormatFromName("ds_mla_fp8"), kF);
  EXPECT_EQ(*FormatName(kF), "DS_MLA_FP8");
  EXPECT_EQ(kF.bytes_per_token(), 656);
  EXPECT_EQ(kF.elements(), 576);
  EXPECT_EQ(LoadDataRowBytes(kF), 1152);
  EXPECT_EQ(*ResolveFormat(656), kF);
  const PoolLayout l = *MakePoolLayout(kF, 64, 2, 1);
  EXPECT_EQ(l.block_stride, 64 * 656);  // a multiple of lcm(32, 656) = 1312
  EXPECT_EQ(l.tail_offset(1, 3), 64 * 656 + 3 * 656 + 528);
  EXPECT_EQ(kF.token_stride_alignment(), 16);

  KVCacheFormat f = kF;
  f.token_interleaved = false;
  f.do_cast = false;
  EXPECT_THAT(std::string(ValidateFormat(f).message()),
              HasSubstr("needs token_interleaved"));
  f = kF;
  f.sf_format = ScaleFormat::kUE8M0;
  EXPECT_THAT(std::string(ValidateFormat(f).message()),
              HasSubstr("pow2_ceil needs sf_format fp32"));
  f = kF;
  f.scale_rounding = ScaleRounding::kNone;  // a tail on §3 math
  EXPECT_TRUE(ValidateFormat(f).ok());
  EXPECT_EQ(ValidateQuantization(f).code(), absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(ValidateInputDtype(kF, InputDtype::kBF16).ok());
  const absl::Status fp32 = ValidateInputDtype(kF, InputDtype::kFP32);
  EXPECT_EQ(fp32.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(fp32.message()), HasSubstr("DS_MLA_FP8 takes BF16"));
}

// Token A, tile by tile (values as BF16 bits):
//  tile 0: x0 = 3.0 (0x4040), x1 = 1.0625 (0x3F88), x2 = 1.09375 (0x3F8C),
//          the rest 1.0 (0x3F80). amax / 448 = 0.0066964 -> ceil(log2) = -7,
//          s = 2^-7 (bits 120 << 23 = 0x3C000000). x / s: 384 = 1.5 * 2^8 ->
//          e4m3 E=8+7=15, M=4: 0x7C; 136 = 1.0625 * 2^7 is the tie between
//          128 (M=0) and 144 (M=1) -> even: 0x70; 140 -> 144: 0x71;
//          128 = 2^7 -> E=14, M=0: 0x70.
//  tile 1: zeros, x129 = -0 (0x8000): s = 2^ceil(log2(1e-4)) = 2^-13
//          (0x39000000); codes 0x00, and 0x80 for the negative zero.
//  tile 2: 1.0 with x259 = NaN (0x7FC1): scale 0x7FFFFFFF, codes all 0x7F.
//  tile 3: 0.5 (0x3F00), x384 = +Inf, x385 = -2 (0xC000), x386 = -Inf:
//          scale +Inf (0x7F800000); Inf -> 0x7F, -2 -> 0x80, 0.5 -> 0x00.
//  tail:   0x1234 + i, with x517 = NaN 0xFFC1 (copied, not canonicalized).
std::vector<uint16_t> TokenA() {
  std::vector<uint16_t> x(576);
  for (int i = 0; i < 128; ++i) x[i] = 0x3F80;
  x[0] = 0x4040;
  x[1] = 0x3F88;
  x[2] = 0x3F8C;
  for (int i = 128; i < 256; ++i) x[i] = 0x0000;
  x[129] = 0x8000;
  for (int i = 256; i < 384; ++i) x[i] = 0x3F80;
  x[259] = 0x7FC1;
  for (int i = 384; i < 512; ++i) x[i] = 0x3F00;
  x[384] = 0x7F80;
  x[385] = 0xC000;
  x[386] = 0xFF80;
  for (int i = 0; i < 64; ++i) x[512 + i] = static_cast<uint16_t>(0x1234 + i);
  x[517] = 0xFFC1;
  return x;
}

TEST(DsMlaGoldenTest, TokenAByHand) {
  const std::vector<uint16_t> x = TokenA();
  const std::vector<uint8_t> rec = Encode(x);
  std::vector<uint8_t> want(kRec, 0);
  for (int i = 0; i < 128; ++i) want[i] = 0x70;
  want[0] = 0x7C;
  want[1] = 0x70;
  want[2] = 0x71;
  want[129] = 0x80;
  for (int i = 256; i < 384; ++i) want[i] = 0x7F;
  want[384] = 0x7F;
  want[385] = 0x80;
  want[386] = 0x7F;
  const uint32_t scales[4] = {0x3C000000u, 0x39000000u, 0x7FFFFFFFu,
                              0x7F800000u};
  memcpy(want.data() + 512, scales, 16);
  memcpy(want.data() + 528, x.data() + 512, 128);
  EXPECT_EQ(rec, want);

  // Load: q * s rounded to BF16; NaN codes, NaN scales and 0 x Inf give the
  // canonical 0x7FC0; the tail comes back bit for bit.
  const std::vector<uint16_t> out = Decode(rec);
  EXPECT_EQ(out[0], 0x4040);  // 384 * 2^-7 = 3
  EXPECT_EQ(out[1], 0x3F80);  // the tie went down: 1.0
  EXPECT_EQ(out[2], 0x3F90);  // 144 * 2^-7 = 1.125
  EXPECT_EQ(out[3], 0x3F80);
  EXPECT_EQ(out[128], 0x0000);
  EXPECT_EQ(out[129], 0x8000);
  for (int i = 256; i < 512; ++i) ASSERT_EQ(out[i], 0x7FC0) << i;
  for (int i = 512; i < 576; ++i) ASSERT_EQ(out[i], x[i]) << i;
}

// Token B: the power-of-two edges. tile 0: amax 3.5 (0x4060) = 448 * 2^-7,
// so amax / 448 is exactly 2^-7: s = 2^-7 (0x3C000000), 3.5 -> 448 = 0x7E.
// tile 1: amax 448 (0x43E0): s = 1 (0x3F800000), -448 -> 0xFE, 0.001953125
// = 2^-9 (0x3B00) -> the smallest subnormal 0x01. tile 2: amax 1e-30
// (bf16 0x0DA2 ~ 1.0e-30): amax / 448 < 1e-4 -> s = 2^-13; x / s ~ 8e-27
// -> 0x00. tile 3: amax 2^100 (0x7180): 2^100 / 448 = 2^91.19.. -> s =
// 2^92 (bits 219 << 23 = 0x6D800000); 2^100 / 2^92 = 256 = 2^8 -> 0x78.
TEST(DsMlaGoldenTest, PowerOfTwoEdgesByHand) {
  std::vector<uint16_t> x(576, 0);
  x[0] = 0x4060;
  x[128] = 0xC3E0;
  x[129] = 0x43E0;
  x[130] = 0x3B00;
  x[256] = 0x0DA2;
  x[384] = 0x7180;
  const std::vector<uint8_t> rec = Encode(x);
  EXPECT_EQ(ScaleBits(rec, 0), 0x3C000000u);
  EXPECT_EQ(ScaleBits(rec, 1), 0x3F800000u);
  EXPECT_EQ(ScaleBits(rec, 2), 0x39000000u);
  EXPECT_EQ(ScaleBits(rec, 3), 0x6D800000u);
  EXPECT_EQ(rec[0], 0x7E);
  EXPECT_EQ(rec[128], 0xFE);
  EXPECT_EQ(rec[129], 0x7E);
  EXPECT_EQ(rec[130], 0x01);
  EXPECT_EQ(rec[256], 0x00);
  EXPECT_EQ(rec[384], 0x78);
  const std::vector<uint16_t> out = Decode(rec);
  EXPECT_EQ(out[0], 0x4060);
  EXPECT_EQ(out[128], 0xC3E0);
  EXPECT_EQ(out[130], 0x3B00);
  EXPECT_EQ(out[384], 0x7180);
}

// Store into pools of awkward block sizes with -1 slots, then load every
// block: each record equals EncodeTokenBf16 of its token, each loaded row
// DecodeTokenBf16 of the record, and -1 slots leave the pool untouched.
TEST(DsMlaStoreLoadTest, RoundTripBlockSizes) {
  for (int64_t bs : {1, 7, 64, 133}) {
    const PoolLayout l = *MakePoolLayout(kF, bs, 3, 1);
    const int64_t n = l.num_slots() + 2;
    std::mt19937 rng(301 + static_cast<int>(bs));
    std::normal_distribution<float> normal(0.0f, 4.0f);
    std::vector<uint16_t> kv(n * 576);
    for (auto& h : kv) h = FloatToBf16(normal(rng));
    kv[5] = 0x7F80;  // an Inf tile in token 0
    bool nonzero = false;
    for (uint16_t h : kv) nonzero |= (h & 0x7FFF) != 0;
    ASSERT_TRUE(nonzero);
    std::vector<int32_t> slots(n);
    for (int64_t i = 0; i < n; ++i) {
      slots[i] = i < 2 ? -1 : static_cast<int32_t>(l.num_slots() - 1 - (i - 2));
    }
    std::vector<uint8_t> pool(l.layer_bytes, 0x5A);
    ASSERT_TRUE(
        Store(l, pool.data(), kv.data(), InputDtype::kBF16, slots).ok());
    for (int64_t i = 0; i < n; ++i) {
      if (slots[i] < 0) continue;
      std::vector<uint8_t> want(kRec);
      EncodeTokenBf16(kF, reinterpret_cast<const uint8_t*>(&kv[i * 576]),
                      want.data(), want.data() + 512);
      ASSERT_EQ(0, memcmp(pool.data() + l.slot_data_offset(slots[i]),
                          want.data(), kRec))
          << "bs " << bs << " token " << i;
    }
    std::vector<int32_t> segs;
    for (int32_t b = 0; b < 3; ++b) {
      segs.insert(segs.end(), {b, 0, static_cast<int32_t>(bs),
                               static_cast<int32_t>(b * bs)});
    }
    segs.insert(segs.end(), {-1, 0, 1, static_cast<int32_t>(3 * bs)});
    std::vector<uint16_t> out((3 * bs + 1) * 576, 0xAAAA);
    ASSERT_TRUE(
        LoadSegments(l, pool.data(), segs, 3 * bs + 1, out.data(), nullptr)
            .ok());
    for (int64_t i = 2; i < n; ++i) {
      const int32_t s = slots[i];
      std::vector<uint16_t> want(576);
      DecodeTokenBf16(kF, pool.data() + l.slot_data_offset(s),
                      pool.data() + l.slot_scale_offset(s),
                      reinterpret_cast<uint8_t*>(want.data()));
      ASSERT_EQ(0, memcmp(&out[s * 576], want.data(), 1152)) << i;
      // The tail is the input's.
      ASSERT_EQ(0, memcmp(&out[s * 576 + 512], &kv[i * 576 + 512], 128));
    }
    for (int i = 0; i < 576; ++i) ASSERT_EQ(out[3 * bs * 576 + i], 0);
  }
}

TEST(DsMlaStoreLoadTest, Fp32InputRejectedBeforeWriting) {
  const PoolLayout l = *MakePoolLayout(kF, 7, 1, 1);
  std::vector<float> kv(576, 1.0f);
  std::vector<uint8_t> pool(l.layer_bytes, 0x5A);
  const std::vector<int32_t> slots = {3};
  const absl::Status s =
      Store(l, pool.data(), kv.data(), InputDtype::kFP32, slots);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("BF16 input only"));
  for (uint8_t b : pool) ASSERT_EQ(b, 0x5A);
}

}  // namespace
}  // namespace kvdepot
