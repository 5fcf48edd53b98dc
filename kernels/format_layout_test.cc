// Pool layout invariants of SPEC §2 for every format and awkward block
// sizes, checked for every byte of every token, plus 64-bit offsets and the
// rejections of MakePoolLayout.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "kernels/format_host.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

const char* const kFormats[] = {
    "V41",         "V41_FP4",   "FP4_INDEX", "FP8_FP32SF_INDEX",
    "MXFP8_INDEX", "BF16(512)", "BF16(2)",   "BF16(6)"};

TEST(FormatLayoutTest, TokensNeverOverlapAndStayInTheirBlock) {
  for (const char* name : kFormats) {
    const KVCacheFormat f = *FormatFromName(name);
    for (int64_t bs : {1, 3, 7, 17, 64, 133}) {
      SCOPED_TRACE(absl::StrCat(name, " block_size ", bs));
      constexpr int64_t kBlocks = 3;
      absl::StatusOr<PoolLayout> l = MakePoolLayout(f, bs, kBlocks, 2);
      ASSERT_TRUE(l.ok()) << l.status();
      const int64_t align = f.block_alignment();
      EXPECT_EQ(align, f.token_interleaved ? Lcm(32, f.bytes_per_token()) : 32);
      EXPECT_EQ(l->block_stride % align, 0);
      EXPECT_GE(l->block_stride, bs * f.bytes_per_token());
      EXPECT_LT(l->block_stride, bs * f.bytes_per_token() + align);
      EXPECT_EQ(l->layer_bytes, kBlocks * l->block_stride);
      EXPECT_EQ(l->layer_stride % kLayerAlignment, 0);
      EXPECT_EQ(l->layer_offset(1) % kLayerAlignment, 0);
      EXPECT_GE(l->layer_stride, l->layer_bytes);
      EXPECT_EQ(l->total_bytes, 2 * l->layer_stride);
      // Owner of every byte of the layer; -1 = padding.
      std::vector<int64_t> owner(l->layer_bytes, -1);
      for (int64_t s = 0; s < l->num_slots(); ++s) {
        const int64_t b = s / bs, t = s % bs;
        ASSERT_EQ(l->slot_data_offset(s), l->data_offset(b, t));
        ASSERT_EQ(l->slot_scale_offset(s), l->scale_offset(b, t));
        ASSERT_EQ(l->data_offset(b, t) % f.token_stride_alignment(), 0);
        if (f.token_interleaved) {
          ASSERT_EQ(l->data_offset(b, t),
                    b * l->block_stride + t * f.bytes_per_token());
          ASSERT_EQ(l->scale_offset(b, t),
                    l->data_offset(b, t) + f.data_bytes());
        } else {
          ASSERT_EQ(l->data_offset(b, t),
                    b * l->block_stride + t * f.data_bytes());
          ASSERT_EQ(
              l->scale_offset(b, t),
              b * l->block_stride + bs * f.data_bytes() + t * f.sf_bytes());
        }
        const int64_t ranges[2][2] = {{l->data_offset(b, t), f.data_bytes()},
                                      {l->scale_offset(b, t), f.sf_bytes()}};
        for (const auto& r : ranges) {
          for (int64_t i = r[0]; i < r[0] + r[1]; ++i) {
            ASSERT_GE(i, b * l->block_stride) << "slot " << s;
            ASSERT_LT(i, (b + 1) * l->block_stride) << "slot " << s;
            ASSERT_EQ(owner[i], -1) << "byte " << i << " of slot " << s
                                    << " also belongs to slot " << owner[i];
            owner[i] = s;
          }
        }
      }
      int64_t used = 0;
      for (int64_t o : owner) used += o >= 0;
      EXPECT_EQ(used, l->num_slots() * f.bytes_per_token());
    }
  }
}

TEST(FormatLayoutTest, TokenStrideAlignment) {
  EXPECT_EQ(FormatFromName("V41")->token_stride_alignment(), 16);      // 528
  EXPECT_EQ(FormatFromName("V41_FP4")->token_stride_alignment(), 32);  // 288
  EXPECT_EQ(FormatFromName("FP4_INDEX")->token_stride_alignment(), 32);
  EXPECT_EQ(FormatFromName("MXFP8_INDEX")->token_stride_alignment(), 32);
  EXPECT_EQ(FormatFromName("BF16(512)")->token_stride_alignment(), 32);
  EXPECT_EQ(FormatFromName("BF16(6)")->token_stride_alignment(), 4);  // 12 B
  EXPECT_EQ(FormatFromName("V41")->block_alignment(), 1056);
  EXPECT_EQ(FormatFromName("V41_FP4")->block_alignment(), 288);
}

TEST(FormatLayoutTest, BlockStridesOfDocsFormatsMd) {
  struct Row {
    const char* name;
    int64_t bs64, bs133;
  };
  for (const Row& r :
       {Row{"V41", 33792, 70752}, Row{"V41_FP4", 18432, 38304},
        Row{"FP4_INDEX", 4352, 9056}, Row{"FP8_FP32SF_INDEX", 8448, 17568},
        Row{"MXFP8_INDEX", 8448, 17568}, Row{"BF16(512)", 65536, 136192}}) {
    const KVCacheFormat f = *FormatFromName(r.name);
    EXPECT_EQ(MakePoolLayout(f, 64, 1, 1)->block_stride, r.bs64) << r.name;
    EXPECT_EQ(MakePoolLayout(f, 133, 1, 1)->block_stride, r.bs133) << r.name;
  }
}

TEST(FormatLayoutTest, OffsetsBeyondFourGiB) {
  // V41, block_size 64: block_stride = 64 * 528 = 33792 (a multiple of
  // 1056). 200000 blocks: layer_bytes = 6,758,400,000 (> 4 GiB), already a
  // multiple of 256; layer 3 starts at 20,275,200,000.
  absl::StatusOr<PoolLayout> l =
      MakePoolLayout(*FormatFromName("V41"), 64, 200000, 4);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->block_stride, 33792);
  EXPECT_EQ(l->layer_bytes, int64_t{6758400000});
  EXPECT_EQ(l->layer_stride, int64_t{6758400000});
  EXPECT_EQ(l->layer_offset(3), int64_t{20275200000});
  EXPECT_EQ(l->total_bytes, int64_t{27033600000});
  // Last slot of the layer: block 199999 (at 199999 * 33792 =
  // 6,758,366,208), token 63 (+ 63 * 528 = 33,264), scales after 512 bytes.
  const int64_t last = l->num_slots() - 1;
  EXPECT_EQ(l->slot_data_offset(last), int64_t{6758399472});
  EXPECT_EQ(l->slot_scale_offset(last), int64_t{6758399984});
  EXPECT_EQ(l->slot_scale_offset(last) + 16, l->layer_bytes);
  // Block-split: FP4_INDEX block_size 133: stride round_up(9044, 32) = 9056;
  // 500000 blocks = 4,528,000,000 B, rounded up to 256: 4,528,000,000.
  l = MakePoolLayout(*FormatFromName("FP4_INDEX"), 133, 500000, 2);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->block_stride, 9056);
  EXPECT_EQ(l->layer_stride, int64_t{4528000000});
  EXPECT_EQ(l->scale_offset(499999, 132),
            int64_t{499999} * 9056 + 133 * 64 + 132 * 4);
}

TEST(FormatLayoutTest, MakePoolLayoutRejections) {
  const KVCacheFormat v41 = *FormatFromName("V41");
  struct Bad {
    int64_t bs, blocks, layers;
    const char* words;
  };
  for (const Bad& b : {Bad{0, 1, 1, "block_size"}, Bad{-3, 1, 1, "got -3"},
                       Bad{1, 0, 1, "num_blocks"}, Bad{1, 1, 0, "num_layers"},
                       Bad{1, -1, 1, "got 1, -1, 1"},
                       Bad{int64_t{1} << 31, 1, 1, "int32 slot range"},
                       Bad{65536, 65536, 1, "int32 slot range"},
                       Bad{64, 30000000, 2000, "exceeds"}}) {
    absl::StatusOr<PoolLayout> l =
        MakePoolLayout(v41, b.bs, b.blocks, b.layers);
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument) << b.words;
    EXPECT_THAT(std::string(l.status().message()), HasSubstr(b.words));
  }
  const KVCacheFormat broken{QuantDtype::kE4M3,   100, 32, 0, true,
                             ScaleFormat::kUE8M0, true};
  EXPECT_THAT(std::string(MakePoolLayout(broken, 1, 1, 1).status().message()),
              HasSubstr("does not divide"));
  EXPECT_THAT(DescribeLayout(*MakePoolLayout(v41, 3, 2, 1)),
              HasSubstr("block_stride        2112"));
}

}  // namespace
}  // namespace kvdepot
