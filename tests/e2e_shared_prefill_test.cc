// The cross-layer shared prefill load (SPEC §6, docs/SPEC.md "shared
// compressed cache") end to end on the CPU backend: a source layer's full
// PrefillLoad into a buffer slice, then each consumer layer's
// shared_compressed load into the same slice, must leave exactly the bytes
// a full PrefillLoad of that layer into a fresh buffer returns, and the
// same SWA ring; for block sizes 1, 7 and 133, several windows, ratios,
// formats and consumers. Then every precondition refused (nothing
// written), the compressed rows shown to stay in place (not reloaded), and
// another session's attempts on the buffer refused.
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"
#include "tests/shared_prefill_util.h"

namespace kvdepot::testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kGuard = 96;  // bytes before and after the slice
constexpr uint8_t kFill = 0xA5;

class SharedPrefillTest : public ::testing::TestWithParam<SharedCase> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start();
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    c_ = ConnectOrDie(daemon_->socket_path());
    ASSERT_NE(c_, nullptr);
  }

  void MakeGroup(const SharedCase& sc, uint32_t seed) {
    g_ = SharedGroup::Make(sc, seed);
    ASSERT_TRUE(c_->CreatePool(g_.SwaPool("swa")).ok());
    ASSERT_TRUE(c_->CreatePool(g_.MainPool("main")).ok());
    ASSERT_TRUE(c_->CreatePool(g_.MainPool("main2")).ok());
    absl::Status s = FillGroupPools(*c_, g_, "swa", "main", seed + 1);
    ASSERT_TRUE(s.ok()) << s;
    s = FillGroupPools(*c_, g_, "swa", "main2", seed + 2);  // other K/V
    ASSERT_TRUE(s.ok()) << s;
    chunks_ = GroupChunks(g_, seed + 3);
    absl::StatusOr<BufferMapping> buf =
        c_->AllocateBuffer(2 * kGuard + g_.output_bytes());
    ASSERT_TRUE(buf.ok()) << buf.status();
    buf_.emplace(*std::move(buf));
    std::memset(buf_->data(), kFill, buf_->size());
  }

  // A full PrefillLoad of group layer l's mirror into a fresh inline
  // output: what layer l's shared load must produce.
  std::string Reference(int64_t l) {
    v1::PrefillLoadRequest r = g_.Full("swa", "main", g_.mirror(l));
    r.mutable_chunk_kv()->set_inline_data(chunks_[l]);
    r.mutable_output()->set_inline_output(true);
    absl::StatusOr<v1::PrefillLoadResponse> resp = c_->PrefillLoad(r);
    EXPECT_TRUE(resp.ok()) << "reference of layer " << l << ": "
                           << resp.status();
    return resp.ok() ? resp->output() : std::string();
  }

  v1::PrefillLoadRequest Source() {
    v1::PrefillLoadRequest r = g_.Full("swa", "main", 0);
    r.mutable_chunk_kv()->set_inline_data(chunks_[0]);
    *r.mutable_output() = buf_->Slice(kGuard, g_.output_bytes());
    return r;
  }

  v1::PrefillLoadRequest Consumer(int64_t l) {
    v1::PrefillLoadRequest r = g_.Consumer("swa", "main", l);
    r.mutable_chunk_kv()->set_inline_data(chunks_[l]);
    *r.mutable_output() = buf_->Slice(kGuard, g_.output_bytes());
    return r;
  }

  const uint8_t* Slice() const { return buf_->data() + kGuard; }

  // The SWA pool's bytes now (the daemon's memfd, mapped).
  std::vector<uint8_t> SwaBytes() {
    absl::StatusOr<const PoolMapping*> m = c_->MapPool("swa");
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return {};
    return std::vector<uint8_t>((*m)->data(),
                                (*m)->data() + (*m)->layout().total_bytes());
  }

  void ExpectGuardsUntouched() {
    for (int64_t i = 0; i < kGuard; ++i) {
      ASSERT_EQ(buf_->data()[i], kFill) << "guard byte " << i;
      ASSERT_EQ(buf_->data()[kGuard + g_.output_bytes() + i], kFill)
          << "guard byte after the slice " << i;
    }
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<KVCacheClient> c_;
  SharedGroup g_;
  std::vector<std::string> chunks_;
  std::optional<BufferMapping> buf_;
};

std::string FirstDifferentRow(const uint8_t* want, const uint8_t* got,
                              int64_t rows, int64_t row_bytes) {
  for (int64_t r = 0; r < rows; ++r) {
    if (std::memcmp(want + r * row_bytes, got + r * row_bytes,
                    static_cast<size_t>(row_bytes)) != 0) {
      return "row " + std::to_string(r);
    }
  }
  return "";
}

TEST_P(SharedPrefillTest, EachConsumerEqualsAFullLoadIntoAFreshBuffer) {
  ASSERT_NO_FATAL_FAILURE(MakeGroup(GetParam(), 301));
  const int64_t rb = g_.row_bytes();
  absl::StatusOr<v1::PrefillLoadResponse> src = c_->PrefillLoad(Source());
  ASSERT_TRUE(src.ok()) << src.status();
  ASSERT_EQ(src->total_rows(), g_.total_rows);
  ASSERT_EQ(src->main_kv_offset(), g_.main_kv_offset);
  const std::string want0 = Reference(0);
  ASSERT_EQ(static_cast<int64_t>(want0.size()), g_.output_bytes());
  ASSERT_EQ("",
            FirstDifferentRow(reinterpret_cast<const uint8_t*>(want0.data()),
                              Slice(), g_.total_rows, rb));
  // The compressed rows are real data, so keeping them is a real test.
  ASSERT_FALSE(AllZero(Slice() + g_.main_kv_offset * rb,
                       (g_.total_rows - g_.main_kv_offset) * rb));
  for (int64_t l = 1; l <= g_.c.consumers; ++l) {
    SCOPED_TRACE("consumer layer " + std::to_string(l));
    const std::string want = Reference(l);
    ASSERT_EQ(static_cast<int64_t>(want.size()), g_.output_bytes());
    const auto* w = reinterpret_cast<const uint8_t*>(want.data());
    // The rows the consumer must rewrite differ before it runs.
    ASSERT_NE(0, std::memcmp(w, Slice(), g_.main_kv_offset * rb));
    absl::StatusOr<v1::PrefillLoadResponse> got = c_->PrefillLoad(Consumer(l));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->main_kv_offset(), g_.main_kv_offset);
    EXPECT_EQ(got->total_rows(), g_.total_rows);
    EXPECT_EQ(got->total_k_swa(), 3 * g_.c.window);
    EXPECT_EQ(got->main_segments(), 0) << "a consumer loads no compressed rows";
    EXPECT_GT(got->swa_segments(), 0);
    ASSERT_EQ("", FirstDifferentRow(w, Slice(), g_.total_rows, rb));
    ExpectGuardsUntouched();
    // Its chunk went into its own ring exactly as the full load's did.
    const std::vector<uint8_t> swa = SwaBytes();
    const LocalPool lp = LocalPool::FromInfo(*c_->GetPool("swa"));
    const int64_t layer_bytes = lp.layout.layer_bytes;
    ASSERT_EQ(0, std::memcmp(swa.data() + lp.layout.layer_offset(l),
                             swa.data() + lp.layout.layer_offset(g_.mirror(l)),
                             layer_bytes))
        << "SWA ring of layer " << l << " after the chunk's store";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, SharedPrefillTest,
    ::testing::Values(
        SharedCase{"bs1_r1_w1", "V41", "V41", 512, 1, 1, 1, 1, 2},
        SharedCase{"bs7_r4_w5", "V41", "V41_FP4", 512, 7, 4, 5, 7, 3},
        SharedCase{"bs133_r2_w100", "V41_FP4", "V41", 512, 133, 2, 100, 133, 2},
        SharedCase{"bs7_r3_w64_bf16", "BF16", "BF16", 96, 7, 3, 64, 70, 4},
        SharedCase{"bs133_r1_w133_bf16", "BF16", "BF16", 40, 133, 1, 133, 133,
                   1}),
    [](const ::testing::TestParamInfo<SharedCase>& i) { return i.param.name; });

// One group for the negative tests: block 7, ratio 4, window 5, ring 7.
class SharedPrefillRulesTest : public SharedPrefillTest {
 protected:
  void SetUp() override {
    SharedPrefillTest::SetUp();
    ASSERT_NO_FATAL_FAILURE(
        MakeGroup(SharedCase{"rules", "V41", "V41", 512, 7, 4, 5, 7, 2}, 401));
  }

  // `r` is refused with `code` and a message containing `text`, and
  // neither the buffer nor the SWA pool changed.
  void ExpectRefused(const v1::PrefillLoadRequest& r, absl::StatusCode code,
                     const std::string& text, KVCacheClient* client = nullptr) {
    const std::vector<uint8_t> buf_before(buf_->data(),
                                          buf_->data() + buf_->size());
    const std::vector<uint8_t> swa_before = SwaBytes();
    absl::StatusOr<v1::PrefillLoadResponse> got =
        (client == nullptr ? c_.get() : client)->PrefillLoad(r);
    ASSERT_FALSE(got.ok()) << "accepted; wanted " << text;
    EXPECT_EQ(got.status().code(), code) << got.status();
    EXPECT_THAT(std::string(got.status().message()), HasSubstr(text));
    EXPECT_EQ(0, std::memcmp(buf_before.data(), buf_->data(), buf_->size()))
        << "the buffer changed";
    EXPECT_TRUE(swa_before == SwaBytes()) << "the SWA pool changed";
  }
};

TEST_F(SharedPrefillRulesTest, NoSourceLoadIsRefused) {
  ExpectRefused(Consumer(1), absl::StatusCode::kFailedPrecondition,
                "no full PrefillLoad into output buffer");
  // A failed source load records nothing either.
  v1::PrefillLoadRequest bad = Source();
  std::vector<int32_t> table = g_.block_table;
  table[0] = static_cast<int32_t>(g_.main_blocks);  // out of range
  bad.set_block_table(Pack(table));
  EXPECT_FALSE(c_->PrefillLoad(bad).ok());
  ExpectRefused(Consumer(1), absl::StatusCode::kFailedPrecondition,
                "no full PrefillLoad");
}

TEST_F(SharedPrefillRulesTest, EveryPreconditionIsCheckedAndNothingWritten) {
  ASSERT_TRUE(c_->PrefillLoad(Source()).ok());
  const auto code = absl::StatusCode::kFailedPrecondition;
  {  // Another slice of the same buffer.
    v1::PrefillLoadRequest r = Consumer(1);
    *r.mutable_output() = buf_->Slice(kGuard - 16, g_.output_bytes());
    ExpectRefused(r, code, "at offset 80 is recorded");
  }
  {  // seqlen_k: same rows (100 and 101 give 25 compressed rows at R 4).
    v1::PrefillLoadRequest r = Consumer(1);
    std::vector<int32_t> k = g_.seqlen_k;
    k[0] += 1;
    ASSERT_EQ(k[0] / 4, g_.seqlen_k[0] / 4);
    r.set_seqlen_k(Pack(k));
    ExpectRefused(r, code, "seqlen_k[0] = ");
  }
  {  // seqlen_q: the same sum.
    v1::PrefillLoadRequest r = Consumer(1);
    std::vector<int32_t> q = g_.seqlen_q;
    q[0] -= 1;
    q[2] += 1;
    r.set_seqlen_q(Pack(q));
    ExpectRefused(r, code, "seqlen_q[0] = ");
  }
  {  // swa_valid_start (empty = zeros, and the source's [2] is 2).
    v1::PrefillLoadRequest r = Consumer(1);
    r.clear_swa_valid_start();
    ExpectRefused(r, code, "swa_valid_start[2] = 0");
  }
  {  // window: the slice sized for the other window.
    v1::PrefillLoadRequest r = Consumer(1);
    r.set_window(4);
    *r.mutable_output() =
        buf_->Slice(kGuard, g_.output_bytes() - 3 * g_.row_bytes());
    ExpectRefused(r, code, "window = 4");
  }
  {  // compress_ratio: the slice sized for ratio 8 (fewer rows).
    v1::PrefillLoadRequest r = Consumer(1);
    r.set_compress_ratio(8);
    int64_t rows = g_.main_kv_offset;
    for (int32_t k : g_.seqlen_k) rows += std::max(k / 8, 1);
    ASSERT_LT(rows, g_.total_rows);
    *r.mutable_output() = buf_->Slice(kGuard, rows * g_.row_bytes());
    ExpectRefused(r, code, "compress_ratio = 8");
  }
  {  // main_layer.
    v1::PrefillLoadRequest r = Consumer(1);
    r.set_main_layer(0);
    ExpectRefused(r, code, "main_layer = 0");
  }
  {  // Another main pool of the same shape.
    v1::PrefillLoadRequest r = Consumer(1);
    r.set_main_pool("main2");
    ExpectRefused(r, code, "main_pool = \"main2\"");
  }
  {  // Not a consumer request: a block table, inline output, CPU events.
    v1::PrefillLoadRequest r = Consumer(1);
    r.set_max_blocks_per_seq(g_.max_blocks);
    r.set_block_table(Pack(g_.block_table));
    ExpectRefused(r, absl::StatusCode::kInvalidArgument, "block_table");
    r = Consumer(1);
    r.set_max_blocks_per_seq(3);
    ExpectRefused(r, absl::StatusCode::kInvalidArgument, "max_blocks_per_seq");
    r = Consumer(1);
    r.mutable_output()->set_inline_output(true);
    ExpectRefused(r, absl::StatusCode::kInvalidArgument,
                  "inline_output has no source");
    r = Consumer(1);
    r.set_wait_event_ipc_handle(std::string(64, 'x'));
    ExpectRefused(r, absl::StatusCode::kInvalidArgument,
                  "wait_event_ipc_handle");
  }
  // After all that the right consumer still works.
  EXPECT_TRUE(c_->PrefillLoad(Consumer(1)).ok());
}

TEST_F(SharedPrefillRulesTest, RecreatedPoolAndOverwrittenSliceAreRefused) {
  ASSERT_TRUE(c_->PrefillLoad(Source()).ok());
  // A full load into an overlapping slice replaces the record.
  v1::PrefillLoadRequest other = Source();
  *other.mutable_output() = buf_->Slice(kGuard - 32, g_.output_bytes());
  ASSERT_TRUE(c_->PrefillLoad(other).ok());
  ExpectRefused(Consumer(1), absl::StatusCode::kFailedPrecondition,
                "no full PrefillLoad");
  // The main pool deleted and re-created under its name after the source.
  std::memset(buf_->data(), kFill, buf_->size());
  ASSERT_TRUE(c_->PrefillLoad(Source()).ok());
  ASSERT_TRUE(c_->DeletePool("main").ok());
  ASSERT_TRUE(c_->CreatePool(g_.MainPool("main")).ok());
  ExpectRefused(Consumer(1), absl::StatusCode::kFailedPrecondition,
                "since deleted");
}

TEST_F(SharedPrefillRulesTest, CompressedRowsStayInPlace) {
  ASSERT_TRUE(c_->PrefillLoad(Source()).ok());
  const int64_t rb = g_.row_bytes();
  const std::vector<uint8_t> source(Slice(), Slice() + g_.output_bytes());
  // New K/V in the main pool after the source load: a consumer that
  // reloaded the compressed rows would pick them up.
  ASSERT_TRUE(FillGroupPools(*c_, g_, "swa", "main", 999).ok());
  ASSERT_TRUE(c_->PrefillLoad(Consumer(1)).ok());
  EXPECT_EQ(0, std::memcmp(source.data() + g_.main_kv_offset * rb,
                           Slice() + g_.main_kv_offset * rb,
                           (g_.total_rows - g_.main_kv_offset) * rb))
      << "the compressed rows must be the source's";
  const std::string fresh = Reference(1);
  EXPECT_NE(0, std::memcmp(fresh.data() + g_.main_kv_offset * rb,
                           Slice() + g_.main_kv_offset * rb,
                           (g_.total_rows - g_.main_kv_offset) * rb))
      << "the main pool's new K/V must differ (else this proves nothing)";
}

TEST_F(SharedPrefillRulesTest, AnotherSessionCannotUseTheSlice) {
  ASSERT_TRUE(c_->PrefillLoad(Source()).ok());
  std::unique_ptr<KVCacheClient> b = ConnectOrDie(daemon_->socket_path());
  ASSERT_NE(b, nullptr);
  // Pools are granted to B, the buffer is not: refused on the buffer, and
  // the answer says nothing about a recorded source.
  for (const char* pool : {"swa", "main"}) {
    v1::GrantRequest g;
    g.set_pool(pool);
    g.add_sessions(b->session_number());
    ASSERT_TRUE(c_->Grant(g).ok());
  }
  v1::PrefillLoadRequest r = Consumer(1);
  ExpectRefused(r, absl::StatusCode::kPermissionDenied, "output", b.get());
  // Once the owner grants the buffer, B may run the consumer layer.
  v1::GrantRequest g;
  g.set_buffer_id(buf_->id());
  g.add_sessions(b->session_number());
  ASSERT_TRUE(c_->Grant(g).ok());
  absl::StatusOr<v1::PrefillLoadResponse> got = b->PrefillLoad(r);
  EXPECT_TRUE(got.ok()) << got.status();
  const std::string want = Reference(1);
  EXPECT_EQ(0, std::memcmp(want.data(), Slice(), g_.output_bytes()));
}

}  // namespace
}  // namespace kvdepot::testing
