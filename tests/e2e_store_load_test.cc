// End to end: a kvdepotd process on a temporary socket; a client stores
// tokens through a shared buffer and through inline bytes, loads them back
// by explicit segments and by block tables, and every byte is checked
// against the CPU reference run on a local copy of the pool.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"

namespace kvdepot::testing {
namespace {

class StoreLoadTest
    : public ::testing::TestWithParam<std::tuple<std::string, int64_t>> {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start();
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = d->release();
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  static DaemonProcess* daemon_;
};

DaemonProcess* StoreLoadTest::daemon_ = nullptr;

TEST_P(StoreLoadTest, StoreAndLoadMatchTheReferenceByteForByte) {
  const auto& [format, block_size] = GetParam();
  std::mt19937 rng(301);
  std::unique_ptr<KVCacheClient> c = ConnectOrDie(daemon_->socket_path());
  ASSERT_NE(c, nullptr);
  const int64_t num_blocks = 9;
  const std::string name =
      absl::StrCat("p", block_size, "-", format == "BF16" ? "BF16" : format);
  absl::StatusOr<v1::PoolInfo> info = c->CreatePool(PoolRequest(
      name, format, format == "BF16" ? 64 : 0, block_size, num_blocks, 2));
  ASSERT_TRUE(info.ok()) << info.status();
  LocalPool local = LocalPool::FromInfo(*info);
  const PoolLayout& layout = local.layout;
  const int64_t e = layout.format.elements();
  absl::StatusOr<const PoolMapping*> mapped = c->MapPool(name);
  ASSERT_TRUE(mapped.ok()) << mapped.status();

  // Slots: a random subset of the pool, with -1 padding mixed in.
  std::vector<int32_t> all(static_cast<size_t>(layout.num_slots()));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  const int64_t n = std::min<int64_t>(layout.num_slots(), 40);
  std::vector<int32_t> slots(all.begin(), all.begin() + n);
  slots.insert(slots.begin() + n / 2, -1);
  slots.push_back(-1);
  const int64_t tokens = static_cast<int64_t>(slots.size());
  const std::vector<float> kv = RandomKv(tokens, e, rng);

  // Layer 1 through a shared buffer (FP32), layer 0 inline (BF16).
  absl::StatusOr<BufferMapping> buf = c->AllocateBuffer(tokens * e * 4);
  ASSERT_TRUE(buf.ok()) << buf.status();
  std::memcpy(buf->data(), kv.data(), kv.size() * 4);
  v1::StoreRequest s1 = StoreRequest(name, 1, slots, v1::INPUT_DTYPE_FP32);
  *s1.mutable_kv() = buf->Slice(0, tokens * e * 4);
  absl::StatusOr<v1::StoreResponse> r1 = c->Store(s1);
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_EQ(r1->tokens_written(), n);
  v1::StoreRequest s0 = StoreRequest(name, 0, slots, v1::INPUT_DTYPE_BF16);
  *s0.mutable_kv() = InlineData(Bf16Bytes(kv));
  ASSERT_TRUE(c->Store(s0).ok());

  ASSERT_TRUE(
      Store(layout, local.layer(1), kv.data(), InputDtype::kFP32, slots).ok());
  const std::vector<float> kv_bf16 = Bf16Values(kv);
  ASSERT_TRUE(
      Store(layout, local.layer(0), kv_bf16.data(), InputDtype::kFP32, slots)
          .ok());
  ASSERT_FALSE(AllZero(local.bytes.data(), layout.total_bytes));
  ASSERT_EQ(0, std::memcmp((*mapped)->data(), local.bytes.data(),
                           static_cast<size_t>(layout.total_bytes)));

  // Load by explicit segments into a buffer prefilled with a pattern: rows
  // no segment covers keep it.
  std::vector<int32_t> segs;
  int32_t dst = 2;  // rows 0, 1 stay uncovered
  std::uniform_int_distribution<int32_t> pos(0,
                                             static_cast<int32_t>(block_size));
  for (int32_t b = static_cast<int32_t>(num_blocks) - 1; b >= -1; --b) {
    int32_t lo = pos(rng), hi = pos(rng);
    if (lo > hi) std::swap(lo, hi);
    segs.insert(segs.end(), {b, lo, hi, dst});
    dst += hi - lo;
  }
  const int64_t total_k = dst + 3;
  const int64_t data_row = LoadDataRowBytes(layout.format);
  const int64_t scale_row =
      layout.format.do_cast ? 0 : LoadScaleRowBytes(layout.format);
  const int64_t out_bytes = total_k * (data_row + scale_row);
  absl::StatusOr<BufferMapping> out = c->AllocateBuffer(out_bytes);
  ASSERT_TRUE(out.ok()) << out.status();
  std::memset(out->data(), 0xA5, static_cast<size_t>(out_bytes));
  std::vector<uint8_t> expected(static_cast<size_t>(out_bytes), 0xA5);
  for (int64_t layer : {0, 1}) {
    v1::LoadRequest lr;
    lr.set_pool(name);
    lr.set_layer(layer);
    *lr.mutable_segments() = SegmentsProto(segs, total_k);
    *lr.mutable_data() = out->Slice(0, total_k * data_row);
    if (scale_row > 0)
      *lr.mutable_scales() =
          out->Slice(total_k * data_row, total_k * scale_row);
    absl::StatusOr<v1::LoadResponse> loaded = c->Load(lr);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    ASSERT_TRUE(
        LoadSegments(
            layout, local.layer(layer), segs, total_k, expected.data(),
            scale_row > 0 ? expected.data() + total_k * data_row : nullptr)
            .ok());
    ASSERT_EQ(0, std::memcmp(out->data(), expected.data(), expected.size()))
        << "layer " << layer;
  }

  // Load by block tables (two sequences; ratio 1 and 2), inline output.
  // Expected rows come from one reference segment per token.
  for (int32_t ratio : {1, 2}) {
    const std::vector<int32_t> table = {
        all[0] % static_cast<int32_t>(num_blocks), 4, 7, 2, 8, 0};
    const int32_t max_blocks = 3;
    const std::vector<int32_t> seqlen_k = {
        static_cast<int32_t>(3 * block_size * ratio),
        static_cast<int32_t>(block_size * ratio + 1)};
    v1::LoadRequest lr;
    lr.set_pool(name);
    lr.set_layer(1);
    v1::SequencePlan* sp = lr.mutable_sequences();
    sp->set_num_seqs(2);
    sp->set_seqlen_k(Pack(seqlen_k));
    sp->set_max_blocks_per_seq(max_blocks);
    sp->set_block_table(Pack(table));
    sp->set_compress_ratio(ratio);
    *lr.mutable_data() = InlineOutput();
    if (scale_row > 0) *lr.mutable_scales() = InlineOutput();
    absl::StatusOr<v1::LoadResponse> loaded = c->Load(lr);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    std::vector<int32_t> per_token;
    int32_t row = 0;
    for (int b = 0; b < 2; ++b) {
      const int32_t rows = std::max(seqlen_k[b] / ratio, 1);
      for (int32_t t = 0; t < rows; ++t) {
        const int32_t blk = table[b * max_blocks + t / block_size];
        const int32_t off = static_cast<int32_t>(t % block_size);
        per_token.insert(per_token.end(), {blk, off, off + 1, row++});
      }
    }
    ASSERT_EQ(loaded->total_k(), row);
    std::vector<uint8_t> want(static_cast<size_t>(row * (data_row + scale_row)),
                              0);
    ASSERT_TRUE(
        LoadSegments(layout, local.layer(1), per_token, row, want.data(),
                     scale_row > 0 ? want.data() + row * data_row : nullptr)
            .ok());
    ASSERT_FALSE(AllZero(want.data(), static_cast<int64_t>(want.size())));
    ASSERT_EQ(loaded->data().size(), static_cast<size_t>(row * data_row));
    EXPECT_EQ(0,
              std::memcmp(loaded->data().data(), want.data(), row * data_row))
        << "ratio " << ratio;
    if (scale_row > 0) {
      ASSERT_EQ(loaded->scales().size(), static_cast<size_t>(row * scale_row));
      EXPECT_EQ(0, std::memcmp(loaded->scales().data(),
                               want.data() + row * data_row, row * scale_row));
    }
    EXPECT_EQ(ReadInt32s(loaded->cu_rows()),
              (std::vector<int32_t>{0, seqlen_k[0] / ratio, row}));
  }
  ASSERT_TRUE(c->ReleaseBuffer(buf->id()).ok());
  ASSERT_TRUE(c->DeletePool(name).ok());
}

// A client-owned memfd handed over as a buffer; pools created or opened
// by name; mappings opened once.
TEST(ClientTest, ImportedBuffersPoolReuseAndCachedMappings) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start();
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<KVCacheClient> c = ConnectOrDie((*d)->socket_path());
  ASSERT_NE(c, nullptr);
  const v1::CreatePoolRequest req = PoolRequest("m", "V41_FP4", 0, 7, 3, 1);
  absl::StatusOr<v1::PoolInfo> a = c->CreateOrGetPool(req);
  absl::StatusOr<v1::PoolInfo> b = c->CreateOrGetPool(req);
  ASSERT_TRUE(a.ok() && b.ok());
  // Get/List never carry memory handles (SPEC §11).
  EXPECT_FALSE(a->has_handle());
  EXPECT_FALSE(b->has_handle());
  absl::Status other =
      c->CreateOrGetPool(PoolRequest("m", "V41_FP4", 0, 7, 4, 1)).status();
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(other.message()),
              ::testing::HasSubstr("exists with another layout"));
  absl::StatusOr<const PoolMapping*> m1 = c->MapPool("m");
  absl::StatusOr<const PoolMapping*> m2 = c->MapPool("m");
  ASSERT_TRUE(m1.ok() && m2.ok());
  EXPECT_EQ(*m1, *m2);

  std::mt19937 rng(301);
  const std::vector<float> kv = RandomKv(5, 512, rng);
  absl::StatusOr<MemfdRegion> mine =
      MemfdRegion::Create("mine", kv.size() * 4 + 64);
  ASSERT_TRUE(mine.ok());
  std::memcpy(mine->data() + 64, kv.data(), kv.size() * 4);
  absl::StatusOr<v1::BufferInfo> imported = c->ImportBuffer(*mine);
  ASSERT_TRUE(imported.ok()) << imported.status();
  const std::vector<int32_t> slots = {20, 0, -1, 13, 6};
  v1::StoreRequest r = StoreRequest("m", 0, slots, v1::INPUT_DTYPE_FP32);
  v1::BufferSlice* slice = r.mutable_kv()->mutable_slice();
  slice->set_buffer_id(imported->buffer_id());
  slice->set_offset(64);
  slice->set_length(static_cast<int64_t>(kv.size()) * 4);
  ASSERT_TRUE(c->Store(r).ok());
  LocalPool local = LocalPool::FromInfo(*a);
  ASSERT_TRUE(
      Store(local.layout, local.layer(0), kv.data(), InputDtype::kFP32, slots)
          .ok());
  ASSERT_FALSE(AllZero(local.bytes.data(), local.layout.total_bytes));
  EXPECT_EQ(0,
            std::memcmp((*m1)->data(), local.bytes.data(), local.bytes.size()));
  // Releasing an import unmaps it on the daemon side only: ours survives.
  ASSERT_TRUE(c->ReleaseBuffer(imported->buffer_id()).ok());
  EXPECT_EQ(0, std::memcmp(mine->data() + 64, kv.data(), kv.size() * 4));
}

INSTANTIATE_TEST_SUITE_P(
    Formats, StoreLoadTest,
    ::testing::Values(std::make_tuple("V41", 17), std::make_tuple("V41", 1),
                      std::make_tuple("V41_FP4", 3),
                      std::make_tuple("FP4_INDEX", 133),
                      std::make_tuple("FP8_FP32SF_INDEX", 7),
                      std::make_tuple("MXFP8_INDEX", 64),
                      std::make_tuple("BF16", 3)));

}  // namespace
}  // namespace kvdepot::testing
