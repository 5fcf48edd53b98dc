// End to end, SPEC §6's worked example through PrefillLoad: seqlen_k 10000,
// seqlen_q 1024, block_size 64, R 4, W 4096, ring 4096, swa_valid_start 0.
// The buffer layout, the offsets and every byte are checked against the CPU
// reference (plans written out from the SPEC's numbers, not from the
// planner), the SWA store is checked to run after the history load, and the
// index RPCs are checked against hand-computed rows.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"

namespace kvdepot::testing {
namespace {

constexpr int32_t kSeqlenK = 10000, kSeqlenQ = 1024, kRatio = 4;
constexpr int32_t kWindow = 4096, kRing = 4096, kState = 1;
constexpr int32_t kCompressedBlock = 64 / kRatio;  // 16
constexpr int32_t kElements = 512;
constexpr int64_t kRowBytes = kElements * 2;

class PrefillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start();
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    c_ = ConnectOrDie(daemon_->socket_path());
    ASSERT_NE(c_, nullptr);
    absl::StatusOr<v1::PoolInfo> swa =
        c_->CreatePool(PoolRequest("swa", "V41", 0, kRing, 2, 1));
    absl::StatusOr<v1::PoolInfo> main =
        c_->CreatePool(PoolRequest("main", "V41", 0, kCompressedBlock, 200, 2));
    ASSERT_TRUE(swa.ok() && main.ok());
    swa_ = LocalPool::FromInfo(*swa);
    main_ = LocalPool::FromInfo(*main);
    std::mt19937 rng(301);
    table_.resize(200);
    std::iota(table_.begin(), table_.end(), 0);
    std::shuffle(table_.begin(), table_.end(), rng);
    table_.resize(157);
    // The ring of state 1, full; the compressed cache, 2500 tokens.
    std::vector<int32_t> ring_slots(kRing);
    std::iota(ring_slots.begin(), ring_slots.end(), kState * kRing);
    StoreBoth("swa", 0, ring_slots, RandomKv(kRing, kElements, rng), swa_);
    std::vector<int32_t> main_slots(2500);
    for (int32_t t = 0; t < 2500; ++t) {
      main_slots[t] = table_[t / kCompressedBlock] * kCompressedBlock +
                      t % kCompressedBlock;
    }
    StoreBoth("main", 1, main_slots, RandomKv(2500, kElements, rng), main_);
    chunk_ = Bf16Values(RandomKv(kSeqlenQ, kElements, rng));
  }

  // Stores through a daemon buffer and into the local mirror.
  void StoreBoth(const std::string& pool, int64_t layer,
                 const std::vector<int32_t>& slots,
                 const std::vector<float>& kv, LocalPool& local) {
    absl::StatusOr<BufferMapping> buf = c_->AllocateBuffer(kv.size() * 4);
    ASSERT_TRUE(buf.ok());
    std::memcpy(buf->data(), kv.data(), kv.size() * 4);
    v1::StoreRequest r = StoreRequest(pool, layer, slots, v1::INPUT_DTYPE_FP32);
    *r.mutable_kv() = buf->Slice(0, kv.size() * 4);
    ASSERT_TRUE(c_->Store(r).ok());
    ASSERT_TRUE(Store(local.layout, local.layer(layer), kv.data(),
                      InputDtype::kFP32, slots)
                    .ok());
    ASSERT_TRUE(c_->ReleaseBuffer(buf->id()).ok());
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<KVCacheClient> c_;
  LocalPool swa_, main_;
  std::vector<int32_t> table_;  // 157 compressed blocks
  std::vector<float> chunk_;    // [1024][512], BF16-exact
};

TEST_F(PrefillTest, WorkedExampleMatchesTheReference) {
  const int64_t total_rows = 7620;
  absl::StatusOr<BufferMapping> out =
      c_->AllocateBuffer(total_rows * kRowBytes);
  ASSERT_TRUE(out.ok());
  v1::PrefillLoadRequest r;
  r.set_swa_pool("swa");
  r.set_swa_layer(0);
  r.set_main_pool("main");
  r.set_main_layer(1);
  r.set_num_seqs(1);
  r.set_seqlen_k(Pack({kSeqlenK}));
  r.set_seqlen_q(Pack({kSeqlenQ}));
  r.set_swa_state_id(Pack({kState}));
  r.set_swa_valid_start(Pack({0}));
  r.set_window(kWindow);
  r.set_compress_ratio(kRatio);
  std::vector<int32_t> row = table_;
  row.resize(160, -1);
  r.set_max_blocks_per_seq(160);
  r.set_block_table(Pack(row));
  r.set_dtype(v1::INPUT_DTYPE_BF16);
  *r.mutable_chunk_kv() = InlineData(Bf16Bytes(chunk_));
  *r.mutable_output() = out->Slice(0, total_rows * kRowBytes);
  absl::StatusOr<v1::PrefillLoadResponse> resp = c_->PrefillLoad(r);
  ASSERT_TRUE(resp.ok()) << resp.status();
  EXPECT_EQ(resp->total_k_swa(), 4096);
  EXPECT_EQ(resp->chunk_offset(), 4096);
  EXPECT_EQ(resp->main_kv_offset(), 5120);
  EXPECT_EQ(resp->total_rows(), 7620);
  EXPECT_EQ(resp->swa_segments(), 2);
  EXPECT_EQ(resp->main_segments(), 157);
  EXPECT_EQ(ReadInt32s(resp->cu_compressed()), (std::vector<int32_t>{0, 2500}));

  std::vector<uint8_t> want(static_cast<size_t>(total_rows * kRowBytes), 0);
  // History 4880..8976: ring[784, 4096) -> rows 0.., ring[0, 784) -> 3312.
  const std::vector<int32_t> swa_plan = {kState, 784, 4096, 0,
                                         kState, 0,   784,  3312};
  ASSERT_TRUE(LoadSegments(swa_.layout, swa_.layer(0), swa_plan, 4096,
                           want.data(), nullptr)
                  .ok());
  // Chunk rows: each token stored and loaded back through a one-slot pool.
  LocalPool one;
  one.layout = ComputePoolLayout(swa_.layout.format, 1, 1, 1);
  one.bytes.assign(static_cast<size_t>(one.layout.total_bytes), 0);
  const std::vector<int32_t> slot0 = {0};
  const std::vector<int32_t> seg0 = {0, 0, 1, 0};
  for (int32_t j = 0; j < kSeqlenQ; ++j) {
    ASSERT_TRUE(Store(one.layout, one.layer(0), &chunk_[j * kElements],
                      InputDtype::kFP32, slot0)
                    .ok());
    ASSERT_TRUE(LoadSegments(one.layout, one.layer(0), seg0, 1,
                             want.data() + (4096 + j) * kRowBytes, nullptr)
                    .ok());
  }
  // Compressed: 156 segments of 16 tokens, then 4, dst 0, 16, ..., 2496.
  std::vector<int32_t> main_plan;
  for (int32_t i = 0; i < 157; ++i) {
    main_plan.insert(main_plan.end(), {table_[i], 0, i < 156 ? 16 : 4, 16 * i});
  }
  ASSERT_TRUE(LoadSegments(main_.layout, main_.layer(1), main_plan, 2500,
                           want.data() + 5120 * kRowBytes, nullptr)
                  .ok());
  ASSERT_FALSE(AllZero(want.data(), 4096 * kRowBytes));
  ASSERT_FALSE(AllZero(want.data() + 5120 * kRowBytes, 2500 * kRowBytes));
  for (int64_t row_i = 0; row_i < total_rows; ++row_i) {
    ASSERT_EQ(0, std::memcmp(out->data() + row_i * kRowBytes,
                             want.data() + row_i * kRowBytes, kRowBytes))
        << "row " << row_i;
  }

  // The chunk was stored into the ring after the load: slots 4096 +
  // (8976 + j) mod 4096 (ring positions 784..1807, which the history read).
  std::vector<int32_t> store_slots(kSeqlenQ);
  for (int32_t j = 0; j < kSeqlenQ; ++j) {
    store_slots[j] = kState * kRing + (kSeqlenK - kSeqlenQ + j) % kRing;
  }
  ASSERT_TRUE(Store(swa_.layout, swa_.layer(0), chunk_.data(),
                    InputDtype::kFP32, store_slots)
                  .ok());
  absl::StatusOr<const PoolMapping*> swa_map = c_->MapPool("swa");
  ASSERT_TRUE(swa_map.ok());
  EXPECT_EQ(
      0, std::memcmp((*swa_map)->data(), swa_.bytes.data(), swa_.bytes.size()));
  // Had the store run first, the history rows would differ.
  std::vector<uint8_t> after(static_cast<size_t>(4096 * kRowBytes));
  ASSERT_TRUE(LoadSegments(swa_.layout, swa_.layer(0), swa_plan, 4096,
                           after.data(), nullptr)
                  .ok());
  EXPECT_NE(0, std::memcmp(after.data(), want.data(), after.size()));
}

TEST_F(PrefillTest, IndexRpcsMatchHandComputedRows) {
  // Prefill index: query j at p = 8976 + j sees positions p - 4095 .. p;
  // history position x is row x - 4880, chunk position x is row
  // 4096 + (x - 8976); compressed entries shift by 5120.
  const int64_t topk_k = 3;
  std::vector<int32_t> compressed(kSeqlenQ * topk_k);
  std::mt19937 rng(301);
  std::uniform_int_distribution<int32_t> pick(-1, 2499);
  for (int32_t& x : compressed) x = pick(rng);
  v1::PrefillIndexRequest p;
  p.set_num_seqs(1);
  p.set_seqlen_k(Pack({kSeqlenK}));
  p.set_seqlen_q(Pack({kSeqlenQ}));
  p.set_window(kWindow);
  p.set_compress_ratio(kRatio);
  p.set_topk_k(topk_k);
  p.set_compressed_index(Pack(compressed));
  absl::StatusOr<v1::PrefillIndexResponse> pi = c_->PrefillIndex(p);
  ASSERT_TRUE(pi.ok()) << pi.status();
  EXPECT_EQ(pi->main_kv_offset(), 5120);
  EXPECT_EQ(pi->total_rows(), 7620);
  ASSERT_EQ(pi->row_width(), kWindow + topk_k);
  const std::vector<int32_t> index = ReadInt32s(pi->index());
  ASSERT_EQ(index.size(), static_cast<size_t>(kSeqlenQ * (kWindow + topk_k)));
  for (int32_t j = 0; j < kSeqlenQ; ++j) {
    const int32_t* rowp = &index[j * (kWindow + topk_k)];
    for (int32_t c = 0; c < kWindow; ++c) {
      const int32_t pos = 8976 + j - 4095 + c;
      const int32_t want = pos < 8976 ? pos - 4880 : 4096 + (pos - 8976);
      ASSERT_EQ(rowp[c], want) << "query " << j << " column " << c;
    }
    for (int32_t c = 0; c < topk_k; ++c) {
      const int32_t x = compressed[j * topk_k + c];
      ASSERT_EQ(rowp[kWindow + c], x < 0 ? -1 : x + 5120);
    }
  }

  v1::SwaDecodeIndexRequest w;
  w.set_pool("swa");
  w.set_window(4);
  w.set_num_queries(2);
  w.set_queries(Pack({1, 5000, 3, 0, 4095, 4}));
  absl::StatusOr<v1::SwaDecodeIndexResponse> wi = c_->SwaDecodeIndex(w);
  ASSERT_TRUE(wi.ok()) << wi.status();
  EXPECT_EQ(ReadInt32s(wi->slots()),
            (std::vector<int32_t>{5000, 5001, 5002, -1, 4095, 0, 1, 2}));

  v1::ConvertTopkRequest t;
  t.set_pool("main");
  t.set_batch(1);
  t.set_k(4);
  t.set_topk(Pack({17, -3, 2499, 5}));
  t.set_valid_count(Pack({3}));
  t.set_num_tokens(Pack({2500}));
  t.set_max_blocks_per_seq(157);
  t.set_block_table(Pack(table_));
  absl::StatusOr<v1::ConvertTopkResponse> ti = c_->ConvertTopk(t);
  ASSERT_TRUE(ti.ok()) << ti.status();
  EXPECT_EQ(
      ReadInt32s(ti->slots()),
      (std::vector<int32_t>{table_[1] * 16 + 1, -1, table_[156] * 16 + 3, -1}));
  EXPECT_EQ(ti->invalid_count(), 1);
}

}  // namespace
}  // namespace kvdepot::testing
