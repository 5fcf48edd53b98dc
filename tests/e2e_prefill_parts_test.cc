// End to end on the CPU backend: layers with only one of the two parts of
// SPEC §6 (docs/SPEC.md "window 0 / ratio 0"). PrefillLoad and
// PrefillIndex with window 0 (no SWA part: no history rows, nothing read
// from or stored into a ring) and with compress_ratio 0 (no compressed
// part) give exactly the corresponding rows of a full layer's answer on
// the same cache contents; both 0 is refused.
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"

namespace kvdepot::testing {
namespace {

using ::testing::HasSubstr;

constexpr int32_t kRing = 16, kWindow = 8, kRatio = 4, kBlock = 4;
constexpr int32_t kElements = 512;
constexpr int64_t kRowBytes = kElements * 2;
// Two sequences: the same history in rings 0 and 1 (so a load that stores
// its chunk into one ring cannot change what the other reads).
const std::vector<int32_t> kSeqlenK = {37, 22}, kSeqlenQ = {5, 3};

class PrefillPartsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start();
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    c_ = ConnectOrDie(daemon_->socket_path());
    ASSERT_NE(c_, nullptr);
    ASSERT_TRUE(c_->CreatePool(PoolRequest("swa", "V41", 0, kRing, 4, 1)).ok());
    ASSERT_TRUE(
        c_->CreatePool(PoolRequest("main", "V41", 0, kBlock, 30, 1)).ok());
    std::mt19937 rng(501);
    const std::vector<float> ring = RandomKv(kRing, kElements, rng);
    for (int32_t state : {0, 1, 2, 3}) {
      std::vector<int32_t> slots(kRing);
      for (int32_t i = 0; i < kRing; ++i) slots[i] = state * kRing + i;
      Store("swa", slots, ring);
    }
    std::vector<int32_t> main_slots(30 * kBlock);
    for (size_t i = 0; i < main_slots.size(); ++i) main_slots[i] = i;
    Store("main", main_slots, RandomKv(main_slots.size(), kElements, rng));
    chunk_ = Bf16Bytes(RandomKv(8, kElements, rng));
    absl::StatusOr<const PoolMapping*> m = c_->MapPool("swa");
    ASSERT_TRUE(m.ok()) << m.status();
    swa_ = *m;
  }

  void Store(const std::string& pool, const std::vector<int32_t>& slots,
             const std::vector<float>& kv) {
    v1::StoreRequest r = StoreRequest(pool, 0, slots, v1::INPUT_DTYPE_FP32);
    *r.mutable_kv() = InlineData(Fp32Bytes(kv));
    ASSERT_TRUE(c_->Store(r).ok());
  }

  // A full layer on rings {first, first + 1}.
  v1::PrefillLoadRequest Full(int32_t first) const {
    v1::PrefillLoadRequest r;
    r.set_swa_pool("swa");
    r.set_main_pool("main");
    r.set_num_seqs(2);
    r.set_seqlen_k(Pack(kSeqlenK));
    r.set_seqlen_q(Pack(kSeqlenQ));
    r.set_swa_state_id(Pack({first, first + 1}));
    r.set_window(kWindow);
    r.set_compress_ratio(kRatio);
    r.set_max_blocks_per_seq(3);
    r.set_block_table(Pack({4, 9, 2, 7, 1, 0}));
    r.set_dtype(v1::INPUT_DTYPE_BF16);
    *r.mutable_chunk_kv() = InlineData(chunk_);
    *r.mutable_output() = InlineOutput();
    return r;
  }

  std::string Ring(int32_t state) const {
    return std::string(reinterpret_cast<const char*>(swa_->data()) +
                           state * swa_->layout().block_stride(),
                       static_cast<size_t>(swa_->layout().block_stride()));
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<KVCacheClient> c_;
  const PoolMapping* swa_ = nullptr;
  std::string chunk_;  // BF16 [8][512]
};

TEST_F(PrefillPartsTest, PrefillLoadWithOnePartEqualsThoseRowsOfAFullLoad) {
  // Without an SWA part first: it touches no ring.
  const std::string ring0 = Ring(0), ring1 = Ring(1);
  v1::PrefillLoadRequest no_swa = Full(0);
  no_swa.set_window(0);
  no_swa.clear_swa_pool();
  no_swa.clear_swa_state_id();
  no_swa.set_swa_state_id(Pack({0, 0}));  // unused
  absl::StatusOr<v1::PrefillLoadResponse> a = c_->PrefillLoad(no_swa);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(Ring(0), ring0) << "window 0 must not store into a ring";
  EXPECT_EQ(Ring(1), ring1);

  v1::PrefillLoadRequest no_main = Full(0);
  no_main.set_compress_ratio(0);
  no_main.clear_main_pool();
  no_main.set_max_blocks_per_seq(0);
  no_main.clear_block_table();
  absl::StatusOr<v1::PrefillLoadResponse> b = c_->PrefillLoad(no_main);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_NE(Ring(0), ring0) << "the chunk must be stored into ring 0";

  absl::StatusOr<v1::PrefillLoadResponse> full = c_->PrefillLoad(Full(2));
  ASSERT_TRUE(full.ok()) << full.status();
  const int64_t history = 2 * kWindow, chunk = 8;
  const int64_t compressed = 37 / kRatio + 22 / kRatio;
  ASSERT_EQ(full->total_rows(), history + chunk + compressed);
  const std::string& f = full->output();
  ASSERT_FALSE(AllZero(reinterpret_cast<const uint8_t*>(f.data()), f.size()));

  EXPECT_EQ(a->total_k_swa(), 0);
  EXPECT_EQ(a->main_kv_offset(), chunk);
  EXPECT_EQ(a->total_rows(), chunk + compressed);
  EXPECT_EQ(a->swa_segments(), 0);
  EXPECT_EQ(a->cu_compressed(), full->cu_compressed());
  EXPECT_TRUE(a->output() == f.substr(history * kRowBytes))
      << "window 0: [chunk | compressed] of the full load";

  EXPECT_EQ(b->total_k_swa(), history);
  EXPECT_EQ(b->main_kv_offset(), history + chunk);
  EXPECT_EQ(b->total_rows(), history + chunk);
  EXPECT_EQ(b->main_segments(), 0);
  EXPECT_EQ(ReadInt32s(b->cu_compressed()), (std::vector<int32_t>{0, 0, 0}));
  EXPECT_TRUE(b->output() == f.substr(0, (history + chunk) * kRowBytes))
      << "ratio 0: [history | chunk] of the full load";
  EXPECT_EQ(Ring(0), Ring(2)) << "both stored the same chunk";
}

TEST_F(PrefillPartsTest, PrefillLoadRefusesBadPartFields) {
  v1::PrefillLoadRequest r = Full(0);
  r.set_window(0);
  r.set_compress_ratio(0);
  absl::StatusOr<v1::PrefillLoadResponse> s = c_->PrefillLoad(r);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("neither"));
  r = Full(0);
  r.set_max_blocks_per_seq(0);
  r.clear_block_table();
  s = c_->PrefillLoad(r);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("max_blocks_per_seq = 0 is outside [1"));
  r = Full(0);
  r.set_window(-1);
  s = c_->PrefillLoad(r);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  r = Full(0);
  r.set_window(0);
  r.set_swa_pool("nope");  // a named pool must exist even when unused
  s = c_->PrefillLoad(r);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(PrefillPartsTest, PrefillIndexWithOnePart) {
  v1::PrefillIndexRequest r;
  r.set_num_seqs(2);
  r.set_seqlen_k(Pack(kSeqlenK));
  r.set_seqlen_q(Pack(kSeqlenQ));
  r.set_window(kWindow);
  r.set_compress_ratio(kRatio);
  r.set_topk_k(3);
  const std::vector<int32_t> comp = {0, 5, -1, 13, 2, 1, -1, -1, 0, 4, 3, 2,
                                     9, 8, 7,  6,  5, 4, 1,  2,  3, 0, 0, 0};
  r.set_compressed_index(Pack(comp));
  absl::StatusOr<v1::PrefillIndexResponse> full = c_->PrefillIndex(r);
  ASSERT_TRUE(full.ok()) << full.status();
  const std::vector<int32_t> f = ReadInt32s(full->index());
  const int64_t rows = 8, width = kWindow + 3;
  ASSERT_EQ(static_cast<int64_t>(f.size()), rows * width);

  v1::PrefillIndexRequest no_swa = r;
  no_swa.set_window(0);
  absl::StatusOr<v1::PrefillIndexResponse> a = c_->PrefillIndex(no_swa);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->row_width(), 3);
  EXPECT_EQ(a->main_kv_offset(), 8);
  const std::vector<int32_t> ai = ReadInt32s(a->index());
  ASSERT_EQ(ai.size(), comp.size());
  for (size_t i = 0; i < comp.size(); ++i) {
    EXPECT_EQ(ai[i], comp[i] < 0 ? -1 : comp[i] + 8) << "entry " << i;
  }

  v1::PrefillIndexRequest no_main = r;
  no_main.set_compress_ratio(0);
  absl::StatusOr<v1::PrefillIndexResponse> bad = c_->PrefillIndex(no_main);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("compressed_index[0] = 0 is outside [-1, 0)"));
  no_main.set_compressed_index(Pack(std::vector<int32_t>(comp.size(), -1)));
  absl::StatusOr<v1::PrefillIndexResponse> b = c_->PrefillIndex(no_main);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->total_rows(), 2 * kWindow + 8);
  const std::vector<int32_t> bi = ReadInt32s(b->index());
  ASSERT_EQ(static_cast<int64_t>(bi.size()), rows * width);
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t c = 0; c < width; ++c) {
      EXPECT_EQ(bi[row * width + c], c < kWindow ? f[row * width + c] : -1)
          << "row " << row << " column " << c;
    }
  }

  v1::PrefillIndexRequest neither = r;
  neither.set_window(0);
  neither.set_compress_ratio(0);
  EXPECT_THAT(std::string(c_->PrefillIndex(neither).status().message()),
              HasSubstr("neither"));
  neither = r;
  neither.set_window(-2);
  EXPECT_THAT(std::string(c_->PrefillIndex(neither).status().message()),
              HasSubstr("window = -2 must be >= 0"));
}

}  // namespace
}  // namespace kvdepot::testing
