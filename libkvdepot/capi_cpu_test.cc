// The CPU entry points of kvdepot_kernels.h against what the daemon's CPU
// backend runs (server/cpu/cpu_backend.cc: kvdepot::Store, LoadSegments and
// FusedStore on pool + layer_offset; server/service_index.cc and
// server/request_checks.cc: the planner), byte for byte, on seeded random
// inputs for every format and block sizes 1, 7 and 133; and the records
// against EncodeTokenBf16 (an independent path to the same bytes).
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/types/span.h"
#include "gtest/gtest.h"
#include "kernels/format.h"
#include "kernels/format_host.h"
#include "kernels/reference/fused.h"
#include "kernels/reference/reference.h"
#include "kernels/store_load_host.h"
#include "libkvdepot/capi_test_util.h"
#include "libkvdepot/kvdepot_kernels.h"
#include "planner/plan.h"

namespace kvdepot {
namespace {

using capi_test::Formats;
using capi_test::LayoutPtr;
using capi_test::MakeLayout;

bool NotAllZero(absl::Span<const uint8_t> bytes) {
  for (uint8_t b : bytes) {
    if (b != 0) return true;
  }
  return false;
}

class CapiCpuTest
    : public ::testing::TestWithParam<std::tuple<std::string, int64_t>> {
 protected:
  void SetUp() override {
    const auto& [name, bs] = GetParam();
    block_size_ = bs;
    num_blocks_ = 160 / bs + 3;
    layout_ = MakeLayout(name, bs, num_blocks_, kLayers);
    ASSERT_NE(layout_, nullptr) << kvdk_last_error();
    absl::StatusOr<KVCacheFormat> f = FormatFromName(name);
    ASSERT_TRUE(f.ok()) << f.status();
    absl::StatusOr<PoolLayout> l = MakePoolLayout(*f, bs, num_blocks_, kLayers);
    ASSERT_TRUE(l.ok()) << l.status();
    ref_ = *l;
  }

  static constexpr int64_t kLayers = 3;
  static constexpr int64_t kLayer = 1;
  int64_t block_size_ = 0;
  int64_t num_blocks_ = 0;
  LayoutPtr layout_;
  PoolLayout ref_;  // the daemon's layout of the same pool
};

TEST_P(CapiCpuTest, LayoutIsTheDaemons) {
  const kvdk_layout_info info = capi_test::Info(layout_.get());
  const KVCacheFormat& f = ref_.format;
  EXPECT_EQ(info.elements, f.elements());
  EXPECT_EQ(info.quantized_elements, f.quantized_elements);
  EXPECT_EQ(info.bf16_elements, f.bf16_elements);
  EXPECT_EQ(info.elements_per_sf, f.elements_per_sf);
  EXPECT_EQ(info.quantized_dtype, static_cast<int64_t>(f.quantized_dtype));
  EXPECT_EQ(info.sf_format, static_cast<int64_t>(f.sf_format));
  EXPECT_EQ(info.scale_rounding, static_cast<int64_t>(f.scale_rounding));
  EXPECT_EQ(info.do_cast, f.do_cast ? 1 : 0);
  EXPECT_EQ(info.token_interleaved, f.token_interleaved ? 1 : 0);
  EXPECT_EQ(info.data_bytes, f.data_bytes());
  EXPECT_EQ(info.sf_bytes, f.sf_bytes());
  EXPECT_EQ(info.bytes_per_token, f.bytes_per_token());
  EXPECT_EQ(info.block_size, ref_.block_size);
  EXPECT_EQ(info.num_blocks, ref_.num_blocks);
  EXPECT_EQ(info.num_layers, ref_.num_layers);
  EXPECT_EQ(info.block_stride, ref_.block_stride);
  EXPECT_EQ(info.layer_bytes, ref_.layer_bytes);
  EXPECT_EQ(info.layer_stride, ref_.layer_stride);
  EXPECT_EQ(info.total_bytes, ref_.total_bytes);
  EXPECT_EQ(info.load_data_row_bytes, LoadDataRowBytes(f));
  EXPECT_EQ(info.load_scale_row_bytes, LoadScaleRowBytes(f));
  EXPECT_EQ(info.num_slots, ref_.num_slots());
  EXPECT_EQ(info.tail_bytes, f.tail_bytes());
  EXPECT_EQ(info.data_bytes + info.sf_bytes + info.tail_bytes,
            info.bytes_per_token);
  EXPECT_EQ(info.layer_stride % 256, 0);
  char name[32];
  ASSERT_EQ(kvdk_layout_format_name(layout_.get(), name, sizeof(name)),
            KVDK_OK);
  EXPECT_EQ(FormatName(f).value(), name);
  // The same layout from its descriptor.
  kvdk_format_desc d{};
  d.quantized_dtype = static_cast<int32_t>(f.quantized_dtype);
  d.quantized_elements = f.quantized_elements;
  d.elements_per_sf = f.elements_per_sf;
  d.bf16_elements = f.bf16_elements;
  d.do_cast = f.do_cast;
  d.sf_format = static_cast<int32_t>(f.sf_format);
  d.token_interleaved = f.token_interleaved;
  d.scale_rounding = static_cast<int32_t>(f.scale_rounding);
  kvdk_layout* l2 = nullptr;
  ASSERT_EQ(kvdk_layout_create_desc(&d, block_size_, num_blocks_, kLayers, &l2),
            KVDK_OK)
      << kvdk_last_error();
  LayoutPtr own(l2);
  const kvdk_layout_info info2 = capi_test::Info(l2);
  EXPECT_EQ(std::memcmp(&info, &info2, sizeof(info)), 0);
}

TEST_P(CapiCpuTest, StoreIsTheDaemonsStore) {
  std::mt19937 rng(301);
  const int64_t d = ref_.format.elements();
  for (int32_t dtype : {KVDK_DTYPE_BF16, KVDK_DTYPE_FP32}) {
    if (dtype == KVDK_DTYPE_FP32 && TakesBf16InputOnly(ref_.format)) continue;
    SCOPED_TRACE(dtype);
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{79}}) {
      const std::vector<int32_t> slots =
          capi_test::RandomSlots(rng, n, ref_.num_slots());
      std::vector<uint16_t> bf16 = capi_test::RandomBf16(rng, n, d);
      std::vector<float> fp32 = capi_test::RandomFloats(rng, n * d);
      const void* kv = dtype == KVDK_DTYPE_BF16
                           ? static_cast<const void*>(bf16.data())
                           : static_cast<const void*>(fp32.data());
      std::vector<uint8_t> pool(ref_.total_bytes, 0x5A), want = pool;
      ASSERT_EQ(kvdk_store_cpu(layout_.get(), pool.data(), pool.size(), kLayer,
                               kv, dtype, slots.data(), n),
                KVDK_OK)
          << kvdk_last_error();
      ASSERT_TRUE(Store(ref_, want.data() + ref_.layer_offset(kLayer), kv,
                        static_cast<InputDtype>(dtype), slots)
                      .ok());
      ASSERT_FALSE(capi_test::SameBytes(
          pool, std::vector<uint8_t>(ref_.total_bytes, 0x5A)));
      EXPECT_TRUE(capi_test::SameBytes(pool, want));
      if (dtype != KVDK_DTYPE_BF16) continue;
      // Each stored record is EncodeTokenBf16 of its token.
      const uint8_t* layer = pool.data() + ref_.layer_offset(kLayer);
      std::vector<uint8_t> data(ref_.format.data_bytes()),
          scales(ref_.format.sf_bytes() + ref_.format.tail_bytes());
      for (int64_t t = 0; t < n; ++t) {
        if (slots[t] < 0) continue;
        EncodeTokenBf16(ref_.format,
                        reinterpret_cast<const uint8_t*>(bf16.data() + t * d),
                        data.data(), scales.data());
        ASSERT_EQ(std::memcmp(layer + ref_.slot_data_offset(slots[t]),
                              data.data(), data.size()),
                  0)
            << "token " << t;
        if (scales.empty()) continue;  // BF16 records have no scales
        ASSERT_EQ(std::memcmp(layer + ref_.slot_scale_offset(slots[t]),
                              scales.data(), scales.size()),
                  0)
            << "token " << t;
      }
    }
  }
}

TEST_P(CapiCpuTest, LoadIsTheDaemonsLoad) {
  std::mt19937 rng(302);
  const int64_t d = ref_.format.elements();
  // Fill the layer through the library (every slot), then load.
  const int64_t n = ref_.num_slots();
  std::vector<int32_t> all(n);
  for (int64_t i = 0; i < n; ++i) all[i] = static_cast<int32_t>(i);
  const std::vector<uint16_t> kv = capi_test::RandomBf16(rng, n, d);
  std::vector<uint8_t> pool(ref_.total_bytes, 0);
  ASSERT_EQ(kvdk_store_cpu(layout_.get(), pool.data(), pool.size(), kLayer,
                           kv.data(), KVDK_DTYPE_BF16, all.data(), n),
            KVDK_OK)
      << kvdk_last_error();
  const int64_t drow = LoadDataRowBytes(ref_.format);
  const int64_t srow = LoadScaleRowBytes(ref_.format);
  for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{9}, int64_t{40}}) {
    const capi_test::Plan plan =
        capi_test::RandomPlan(rng, block_size_, num_blocks_, count);
    std::vector<uint8_t> data(plan.total_k * drow, 0xC3), want_data = data;
    std::vector<uint8_t> scales(plan.total_k * srow, 0x3C),
        want_scales = scales;
    ASSERT_EQ(kvdk_load_cpu(layout_.get(), pool.data(), pool.size(), kLayer,
                            plan.segments.data(), plan.num_segments(),
                            plan.total_k, data.data(), data.size(),
                            srow > 0 ? scales.data() : nullptr, scales.size()),
              KVDK_OK)
        << kvdk_last_error();
    ASSERT_TRUE(LoadSegments(ref_, pool.data() + ref_.layer_offset(kLayer),
                             plan.segments, plan.total_k, want_data.data(),
                             srow > 0 ? want_scales.data() : nullptr)
                    .ok());
    EXPECT_TRUE(capi_test::SameBytes(data, want_data));
    EXPECT_TRUE(capi_test::SameBytes(scales, want_scales));
  }
}

TEST_P(CapiCpuTest, FusedStoreIsTheDaemonsFusedStore) {
  const int64_t d = ref_.format.elements();
  if (!capi_test::FusedFits(d)) GTEST_SKIP() << "no fused store for " << d;
  std::mt19937 rng(303);
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{33}}) {
    const std::vector<int32_t> slots =
        capi_test::RandomSlots(rng, n, ref_.num_slots());
    const std::vector<uint16_t> kv = capi_test::RandomBf16(rng, n, d);
    capi_test::FusedInputs in = capi_test::RandomFused(rng, d, n);
    std::vector<uint8_t> pool(ref_.total_bytes, 0x11), want = pool;
    std::vector<uint16_t> cast(n * d, 1), want_cast = cast;
    ASSERT_EQ(kvdk_fused_store_cpu(layout_.get(), pool.data(), pool.size(),
                                   kLayer, kv.data(), &in.params, slots.data(),
                                   n, cast.data()),
              KVDK_OK)
        << kvdk_last_error();
    FusedParams p;
    p.norm_begin = in.params.norm_begin;
    p.norm_end = in.params.norm_end;
    p.norm_weight = in.params.norm_weight;
    p.eps = in.params.eps;
    p.rope = static_cast<RopeStyle>(in.params.rope_style);
    p.rope_offset = in.params.rope_offset;
    p.rope_dim = in.params.rope_dim;
    p.positions = in.params.positions;
    p.cos_sin = in.params.cos_sin;
    p.max_position = in.params.max_position;
    p.hadamard_begin = in.params.hadamard_begin;
    p.hadamard_len = in.params.hadamard_len;
    ASSERT_TRUE(FusedStore(ref_, want.data() + ref_.layer_offset(kLayer),
                           kv.data(), p, slots, want_cast.data())
                    .ok());
    EXPECT_TRUE(capi_test::SameBytes(pool, want));
    EXPECT_TRUE(capi_test::SameBytes(cast, want_cast));
    EXPECT_TRUE(NotAllZero(absl::MakeConstSpan(
        reinterpret_cast<const uint8_t*>(cast.data()), cast.size() * 2)));
    // Without cast_back: the same pool bytes.
    std::vector<uint8_t> pool2(ref_.total_bytes, 0x11);
    ASSERT_EQ(
        kvdk_fused_store_cpu(layout_.get(), pool2.data(), pool2.size(), kLayer,
                             kv.data(), &in.params, slots.data(), n, nullptr),
        KVDK_OK);
    EXPECT_TRUE(capi_test::SameBytes(pool2, want));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, CapiCpuTest,
    ::testing::Combine(::testing::ValuesIn(Formats()),
                       ::testing::Values(int64_t{1}, int64_t{7}, int64_t{133})),
    [](const auto& info) {
      return capi_test::ParamName(std::get<0>(info.param),
                                  std::get<1>(info.param));
    });

// SPEC §6's worked example through the plan helpers: seqlen_k 10000,
// block_size 64, R 4 (pool blocks of 16 compressed tokens), W 4096.
TEST(CapiPlanTest, WorkedExample) {
  LayoutPtr index = MakeLayout("FP4_INDEX", 16, 1024, 1);
  ASSERT_NE(index, nullptr) << kvdk_last_error();
  const int32_t seqlen_k = 10000, seqlen_q = 1024;
  std::vector<int32_t> table(157);
  for (int i = 0; i < 157; ++i) table[i] = 1000 - i;
  std::vector<int32_t> seg(4 * 200);
  int64_t num = -1, total = -1;
  int32_t cu[2] = {-1, -1};
  ASSERT_EQ(
      kvdk_build_compressed_plan(index.get(), 4, &seqlen_k, 1, table.data(),
                                 157, seg.data(), 200, &num, &total, cu),
      KVDK_OK)
      << kvdk_last_error();
  EXPECT_EQ(num, 157);
  EXPECT_EQ(total, 2500);
  EXPECT_EQ(cu[0], 0);
  EXPECT_EQ(cu[1], 2500);
  for (int s = 0; s < 157; ++s) {
    EXPECT_EQ(seg[4 * s], table[s]);
    EXPECT_EQ(seg[4 * s + 1], 0);
    EXPECT_EQ(seg[4 * s + 2], s < 156 ? 16 : 4);
    EXPECT_EQ(seg[4 * s + 3], 16 * s);
  }
  // Too small an output: KVDK_ERR_CAPACITY with the count needed.
  EXPECT_EQ(
      kvdk_build_compressed_plan(index.get(), 4, &seqlen_k, 1, table.data(),
                                 157, seg.data(), 100, &num, &total, nullptr),
      KVDK_ERR_CAPACITY);
  EXPECT_EQ(num, 157);

  LayoutPtr ring = MakeLayout("V41", 4096, 4, 1);
  ASSERT_NE(ring, nullptr) << kvdk_last_error();
  const int32_t state = 2;
  ASSERT_EQ(kvdk_build_swa_plan(ring.get(), 4096, &seqlen_k, &seqlen_q, &state,
                                nullptr, 1, seg.data(), 200, &num, &total),
            KVDK_OK)
      << kvdk_last_error();
  ASSERT_EQ(num, 2);
  EXPECT_EQ(total, 4096);
  EXPECT_EQ(std::vector<int32_t>(seg.begin(), seg.begin() + 8),
            (std::vector<int32_t>{2, 784, 4096, 0, 2, 0, 784, 3312}));
}

// Random batches: the plan helpers equal the planner as the daemon calls it.
TEST(CapiPlanTest, RandomBatchesEqualThePlanner) {
  std::mt19937 rng(304);
  for (int64_t bs : {int64_t{1}, int64_t{7}, int64_t{133}}) {
    LayoutPtr pool = MakeLayout("MXFP8_INDEX", bs, 50, 1);
    ASSERT_NE(pool, nullptr);
    const int32_t ratio = 4;
    const int32_t num_seqs = 9, cols = 12;
    std::uniform_int_distribution<int32_t> len(0, bs * ratio * cols);
    std::uniform_int_distribution<int32_t> blk(0, 49);
    std::vector<int32_t> seqlen_k(num_seqs), table(num_seqs * cols);
    for (int32_t& x : seqlen_k) x = len(rng);
    for (int32_t& x : table) x = blk(rng);
    std::vector<int32_t> seg(4 * 4096), cu(num_seqs + 1);
    int64_t num = 0, total = 0;
    ASSERT_EQ(kvdk_build_compressed_plan(
                  pool.get(), ratio, seqlen_k.data(), num_seqs, table.data(),
                  cols, seg.data(), 4096, &num, &total, cu.data()),
              KVDK_OK)
        << kvdk_last_error();
    CompressedParams params;
    params.ratio = ratio;
    params.block_size = static_cast<int32_t>(bs * ratio);
    params.num_blocks = 50;
    SequenceBatch batch;
    batch.seqlen_k = seqlen_k;
    batch.block_table.data = table;
    batch.block_table.num_rows = num_seqs;
    batch.block_table.num_cols = cols;
    batch.block_table.row_stride = cols;
    BlockLoadPlanBuilder builder(static_cast<int32_t>(bs), 50);
    std::vector<int32_t> want_cu(num_seqs + 1);
    ASSERT_TRUE(
        BuildCompressedPlan(batch, params, &builder, absl::MakeSpan(want_cu))
            .ok());
    EXPECT_EQ(total, builder.total_k());
    EXPECT_EQ(std::vector<int32_t>(seg.begin(), seg.begin() + 4 * num),
              std::vector<int32_t>(builder.segments().begin(),
                                   builder.segments().end()));
    EXPECT_EQ(cu, want_cu);
  }
}

TEST(CapiIndexTest, ConvertTopkEqualsThePlanner) {
  std::mt19937 rng(305);
  for (int64_t bs : {int64_t{1}, int64_t{7}, int64_t{133}}) {
    LayoutPtr pool = MakeLayout("FP4_INDEX", bs, 40, 1);
    ASSERT_NE(pool, nullptr);
    const int64_t b = 7;
    const int32_t k = 37, cols = 5, stride = 6;
    std::uniform_int_distribution<int32_t> entry(-3, bs * cols + 3);
    std::uniform_int_distribution<int32_t> id(-1, 41);  // some out of range
    std::uniform_int_distribution<int32_t> count(0, k);
    std::uniform_int_distribution<int32_t> tokens(0, bs * cols);
    std::vector<int32_t> topk(b * k), valid(b), ntok(b), table(b * stride);
    for (int32_t& x : topk) x = entry(rng);
    for (int32_t& x : valid) x = count(rng);
    for (int32_t& x : ntok) x = tokens(rng);
    for (int32_t& x : table) x = id(rng);
    std::vector<int32_t> want = topk;
    int64_t invalid = -1;
    ASSERT_EQ(kvdk_convert_topk_cpu(pool.get(), topk.data(), b, k, valid.data(),
                                    ntok.data(), table.data(), cols, stride,
                                    &invalid),
              KVDK_OK)
        << kvdk_last_error();
    BlockTableView view;
    view.data = table;
    view.num_rows = b;
    view.num_cols = cols;
    view.row_stride = stride;
    absl::StatusOr<int64_t> want_invalid =
        ConvertTopk(absl::MakeSpan(want), k, valid, ntok, view,
                    static_cast<int32_t>(bs), 40);
    ASSERT_TRUE(want_invalid.ok()) << want_invalid.status();
    EXPECT_EQ(topk, want);
    EXPECT_EQ(invalid, *want_invalid);
    EXPECT_GT(invalid, 0);
  }
}

TEST(CapiIndexTest, SwaAndPrefillIndicesEqualThePlanner) {
  std::mt19937 rng(306);
  LayoutPtr ring = MakeLayout("V41", 133, 9, 1);
  ASSERT_NE(ring, nullptr);
  const int32_t window = 128;
  const int64_t n = 79;
  std::uniform_int_distribution<int32_t> state(0, 8), start(0, 100000),
      len(0, window);
  std::vector<int32_t> s(n), st(n), vl(n);
  for (int64_t i = 0; i < n; ++i) {
    s[i] = state(rng);
    st[i] = start(rng);
    vl[i] = len(rng);
  }
  std::vector<int32_t> out(n * window, 7), want(n * window, 7);
  ASSERT_EQ(kvdk_swa_decode_index_cpu(ring.get(), s.data(), st.data(),
                                      vl.data(), n, window, out.data()),
            KVDK_OK)
      << kvdk_last_error();
  SwaParams params{window, 133, 9};
  ASSERT_TRUE(
      ExpandSwaDecodeIndex(s, st, vl, params, absl::MakeSpan(want)).ok());
  EXPECT_EQ(out, want);

  // The daemon's PrefillIndex steps: pivots -> expand -> cat.
  const std::vector<int32_t> seqlen_k = {300, 17, 1000};
  const std::vector<int32_t> seqlen_q = {45, 17, 3};
  SequenceBatch batch;
  batch.seqlen_k = seqlen_k;
  batch.seqlen_q = seqlen_q;
  absl::StatusOr<PrefillLayout> pl = ComputePrefillLayout(batch, window, 4);
  ASSERT_TRUE(pl.ok()) << pl.status();
  const int64_t rows = pl->chunk_rows;
  std::vector<int32_t> pivots(rows * 4);
  ASSERT_TRUE(ComputeSwaPivots(batch, *pl, absl::MakeSpan(pivots)).ok());
  std::vector<int32_t> swa(rows * window, 5), want_swa(rows * window, 5);
  ASSERT_EQ(kvdk_expand_swa_index_cpu(pivots.data(), rows, window,
                                      pl->main_kv_offset, swa.data()),
            KVDK_OK)
      << kvdk_last_error();
  ASSERT_TRUE(ExpandSwaIndex(pivots, window, pl->main_kv_offset,
                             absl::MakeSpan(want_swa))
                  .ok());
  EXPECT_EQ(swa, want_swa);
  const int32_t topk = 16;
  std::uniform_int_distribution<int32_t> comp(-1, pl->compressed_rows - 1);
  std::vector<int32_t> compressed(rows * topk);
  for (int32_t& x : compressed) x = comp(rng);
  std::vector<int32_t> cat(rows * (window + topk)), want_cat = cat;
  ASSERT_EQ(kvdk_kv_index_cat_cpu(swa.data(), window, compressed.data(), topk,
                                  rows, pl->main_kv_offset, pl->compressed_rows,
                                  cat.data()),
            KVDK_OK)
      << kvdk_last_error();
  ASSERT_TRUE(KvIndexCat(swa, window, compressed, topk, rows,
                         pl->main_kv_offset, pl->compressed_rows,
                         absl::MakeSpan(want_cat))
                  .ok());
  EXPECT_EQ(cat, want_cat);
}

// DS_MLA_FP8's 656-byte record: 512 e4m3, 4 fp32 scales, a 64-value BF16
// tail. A caller built against ABI 1's shorter struct gets its prefix and
// nothing written past it.
TEST(CapiTest, LayoutInfoTailAndTheShorterStruct) {
  kvdk_layout* l = nullptr;
  ASSERT_EQ(kvdk_layout_create("DS_MLA_FP8", 0, 64, 4, 2, &l), KVDK_OK)
      << kvdk_last_error();
  LayoutPtr own(l);
  const kvdk_layout_info info = capi_test::Info(l);
  EXPECT_EQ(info.data_bytes, 512);
  EXPECT_EQ(info.sf_bytes, 16);
  EXPECT_EQ(info.tail_bytes, 128);
  EXPECT_EQ(info.bytes_per_token, 656);
  EXPECT_EQ(capi_test::Info(MakeLayout("V41", 64, 4, 2).get()).tail_bytes, 0);

  unsigned char raw[sizeof(kvdk_layout_info) + 8];
  std::memset(raw, 0xAB, sizeof(raw));
  ASSERT_EQ(kvdk_layout_get_info(l, reinterpret_cast<kvdk_layout_info*>(raw),
                                 KVDK_LAYOUT_INFO_V1_BYTES),
            KVDK_OK)
      << kvdk_last_error();
  EXPECT_EQ(std::memcmp(raw, &info, KVDK_LAYOUT_INFO_V1_BYTES), 0);
  for (size_t i = KVDK_LAYOUT_INFO_V1_BYTES; i < sizeof(raw); ++i) {
    ASSERT_EQ(raw[i], 0xAB) << "byte " << i << " written";
  }
  // A bigger caller (a later header) gets this struct's bytes only.
  std::memset(raw, 0xAB, sizeof(raw));
  ASSERT_EQ(kvdk_layout_get_info(l, reinterpret_cast<kvdk_layout_info*>(raw),
                                 sizeof(raw)),
            KVDK_OK);
  EXPECT_EQ(std::memcmp(raw, &info, sizeof(info)), 0);
  for (size_t i = sizeof(info); i < sizeof(raw); ++i) {
    ASSERT_EQ(raw[i], 0xAB) << "byte " << i << " written";
  }
}

TEST(CapiTest, VersionAndWorkspace) {
  EXPECT_EQ(kvdk_abi_version(), KVDK_ABI_VERSION);
  EXPECT_EQ(kvdk_cuda_workspace_bytes(KVDK_OP_STORE, 0), 0);
  EXPECT_EQ(kvdk_cuda_workspace_bytes(KVDK_OP_STORE, 1), 256);
  EXPECT_EQ(kvdk_cuda_workspace_bytes(KVDK_OP_STORE, 65), 512);
  EXPECT_EQ(kvdk_cuda_workspace_bytes(KVDK_OP_FUSED_STORE, 33), 256 + 512);
  EXPECT_EQ(kvdk_cuda_workspace_bytes(KVDK_OP_LOAD, 16), 256);
  EXPECT_LT(kvdk_cuda_workspace_bytes(99, 1), 0);
  EXPECT_LT(kvdk_cuda_workspace_bytes(KVDK_OP_STORE, -1), 0);
  EXPECT_NE(std::string(kvdk_last_error()).find("count = -1"),
            std::string::npos);
}

}  // namespace
}  // namespace kvdepot
