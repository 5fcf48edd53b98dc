// Every argument rule of kvdepot_kernels.h refused: the return code, a
// message naming the argument (and index), and nothing written. The CUDA
// entry points' host-side checks run here too (they refuse before any CUDA
// call, so no GPU is needed); a build without CUDA answers
// KVDK_ERR_UNSUPPORTED instead.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "libkvdepot/capi_test_util.h"
#include "libkvdepot/kvdepot_kernels.h"

namespace kvdepot {
namespace {

using capi_test::LayoutPtr;
using capi_test::MakeLayout;

// The call failed with `code` and the message contains `what`.
#define EXPECT_REFUSED(call, code, what)                                    \
  do {                                                                      \
    EXPECT_EQ((call), (code)) << #call;                                     \
    EXPECT_NE(std::string(kvdk_last_error()).find(what), std::string::npos) \
        << "message: " << kvdk_last_error();                                \
  } while (false)

TEST(CapiRejectTest, LayoutCreate) {
  kvdk_layout* l = reinterpret_cast<kvdk_layout*>(0x1);
  EXPECT_REFUSED(kvdk_layout_create("V41", 0, 7, 3, 1, nullptr),
                 KVDK_ERR_INVALID, "out is null");
  EXPECT_REFUSED(kvdk_layout_create(nullptr, 0, 7, 3, 1, &l), KVDK_ERR_INVALID,
                 "format_name is null");
  EXPECT_EQ(l, nullptr);
  EXPECT_REFUSED(kvdk_layout_create("V42", 0, 7, 3, 1, &l), KVDK_ERR_INVALID,
                 "V42");
  EXPECT_REFUSED(kvdk_layout_create("BF16", 0, 7, 3, 1, &l), KVDK_ERR_INVALID,
                 "bf16_elements = 0");
  EXPECT_REFUSED(kvdk_layout_create("BF16", 7, 7, 3, 1, &l), KVDK_ERR_INVALID,
                 "");  // odd element count
  EXPECT_REFUSED(kvdk_layout_create("V41", 64, 7, 3, 1, &l), KVDK_ERR_INVALID,
                 "bf16_elements = 64");
  EXPECT_REFUSED(kvdk_layout_create("BF16(8)", 6, 7, 3, 1, &l),
                 KVDK_ERR_INVALID, "does not match");
  EXPECT_REFUSED(kvdk_layout_create("V41", 0, 0, 3, 1, &l), KVDK_ERR_INVALID,
                 "block_size");
  EXPECT_REFUSED(kvdk_layout_create("V41", 0, 7, -1, 1, &l), KVDK_ERR_INVALID,
                 "num_blocks");
  EXPECT_REFUSED(kvdk_layout_create("V41", 0, 7, 3, 0, &l), KVDK_ERR_INVALID,
                 "num_layers");
  EXPECT_REFUSED(
      kvdk_layout_create("V41", 0, int64_t{1} << 40, int64_t{1} << 40, 1, &l),
      KVDK_ERR_INVALID, "");  // overflow
  EXPECT_EQ(l, nullptr);
  ASSERT_EQ(kvdk_layout_create("BF16", 8, 7, 3, 1, &l), KVDK_OK);
  kvdk_layout_destroy(l);
  kvdk_layout_destroy(nullptr);  // fine
}

TEST(CapiRejectTest, LayoutCreateDesc) {
  kvdk_layout* l = nullptr;
  EXPECT_REFUSED(kvdk_layout_create_desc(nullptr, 7, 3, 1, &l),
                 KVDK_ERR_INVALID, "desc is null");
  kvdk_format_desc v41{KVDK_QUANT_E4M3,   512, 32, 0, 1, KVDK_SF_UE8M0, 1,
                       KVDK_ROUNDING_NONE};
  ASSERT_EQ(kvdk_layout_create_desc(&v41, 7, 3, 1, &l), KVDK_OK)
      << kvdk_last_error();
  char name[8];
  EXPECT_EQ(kvdk_layout_format_name(l, name, sizeof(name)), KVDK_OK);
  EXPECT_STREQ(name, "V41");
  EXPECT_REFUSED(kvdk_layout_format_name(l, name, 3), KVDK_ERR_CAPACITY,
                 "capacity = 3");
  EXPECT_REFUSED(kvdk_layout_format_name(l, nullptr, 8), KVDK_ERR_INVALID,
                 "buf is null");
  kvdk_layout_info info;
  EXPECT_REFUSED(kvdk_layout_get_info(l, &info, KVDK_LAYOUT_INFO_V1_BYTES - 8),
                 KVDK_ERR_INVALID, "info_size");
  EXPECT_REFUSED(kvdk_layout_get_info(l, nullptr, sizeof(info)),
                 KVDK_ERR_INVALID, "info is null");
  EXPECT_REFUSED(kvdk_layout_get_info(nullptr, &info, sizeof(info)),
                 KVDK_ERR_INVALID, "layout is null");
  kvdk_layout_destroy(l);
  l = nullptr;
  kvdk_format_desc d = v41;
  d.quantized_dtype = 7;
  EXPECT_REFUSED(kvdk_layout_create_desc(&d, 7, 3, 1, &l), KVDK_ERR_INVALID,
                 "desc.quantized_dtype = 7");
  d = v41;
  d.sf_format = -1;
  EXPECT_REFUSED(kvdk_layout_create_desc(&d, 7, 3, 1, &l), KVDK_ERR_INVALID,
                 "desc.sf_format = -1");
  d = v41;
  d.scale_rounding = 2;
  EXPECT_REFUSED(kvdk_layout_create_desc(&d, 7, 3, 1, &l), KVDK_ERR_INVALID,
                 "desc.scale_rounding = 2");
  d = v41;
  d.do_cast = 2;
  EXPECT_REFUSED(kvdk_layout_create_desc(&d, 7, 3, 1, &l), KVDK_ERR_INVALID,
                 "desc.do_cast = 2");
  d = v41;
  d.elements_per_sf = 30;  // does not divide 512
  EXPECT_REFUSED(kvdk_layout_create_desc(&d, 7, 3, 1, &l), KVDK_ERR_INVALID,
                 "");
  d = v41;
  d.do_cast = 1;
  d.token_interleaved = 0;  // do_cast needs interleaved
  EXPECT_REFUSED(kvdk_layout_create_desc(&d, 7, 3, 1, &l), KVDK_ERR_INVALID,
                 "");
  d = v41;
  d.sf_format = KVDK_SF_E4M3;  // valid fields, no SPEC §3 math
  EXPECT_REFUSED(kvdk_layout_create_desc(&d, 7, 3, 1, &l), KVDK_ERR_UNSUPPORTED,
                 "");
  EXPECT_EQ(l, nullptr);
}

class CapiRejectDataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    layout_ = MakeLayout("MXFP8_INDEX", 7, 5, 2);  // 35 slots, 2 layers
    ASSERT_NE(layout_, nullptr) << kvdk_last_error();
    info_ = capi_test::Info(layout_.get());
    pool_.assign(info_.total_bytes, 0x77);
    std::mt19937 rng(310);
    kv_ = capi_test::RandomBf16(rng, kN, info_.elements);
    slots_ = {0, 5, -1, 34};
  }

  // The pool is unchanged by the refused call.
  void ExpectUntouched() {
    EXPECT_TRUE(capi_test::SameBytes(
        pool_, std::vector<uint8_t>(info_.total_bytes, 0x77)));
  }

  int Store(const std::vector<int32_t>& slots, int64_t layer = 1) {
    return kvdk_store_cpu(layout_.get(), pool_.data(), pool_.size(), layer,
                          kv_.data(), KVDK_DTYPE_BF16, slots.data(),
                          static_cast<int64_t>(slots.size()));
  }

  static constexpr int64_t kN = 4;
  LayoutPtr layout_;
  kvdk_layout_info info_;
  std::vector<uint8_t> pool_;
  std::vector<uint16_t> kv_;
  std::vector<int32_t> slots_;
};

TEST_F(CapiRejectDataTest, Store) {
  const kvdk_layout* l = layout_.get();
  uint8_t* p = pool_.data();
  const int64_t pb = pool_.size();
  EXPECT_REFUSED(
      kvdk_store_cpu(nullptr, p, pb, 0, kv_.data(), 0, slots_.data(), kN),
      KVDK_ERR_INVALID, "layout is null");
  EXPECT_REFUSED(
      kvdk_store_cpu(l, nullptr, pb, 0, kv_.data(), 0, slots_.data(), kN),
      KVDK_ERR_INVALID, "pool is null");
  EXPECT_REFUSED(Store(slots_, -1), KVDK_ERR_INVALID, "layer = -1");
  EXPECT_REFUSED(Store(slots_, 2), KVDK_ERR_INVALID, "layer = 2");
  EXPECT_REFUSED(kvdk_store_cpu(l, p, info_.layer_stride + 10, 1, kv_.data(), 0,
                                slots_.data(), kN),
                 KVDK_ERR_INVALID, "pool_bytes");
  EXPECT_REFUSED(kvdk_store_cpu(l, p, pb, 1, kv_.data(), 2, slots_.data(), kN),
                 KVDK_ERR_INVALID, "dtype = 2");
  EXPECT_REFUSED(kvdk_store_cpu(l, p, pb, 1, kv_.data(), 0, slots_.data(), -1),
                 KVDK_ERR_INVALID, "num_tokens = -1");
  EXPECT_REFUSED(kvdk_store_cpu(l, p, pb, 1, nullptr, 0, slots_.data(), kN),
                 KVDK_ERR_INVALID, "kv is null");
  EXPECT_REFUSED(kvdk_store_cpu(l, p, pb, 1, kv_.data(), 0, nullptr, kN),
                 KVDK_ERR_INVALID, "slot_mapping is null");
  EXPECT_REFUSED(Store({0, 5, -1, 35}), KVDK_ERR_INVALID,
                 "slot_mapping[3] = 35 is outside [-1, 35)");
  EXPECT_REFUSED(Store({0, -2, -1, 3}), KVDK_ERR_INVALID, "slot_mapping[1]");
  EXPECT_REFUSED(Store({4, 5, -1, 4}), KVDK_ERR_INVALID, "slot_mapping[3]");
  ExpectUntouched();
  // Layer 0 of a per-layer buffer: pool_bytes = layer_bytes is enough.
  EXPECT_EQ(kvdk_store_cpu(l, p, info_.layer_bytes, 0, kv_.data(), 0,
                           slots_.data(), kN),
            KVDK_OK)
      << kvdk_last_error();
  EXPECT_EQ(kvdk_store_cpu(l, nullptr, 0, 0, nullptr, 0, nullptr, 0),
            KVDK_ERR_INVALID);  // pool is still required
  EXPECT_EQ(kvdk_store_cpu(l, p, pb, 0, nullptr, 0, nullptr, 0), KVDK_OK);
  EXPECT_STREQ(kvdk_last_error(), "");
}

TEST_F(CapiRejectDataTest, Fp32IntoABf16OnlyFormat) {
  LayoutPtr mla = MakeLayout("DS_MLA_FP8", 1, 4, 1);
  ASSERT_NE(mla, nullptr);
  std::vector<uint8_t> pool(capi_test::Info(mla.get()).total_bytes, 0);
  std::vector<float> kv(576, 1.0f);
  const int32_t slot = 0;
  EXPECT_REFUSED(kvdk_store_cpu(mla.get(), pool.data(), pool.size(), 0,
                                kv.data(), KVDK_DTYPE_FP32, &slot, 1),
                 KVDK_ERR_INVALID, "DS_MLA_FP8");
}

TEST_F(CapiRejectDataTest, Load) {
  const kvdk_layout* l = layout_.get();
  const int64_t total = 6;
  std::vector<uint8_t> data(total * info_.load_data_row_bytes, 0xEE);
  std::vector<uint8_t> scales(total * info_.load_scale_row_bytes, 0xEE);
  const std::vector<uint8_t> data0 = data, scales0 = scales;
  auto load = [&](std::vector<int32_t> seg, int64_t total_k = 6) {
    return kvdk_load_cpu(l, pool_.data(), pool_.size(), 1, seg.data(),
                         static_cast<int64_t>(seg.size()) / 4, total_k,
                         data.data(), data.size(), scales.data(),
                         scales.size());
  };
  // SPEC §5, one rule at a time.
  EXPECT_REFUSED(load({5, 0, 1, 0}), KVDK_ERR_INVALID, "segments[0]");
  EXPECT_REFUSED(load({-2, 0, 1, 0}), KVDK_ERR_INVALID, "segments[0]");
  EXPECT_REFUSED(load({1, -1, 1, 0}), KVDK_ERR_INVALID, "segments[0]");
  EXPECT_REFUSED(load({1, 3, 2, 0}), KVDK_ERR_INVALID, "segments[0]");
  EXPECT_REFUSED(load({1, 0, 8, 0}), KVDK_ERR_INVALID, "segments[0]");
  EXPECT_REFUSED(load({1, 0, 1, 0, 1, 0, 1, -1}), KVDK_ERR_INVALID,
                 "segments[1]");
  EXPECT_REFUSED(load({1, 0, 1, 0, 1, 0, 2, 5}), KVDK_ERR_INVALID,
                 "segments[1]");
  EXPECT_REFUSED(load({1, 0, 3, 0, 2, 0, 3, 2}), KVDK_ERR_INVALID, "overlap");
  EXPECT_REFUSED(load({1, 0, 1, 0}, -1), KVDK_ERR_INVALID, "total_k = -1");
  EXPECT_REFUSED(load({1, 0, 1, 0}, 7), KVDK_ERR_INVALID, "data_bytes");
  EXPECT_REFUSED(
      kvdk_load_cpu(l, pool_.data(), pool_.size(), 1, nullptr, 1, total,
                    data.data(), data.size(), scales.data(), scales.size()),
      KVDK_ERR_INVALID, "segments is null");
  const int32_t seg[4] = {1, 0, 1, 0};
  EXPECT_REFUSED(
      kvdk_load_cpu(l, pool_.data(), pool_.size(), 1, seg, -1, total,
                    data.data(), data.size(), scales.data(), scales.size()),
      KVDK_ERR_INVALID, "num_segments = -1");
  EXPECT_REFUSED(kvdk_load_cpu(l, pool_.data(), pool_.size(), 1, seg, 1, total,
                               data.data(), data.size(), nullptr, 0),
                 KVDK_ERR_INVALID, "scales is null");
  EXPECT_REFUSED(kvdk_load_cpu(l, pool_.data(), pool_.size(), 1, seg, 1, total,
                               nullptr, 0, scales.data(), scales.size()),
                 KVDK_ERR_INVALID, "data is null");
  EXPECT_REFUSED(
      kvdk_load_cpu(l, pool_.data(), pool_.size(), 2, seg, 1, total,
                    data.data(), data.size(), scales.data(), scales.size()),
      KVDK_ERR_INVALID, "layer = 2");
  EXPECT_EQ(data, data0);
  EXPECT_EQ(scales, scales0);
  EXPECT_EQ(load({1, 0, 3, 0, -1, 0, 3, 3}), KVDK_OK) << kvdk_last_error();
}

TEST_F(CapiRejectDataTest, FusedStore) {
  const kvdk_layout* l = layout_.get();  // 128 elements
  std::mt19937 rng(311);
  capi_test::FusedInputs in = capi_test::RandomFused(rng, 128, kN);
  auto fused = [&](const kvdk_fused_params* p) {
    return kvdk_fused_store_cpu(l, pool_.data(), pool_.size(), 1, kv_.data(), p,
                                slots_.data(), kN, nullptr);
  };
  EXPECT_REFUSED(fused(nullptr), KVDK_ERR_INVALID, "params is null");
  kvdk_fused_params p = in.params;
  p.rope_style = 3;
  EXPECT_REFUSED(fused(&p), KVDK_ERR_INVALID, "rope_style = 3");
  p = in.params;
  p.positions = nullptr;
  EXPECT_REFUSED(fused(&p), KVDK_ERR_INVALID, "positions is null");
  p = in.params;
  in.positions[2] = p.max_position;
  EXPECT_REFUSED(fused(&p), KVDK_ERR_INVALID, "positions[2]");
  in.positions[2] = -1;
  EXPECT_REFUSED(fused(&p), KVDK_ERR_INVALID, "positions[2]");
  in.positions[2] = 0;
  p.hadamard_len = 100;
  EXPECT_REFUSED(fused(&p), KVDK_ERR_INVALID, "hadamard_len = 100");
  p = in.params;
  p.hadamard_begin = 100;  // [100, 164) leaves the token
  EXPECT_REFUSED(fused(&p), KVDK_ERR_INVALID, "");
  p = in.params;
  p.norm_end = 60;
  EXPECT_REFUSED(fused(&p), KVDK_ERR_INVALID, "multiples of 8");
  p = in.params;
  p.norm_end = -8;
  EXPECT_REFUSED(fused(&p), KVDK_ERR_INVALID, "norm_end = -8");
  p = in.params;  // ends whose int32 difference overflows (step_fuzz)
  p.norm_begin = std::numeric_limits<int32_t>::min();
  p.norm_end = std::numeric_limits<int32_t>::max();
  EXPECT_REFUSED(fused(&p), KVDK_ERR_INVALID,
                 "norm range [-2147483648, 2147483647) is not inside");
  p = in.params;
  p.norm_weight = nullptr;
  EXPECT_REFUSED(fused(&p), KVDK_ERR_INVALID, "norm_weight");
  p = in.params;
  p.eps = std::nanf("");
  EXPECT_REFUSED(fused(&p), KVDK_ERR_INVALID, "eps");
  p = in.params;
  p.rope_dim = 63;
  EXPECT_REFUSED(fused(&p), KVDK_ERR_INVALID, "rope_dim = 63");
  p = in.params;
  p.cos_sin = nullptr;
  EXPECT_REFUSED(fused(&p), KVDK_ERR_INVALID, "cos_sin");
  std::vector<int32_t> dup = {3, 3, -1, -1};
  EXPECT_REFUSED(
      kvdk_fused_store_cpu(l, pool_.data(), pool_.size(), 1, kv_.data(),
                           &in.params, dup.data(), kN, nullptr),
      KVDK_ERR_INVALID, "slot_mapping[1]");
  ExpectUntouched();
  EXPECT_EQ(fused(&in.params), KVDK_OK) << kvdk_last_error();
}

TEST(CapiRejectTest, Plans) {
  LayoutPtr l = MakeLayout("FP4_INDEX", 16, 8, 1);
  ASSERT_NE(l, nullptr);
  const int32_t seqlen[2] = {100, 10};
  int32_t table[4] = {0, 1, 2, 3};
  int32_t seg[64];
  int64_t num = 0, total = 0;
  EXPECT_REFUSED(kvdk_build_compressed_plan(l.get(), 0, seqlen, 2, table, 2,
                                            seg, 16, &num, &total, nullptr),
                 KVDK_ERR_INVALID, "ratio = 0");
  EXPECT_REFUSED(kvdk_build_compressed_plan(nullptr, 4, seqlen, 2, table, 2,
                                            seg, 16, &num, &total, nullptr),
                 KVDK_ERR_INVALID, "layout is null");
  EXPECT_REFUSED(kvdk_build_compressed_plan(l.get(), 4, seqlen, 2, table, 2,
                                            seg, 16, nullptr, &total, nullptr),
                 KVDK_ERR_INVALID, "num_segments is null");
  EXPECT_REFUSED(kvdk_build_compressed_plan(l.get(), 4, nullptr, 2, table, 2,
                                            seg, 16, &num, &total, nullptr),
                 KVDK_ERR_INVALID, "seqlen_k is null");
  EXPECT_REFUSED(kvdk_build_compressed_plan(l.get(), 4, seqlen, -1, table, 2,
                                            seg, 16, &num, &total, nullptr),
                 KVDK_ERR_INVALID, "num_seqs = -1");
  EXPECT_REFUSED(kvdk_build_compressed_plan(l.get(), 4, seqlen, 2, table, 2,
                                            nullptr, 16, &num, &total, nullptr),
                 KVDK_ERR_INVALID, "segments is null");
  table[1] = 8;  // outside [0, 8)
  EXPECT_REFUSED(kvdk_build_compressed_plan(l.get(), 4, seqlen, 2, table, 2,
                                            seg, 16, &num, &total, nullptr),
                 KVDK_ERR_INVALID, "8");
  table[1] = 1;
  const int32_t long_seq[2] = {4 * 16 * 2 + 4, 0};  // past the 2-entry row
  EXPECT_REFUSED(kvdk_build_compressed_plan(l.get(), 4, long_seq, 2, table, 2,
                                            seg, 16, &num, &total, nullptr),
                 KVDK_ERR_INVALID, "");
  const int32_t neg[2] = {-1, 0};
  EXPECT_REFUSED(kvdk_build_compressed_plan(l.get(), 4, neg, 2, table, 2, seg,
                                            16, &num, &total, nullptr),
                 KVDK_ERR_INVALID, "seqlen_k");
  EXPECT_EQ(kvdk_build_compressed_plan(l.get(), 4, seqlen, 2, table, 2, seg, 16,
                                       &num, &total, nullptr),
            KVDK_OK)
      << kvdk_last_error();
  EXPECT_EQ(total, 25 + 2);
  EXPECT_REFUSED(kvdk_build_compressed_plan(l.get(), 4, seqlen, 2, table, 2,
                                            seg, 1, &num, &total, nullptr),
                 KVDK_ERR_CAPACITY, "max_segments = 1");
  EXPECT_EQ(num, 3);

  LayoutPtr ring = MakeLayout("V41", 64, 4, 1);
  ASSERT_NE(ring, nullptr);
  const int32_t q[2] = {1, 1}, states[2] = {0, 4};
  EXPECT_REFUSED(kvdk_build_swa_plan(ring.get(), 32, seqlen, q, states, nullptr,
                                     2, seg, 16, &num, &total),
                 KVDK_ERR_INVALID, "state_ids[1] = 4");
  const int32_t ok_states[2] = {0, 3};
  EXPECT_REFUSED(kvdk_build_swa_plan(ring.get(), 65, seqlen, q, ok_states,
                                     nullptr, 2, seg, 16, &num, &total),
                 KVDK_ERR_INVALID, "65");
  EXPECT_REFUSED(kvdk_build_swa_plan(ring.get(), 0, seqlen, q, ok_states,
                                     nullptr, 2, seg, 16, &num, &total),
                 KVDK_ERR_INVALID, "");
  const int32_t big_q[2] = {101, 1};
  EXPECT_REFUSED(kvdk_build_swa_plan(ring.get(), 32, seqlen, big_q, ok_states,
                                     nullptr, 2, seg, 16, &num, &total),
                 KVDK_ERR_INVALID, "seqlen_q");
  EXPECT_REFUSED(kvdk_build_swa_plan(ring.get(), 32, seqlen, nullptr, ok_states,
                                     nullptr, 2, seg, 16, &num, &total),
                 KVDK_ERR_INVALID, "seqlen_q is null");
  EXPECT_EQ(kvdk_build_swa_plan(ring.get(), 32, seqlen, q, ok_states, nullptr,
                                2, seg, 16, &num, &total),
            KVDK_OK)
      << kvdk_last_error();
  EXPECT_EQ(total, 64);
}

TEST(CapiRejectTest, IndexOps) {
  LayoutPtr l = MakeLayout("FP4_INDEX", 16, 8, 1);
  ASSERT_NE(l, nullptr);
  int32_t topk[4] = {1, 2, 3, 4};
  const int32_t valid[2] = {2, 2}, ntok[2] = {32, 32}, table[4] = {0, 1, 2, 3};
  int64_t invalid = 0;
  EXPECT_REFUSED(kvdk_convert_topk_cpu(l.get(), topk, 2, 2, valid, ntok, table,
                                       2, 1, &invalid),
                 KVDK_ERR_INVALID, "row_stride = 1");
  const int32_t too_many[2] = {3, 2};
  EXPECT_REFUSED(kvdk_convert_topk_cpu(l.get(), topk, 2, 2, too_many, ntok,
                                       table, 2, 2, &invalid),
                 KVDK_ERR_INVALID, "valid_count[0] = 3");
  const int32_t neg_tok[2] = {32, -1};
  EXPECT_REFUSED(kvdk_convert_topk_cpu(l.get(), topk, 2, 2, valid, neg_tok,
                                       table, 2, 2, &invalid),
                 KVDK_ERR_INVALID, "num_tokens[1] = -1");
  EXPECT_REFUSED(kvdk_convert_topk_cpu(l.get(), nullptr, 2, 2, valid, ntok,
                                       table, 2, 2, &invalid),
                 KVDK_ERR_INVALID, "topk is null");
  EXPECT_REFUSED(kvdk_convert_topk_cpu(l.get(), topk, 2, -2, valid, ntok, table,
                                       2, 2, &invalid),
                 KVDK_ERR_INVALID, "k = -2");
  EXPECT_EQ(std::vector<int32_t>(topk, topk + 4),
            (std::vector<int32_t>{1, 2, 3, 4}));
  // An empty table (no columns, stride 0, no array): every valid column is
  // out of range, becomes -1 and is counted; nothing is read.
  ASSERT_EQ(kvdk_convert_topk_cpu(l.get(), topk, 2, 2, valid, ntok, nullptr, 0,
                                  0, &invalid),
            KVDK_OK)
      << kvdk_last_error();
  EXPECT_EQ(std::vector<int32_t>(topk, topk + 4),
            (std::vector<int32_t>{-1, -1, -1, -1}));
  EXPECT_EQ(invalid, 4);

  LayoutPtr ring = MakeLayout("V41", 64, 4, 1);
  ASSERT_NE(ring, nullptr);
  const int32_t s[2] = {0, 4}, st[2] = {0, 5}, vl[2] = {3, 3};
  std::vector<int32_t> out(2 * 32, 9);
  EXPECT_REFUSED(
      kvdk_swa_decode_index_cpu(ring.get(), s, st, vl, 2, 32, out.data()),
      KVDK_ERR_INVALID, "4");
  const int32_t s_ok[2] = {0, 3}, vl_big[2] = {3, 33}, st_neg[2] = {0, -5};
  EXPECT_REFUSED(kvdk_swa_decode_index_cpu(ring.get(), s_ok, st, vl_big, 2, 32,
                                           out.data()),
                 KVDK_ERR_INVALID, "33");
  EXPECT_REFUSED(kvdk_swa_decode_index_cpu(ring.get(), s_ok, st_neg, vl, 2, 32,
                                           out.data()),
                 KVDK_ERR_INVALID, "-5");
  EXPECT_REFUSED(
      kvdk_swa_decode_index_cpu(ring.get(), s_ok, st, vl, 2, 65, out.data()),
      KVDK_ERR_INVALID, "65");
  EXPECT_REFUSED(
      kvdk_swa_decode_index_cpu(ring.get(), s_ok, st, vl, 2, 32, nullptr),
      KVDK_ERR_INVALID, "out is null");
  EXPECT_EQ(out, std::vector<int32_t>(64, 9));

  const int32_t pivots[8] = {0, 4, 10, 2, 0, 4, 10, 3};  // row 1: 10 + 3 > 12
  std::vector<int32_t> swa(2 * 8, 9);
  EXPECT_REFUSED(kvdk_expand_swa_index_cpu(pivots, 2, 8, 12, swa.data()),
                 KVDK_ERR_INVALID, "pivots[1]");
  const int32_t wide[4] = {0, 5, 6, 4};  // 5 + 4 > width 8
  EXPECT_REFUSED(kvdk_expand_swa_index_cpu(wide, 1, 8, 12, swa.data()),
                 KVDK_ERR_INVALID, "pivots[0]");
  EXPECT_REFUSED(kvdk_expand_swa_index_cpu(pivots, 2, 0, 12, swa.data()),
                 KVDK_ERR_INVALID, "width");
  EXPECT_EQ(swa, std::vector<int32_t>(16, 9));

  const int32_t a[2] = {0, 12}, b[2] = {-1, 3};
  int32_t cat[4] = {9, 9, 9, 9};
  EXPECT_REFUSED(kvdk_kv_index_cat_cpu(a, 1, b, 1, 2, 12, 4, cat),
                 KVDK_ERR_INVALID, "swa_index[1][0] = 12");
  const int32_t a_ok[2] = {0, 11}, b_bad[2] = {-1, 4};
  EXPECT_REFUSED(kvdk_kv_index_cat_cpu(a_ok, 1, b_bad, 1, 2, 12, 4, cat),
                 KVDK_ERR_INVALID, "compressed_index[1][0] = 4");
  EXPECT_REFUSED(kvdk_kv_index_cat_cpu(a_ok, 1, b, 1, 2, 12, 4, nullptr),
                 KVDK_ERR_INVALID, "out is null");
  EXPECT_EQ(std::vector<int32_t>(cat, cat + 4),
            (std::vector<int32_t>{9, 9, 9, 9}));
  EXPECT_EQ(kvdk_kv_index_cat_cpu(a_ok, 1, b, 1, 2, 12, 4, cat), KVDK_OK);
  EXPECT_EQ(std::vector<int32_t>(cat, cat + 4),
            (std::vector<int32_t>{0, -1, 11, 15}));
}

// The CUDA entry points refuse bad host-side arguments before touching the
// device (host pointers stand in for device ones: nothing is launched).
TEST_F(CapiRejectDataTest, CudaHostChecks) {
  const kvdk_layout* l = layout_.get();
  uint8_t* p = pool_.data();
  const int64_t pb = pool_.size();
  std::vector<uint8_t> ws(4096);
  void* w = ws.data() + (16 - reinterpret_cast<uintptr_t>(ws.data()) % 16) % 16;
  if (!kvdk_has_cuda()) {
    EXPECT_REFUSED(kvdk_store_cuda(l, p, pb, 1, kv_.data(), 0, slots_.data(),
                                   kN, w, 1024, nullptr, nullptr),
                   KVDK_ERR_UNSUPPORTED, "without CUDA");
    return;
  }
  EXPECT_REFUSED(kvdk_store_cuda(l, p, pb, 2, kv_.data(), 0, slots_.data(), kN,
                                 w, 1024, nullptr, nullptr),
                 KVDK_ERR_INVALID, "layer = 2");
  EXPECT_REFUSED(kvdk_store_cuda(l, p, pb, 1, kv_.data(), 5, slots_.data(), kN,
                                 w, 1024, nullptr, nullptr),
                 KVDK_ERR_INVALID, "dtype = 5");
  EXPECT_REFUSED(kvdk_store_cuda(l, p, pb, 1, kv_.data(), 0, slots_.data(), kN,
                                 nullptr, 0, nullptr, nullptr),
                 KVDK_ERR_INVALID, "workspace is null");
  EXPECT_REFUSED(kvdk_store_cuda(l, p, pb, 1, kv_.data(), 0, slots_.data(), kN,
                                 w, 100, nullptr, nullptr),
                 KVDK_ERR_INVALID, "workspace_bytes = 100");
  EXPECT_REFUSED(
      kvdk_store_cuda(l, p, pb, 1, kv_.data(), 0, slots_.data(), kN,
                      static_cast<uint8_t*>(w) + 4, 1024, nullptr, nullptr),
      KVDK_ERR_INVALID, "16-byte aligned");
  EXPECT_REFUSED(kvdk_store_cuda(l, p, pb, 1, kv_.data() + 1, 0, slots_.data(),
                                 kN, w, 1024, nullptr, nullptr),
                 KVDK_ERR_INVALID, "kv is not 16-byte aligned");
  EXPECT_REFUSED(
      kvdk_store_cuda(l, p, pb, 1, kv_.data(), 0,
                      reinterpret_cast<const int32_t*>(
                          reinterpret_cast<const uint8_t*>(slots_.data()) + 2),
                      kN, w, 1024, nullptr, nullptr),
      KVDK_ERR_INVALID, "slot_mapping is not 4-byte aligned");
  EXPECT_REFUSED(kvdk_store_cuda(l, p + 8, pb - 8, 1, kv_.data(), 0,
                                 slots_.data(), kN, w, 1024, nullptr, nullptr),
                 KVDK_ERR_INVALID, "pool is not 16-byte aligned");
  std::vector<uint8_t> data(64 * 128);
  EXPECT_REFUSED(
      kvdk_load_cuda(l, p, pb, 1, slots_.data(), 1, 64, data.data(),
                     data.size(), nullptr, 0, w, 1024, nullptr, nullptr),
      KVDK_ERR_INVALID, "scales is null");
  std::mt19937 rng(312);
  capi_test::FusedInputs in = capi_test::RandomFused(rng, 128, kN);
  kvdk_fused_params fp = in.params;
  fp.hadamard_len = 48;
  EXPECT_REFUSED(
      kvdk_fused_store_cuda(l, p, pb, 1, kv_.data(), &fp, slots_.data(), kN,
                            nullptr, w, 1024, nullptr, nullptr),
      KVDK_ERR_INVALID, "hadamard_len = 48");
  fp = in.params;
  fp.positions = nullptr;
  EXPECT_REFUSED(
      kvdk_fused_store_cuda(l, p, pb, 1, kv_.data(), &fp, slots_.data(), kN,
                            nullptr, w, 1024, nullptr, nullptr),
      KVDK_ERR_INVALID, "positions is null");
  int32_t topk[4];
  EXPECT_REFUSED(kvdk_convert_topk_cuda(l, topk, 1, 65535 * 256 + 1, topk, topk,
                                        topk, 2, 2, nullptr, nullptr),
                 KVDK_ERR_INVALID, "exceeds the kernels' limit");
  EXPECT_REFUSED(kvdk_convert_topk_cuda(l, topk, 2, 2, topk, topk, topk, 2, 1,
                                        nullptr, nullptr),
                 KVDK_ERR_INVALID, "row_stride = 1");
  EXPECT_REFUSED(kvdk_swa_decode_index_cuda(l, topk, topk, topk, 1, 4, nullptr,
                                            w, 1024, nullptr, nullptr),
                 KVDK_ERR_INVALID, "out is null");
  EXPECT_REFUSED(kvdk_expand_swa_index_cuda(topk, 1, 0, 4, topk, w, 1024,
                                            nullptr, nullptr),
                 KVDK_ERR_INVALID, "width = 0");
  EXPECT_REFUSED(kvdk_kv_index_cat_cuda(topk, 1, topk, 1, 1, -1, 0, topk, w,
                                        1024, nullptr, nullptr),
                 KVDK_ERR_INVALID, "main_kv_offset = -1");
  ExpectUntouched();
}

}  // namespace
}  // namespace kvdepot
