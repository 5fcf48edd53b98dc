// End to end on the CPU backend: the buffer forms of the index RPCs
// (SPEC §7, §9; kvdepot.proto). ConvertTopk, SwaDecodeIndex and
// PrefillIndex read their device-side arrays from, and write their outputs
// to, shared buffers (memfds here; device memory on the CUDA backend, which
// //tests/gpu:cuda_index_test compares with these same semantics). Results
// equal the inline form and the planner run here; entries read from a
// buffer that are out of range become -1 and are counted (also into an
// invalid_count_buffer word). Every new field has a negative test, and
// someone else's buffer is refused without a byte written.
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/plan.h"
#include "proto/wire.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"
#include "tests/index_cases.h"

namespace kvdepot::testing {
namespace {

using ::testing::HasSubstr;

#define EXPECT_REJECTED(expr, want_code, substr)                     \
  do {                                                               \
    const absl::Status _s = (expr).status();                         \
    EXPECT_EQ(_s.code(), absl::StatusCode::want_code) << _s;         \
    EXPECT_THAT(std::string(_s.message()), HasSubstr(substr)) << _s; \
  } while (0)

constexpr int64_t kBufferBytes = 1 << 20;
constexpr uint8_t kFill = 0x5A;  // output bytes before a call
constexpr int32_t kNumBlocks = 40;

v1::BufferSlice Slice(uint64_t id, int64_t offset, int64_t length) {
  v1::BufferSlice s;
  s.set_buffer_id(id);
  s.set_offset(offset);
  s.set_length(length);
  return s;
}

std::vector<int32_t> ReadAt(const BufferMapping& b, int64_t offset, int64_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::memcpy(v.data(), b.data() + offset, static_cast<size_t>(n * 4));
  return v;
}

void WriteAt(const BufferMapping& b, int64_t offset,
             const std::vector<int32_t>& v) {
  std::memcpy(b.data() + offset, v.data(), v.size() * 4);
}

int64_t WordAt(const BufferMapping& b, int64_t offset) {
  int64_t v = 0;
  std::memcpy(&v, b.data() + offset, 8);
  return v;
}

TopkCase SmallTopk(int32_t block_size, std::mt19937& rng) {
  return RandomTopk(block_size, kNumBlocks, 7, 33, 9, rng);
}

std::vector<int32_t> Expected(const TopkCase& c, int64_t* invalid) {
  return ExpectedSlots(c, invalid);
}

class IndexBuffersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start();
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    c_ = ConnectOrDie(daemon_->socket_path());
    other_ = ConnectOrDie(daemon_->socket_path());
    ASSERT_NE(c_, nullptr);
    ASSERT_NE(other_, nullptr);
    for (int32_t bs : {1, 7, 133}) {
      ASSERT_TRUE(c_->CreatePool(PoolRequest(absl::StrCat("main", bs), "V41", 0,
                                             bs, kNumBlocks, 1))
                      .ok());
    }
    ASSERT_TRUE(c_->CreatePool(PoolRequest("swa", "V41", 0, 8, 4, 1)).ok());
    absl::StatusOr<BufferMapping> mine = c_->AllocateBuffer(kBufferBytes);
    absl::StatusOr<BufferMapping> theirs = other_->AllocateBuffer(kBufferBytes);
    ASSERT_TRUE(mine.ok() && theirs.ok());
    buf_ = std::make_unique<BufferMapping>(*std::move(mine));
    their_ = std::make_unique<BufferMapping>(*std::move(theirs));
    std::memset(buf_->data(), kFill, kBufferBytes);
    std::memset(their_->data(), kFill, kBufferBytes);
  }

  v1::ConvertTopkRequest Inline(const TopkCase& c) const {
    v1::ConvertTopkRequest r;
    r.set_pool(absl::StrCat("main", c.block_size));
    r.set_batch(c.batch);
    r.set_k(c.k);
    r.set_topk(Pack(c.topk));
    r.set_valid_count(Pack(c.valid));
    r.set_num_tokens(Pack(c.tokens));
    r.set_max_blocks_per_seq(c.cols);
    r.set_block_table(Pack(c.table));
    return r;
  }

  // The buffer form: topk at `topk_at`, the table at 64 KiB, the slots at
  // `slots_at` (== topk_at: in place), the word at 128 KiB.
  v1::ConvertTopkRequest InBuffers(const TopkCase& c, int64_t topk_at,
                                   int64_t slots_at) const {
    v1::ConvertTopkRequest r = Inline(c);
    const int64_t bytes = c.batch * c.k * 4;
    WriteAt(*buf_, topk_at, c.topk);
    WriteAt(*buf_, 64 << 10, c.table);
    r.clear_topk();
    r.clear_block_table();
    *r.mutable_topk_buffer() = Slice(buf_->id(), topk_at, bytes);
    *r.mutable_block_table_buffer() =
        Slice(buf_->id(), 64 << 10, c.batch * c.cols * 4);
    *r.mutable_slots_buffer() = Slice(buf_->id(), slots_at, bytes);
    *r.mutable_invalid_count_buffer() = Slice(buf_->id(), 128 << 10, 8);
    return r;
  }

  bool Untouched(const BufferMapping& b, int64_t offset, int64_t n) const {
    for (int64_t i = 0; i < n; ++i) {
      if (b.data()[offset + i] != kFill) return false;
    }
    return true;
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<KVCacheClient> c_, other_;
  std::unique_ptr<BufferMapping> buf_, their_;
};

TEST_F(IndexBuffersTest, ConvertTopkBufferFormsEqualInlineAndPlanner) {
  std::mt19937 rng(301);
  for (int32_t bs : {1, 7, 133}) {
    SCOPED_TRACE(absl::StrCat("block_size ", bs));
    const TopkCase c = SmallTopk(bs, rng);
    int64_t invalid = 0;
    const std::vector<int32_t> want = Expected(c, &invalid);
    int64_t valid_slots = 0;
    for (int32_t s : want) valid_slots += s >= 0 ? 1 : 0;
    ASSERT_GT(valid_slots, 0) << "the case must convert something";
    ASSERT_GT(invalid, 0) << "the case must hold out-of-range entries";
    const int64_t n = c.batch * c.k;

    absl::StatusOr<v1::ConvertTopkResponse> in = c_->ConvertTopk(Inline(c));
    ASSERT_TRUE(in.ok()) << in.status();
    EXPECT_EQ(ReadInt32s(in->slots()), want);
    EXPECT_EQ(in->invalid_count(), invalid);

    // In place, at a 4-byte but not 16-byte aligned offset.
    absl::StatusOr<v1::ConvertTopkResponse> ip =
        c_->ConvertTopk(InBuffers(c, 4100, 4100));
    ASSERT_TRUE(ip.ok()) << ip.status();
    EXPECT_TRUE(ip->slots().empty());
    EXPECT_EQ(ip->invalid_count(), invalid);
    EXPECT_EQ(ReadAt(*buf_, 4100, n), want);
    EXPECT_EQ(WordAt(*buf_, 128 << 10), invalid);

    // Into another slice; the input stays as it was.
    std::memset(buf_->data() + (128 << 10), kFill, 8);
    absl::StatusOr<v1::ConvertTopkResponse> sep =
        c_->ConvertTopk(InBuffers(c, 0, 32 << 10));
    ASSERT_TRUE(sep.ok()) << sep.status();
    EXPECT_EQ(ReadAt(*buf_, 32 << 10, n), want);
    EXPECT_EQ(ReadAt(*buf_, 0, n), c.topk);
    EXPECT_EQ(WordAt(*buf_, 128 << 10), invalid);

    // topk from a buffer, the slots inline; the table inline.
    v1::ConvertTopkRequest mixed = InBuffers(c, 0, 0);
    mixed.clear_slots_buffer();
    mixed.clear_block_table_buffer();
    mixed.set_block_table(Pack(c.table));
    absl::StatusOr<v1::ConvertTopkResponse> mx = c_->ConvertTopk(mixed);
    ASSERT_TRUE(mx.ok()) << mx.status();
    EXPECT_EQ(ReadInt32s(mx->slots()), want);
    EXPECT_EQ(mx->invalid_count(), invalid);
  }
}

TEST_F(IndexBuffersTest, ConvertTopkRejectsEveryBadBufferField) {
  std::mt19937 rng(302);
  const TopkCase c = SmallTopk(7, rng);
  const int64_t bytes = c.batch * c.k * 4;
  const int64_t slots_at = 32 << 10;
  auto check_untouched = [&] {
    EXPECT_TRUE(Untouched(*buf_, slots_at, bytes)) << "slots written";
    EXPECT_TRUE(Untouched(*buf_, 128 << 10, 8)) << "word written";
    EXPECT_TRUE(Untouched(*their_, 0, kBufferBytes)) << "their buffer";
  };
  v1::ConvertTopkRequest r = InBuffers(c, 0, slots_at);
  r.set_topk(Pack(c.topk));
  EXPECT_REJECTED(c_->ConvertTopk(r), kInvalidArgument, "not both");
  r = InBuffers(c, 0, slots_at);
  r.set_block_table(Pack(c.table));
  EXPECT_REJECTED(c_->ConvertTopk(r), kInvalidArgument, "block_table holds");
  r = InBuffers(c, 0, slots_at);
  r.mutable_topk_buffer()->set_length(bytes - 4);
  EXPECT_REJECTED(c_->ConvertTopk(r), kInvalidArgument, "topk_buffer.length");
  r = InBuffers(c, 0, slots_at);
  r.mutable_block_table_buffer()->set_offset(kBufferBytes - 8);
  EXPECT_REJECTED(c_->ConvertTopk(r), kInvalidArgument,
                  "block_table_buffer [offset");
  r = InBuffers(c, 0, slots_at);
  r.mutable_slots_buffer()->set_offset(-4);
  EXPECT_REJECTED(c_->ConvertTopk(r), kInvalidArgument, "slots_buffer [offset");
  r = InBuffers(c, 0, slots_at);
  r.mutable_invalid_count_buffer()->set_length(4);
  EXPECT_REJECTED(c_->ConvertTopk(r), kInvalidArgument,
                  "invalid_count_buffer.length = 4");
  r = InBuffers(c, 0, slots_at);
  r.mutable_slots_buffer()->set_buffer_id(999999);
  EXPECT_REJECTED(c_->ConvertTopk(r), kNotFound, "slots_buffer.buffer_id");
  // Overlaps: slots partly over topk, over the table, the word over slots.
  r = InBuffers(c, 0, 4);
  EXPECT_REJECTED(c_->ConvertTopk(r), kInvalidArgument, "overlaps topk_buffer");
  r = InBuffers(c, 0, slots_at);
  r.mutable_slots_buffer()->set_offset((64 << 10) - 4);
  EXPECT_REJECTED(c_->ConvertTopk(r), kInvalidArgument,
                  "overlaps block_table_buffer");
  r = InBuffers(c, 0, slots_at);
  r.mutable_invalid_count_buffer()->set_offset(slots_at + 8);
  EXPECT_REJECTED(c_->ConvertTopk(r), kInvalidArgument, "slots_buffer [32768");
  // In place but with a table overlapping the (in-place) output.
  r = InBuffers(c, 64 << 10, 64 << 10);
  EXPECT_REJECTED(c_->ConvertTopk(r), kInvalidArgument,
                  "overlaps block_table_buffer");
  // GPU ordering on the CPU backend.
  r = InBuffers(c, 0, slots_at);
  r.set_record_event(true);
  EXPECT_REJECTED(c_->ConvertTopk(r), kInvalidArgument,
                  "GPU ordering needs the cuda backend");
  r = InBuffers(c, 0, slots_at);
  r.set_wait_event_ipc_handle(std::string(64, 'x'));
  EXPECT_REJECTED(c_->ConvertTopk(r), kInvalidArgument,
                  "wait_event_ipc_handle");
  // Host-side arrays are still checked on the host.
  r = InBuffers(c, 0, slots_at);
  std::vector<int32_t> valid = c.valid;
  valid[3] = c.k + 1;
  r.set_valid_count(Pack(valid));
  EXPECT_REJECTED(c_->ConvertTopk(r), kInvalidArgument, "valid_count[3] = 34");
  std::memset(buf_->data() + slots_at, kFill, bytes);
  check_untouched();

  // Attacks: another session's buffer as input or output.
  for (int field = 0; field < 4; ++field) {
    r = InBuffers(c, 0, slots_at);
    v1::BufferSlice* s = field == 0   ? r.mutable_topk_buffer()
                         : field == 1 ? r.mutable_block_table_buffer()
                         : field == 2 ? r.mutable_slots_buffer()
                                      : r.mutable_invalid_count_buffer();
    s->set_buffer_id(their_->id());
    EXPECT_REJECTED(c_->ConvertTopk(r), kPermissionDenied,
                    "belongs to another session");
  }
  check_untouched();

  // Once granted, the other session's buffer is usable (the refusal above
  // is the access list, not a refusal of every foreign buffer).
  v1::GrantRequest g;
  g.set_buffer_id(their_->id());
  g.add_sessions(c_->session_number());
  ASSERT_TRUE(other_->Grant(g).ok());
  r = InBuffers(c, 0, slots_at);
  r.mutable_slots_buffer()->set_buffer_id(their_->id());
  r.mutable_slots_buffer()->set_offset(0);
  absl::StatusOr<v1::ConvertTopkResponse> granted = c_->ConvertTopk(r);
  ASSERT_TRUE(granted.ok()) << granted.status();
  int64_t invalid = 0;
  EXPECT_EQ(ReadAt(*their_, 0, c.batch * c.k), Expected(c, &invalid));
  EXPECT_EQ(granted->invalid_count(), invalid);
}

TEST_F(IndexBuffersTest, SwaDecodeIndexIntoABuffer) {
  v1::SwaDecodeIndexRequest r;
  r.set_pool("swa");
  r.set_window(4);
  r.set_num_queries(3);
  r.set_queries(Pack({1, 5000, 3, 0, 4095, 4, 3, 6, 0}));
  absl::StatusOr<v1::SwaDecodeIndexResponse> in = c_->SwaDecodeIndex(r);
  ASSERT_TRUE(in.ok()) << in.status();
  const std::vector<int32_t> want = ReadInt32s(in->slots());
  ASSERT_EQ(want,
            (std::vector<int32_t>{8, 9, 10, -1, 7, 0, 1, 2, -1, -1, -1, -1}));
  *r.mutable_slots_buffer() = Slice(buf_->id(), 12, 48);
  absl::StatusOr<v1::SwaDecodeIndexResponse> out = c_->SwaDecodeIndex(r);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->slots().empty());
  EXPECT_EQ(ReadAt(*buf_, 12, 12), want);
  EXPECT_TRUE(Untouched(*buf_, 0, 12));
  EXPECT_TRUE(Untouched(*buf_, 60, 4));

  std::memset(buf_->data(), kFill, 64);
  v1::SwaDecodeIndexRequest bad = r;
  bad.mutable_slots_buffer()->set_length(44);
  EXPECT_REJECTED(c_->SwaDecodeIndex(bad), kInvalidArgument,
                  "slots_buffer.length = 44");
  bad = r;
  bad.mutable_slots_buffer()->set_offset(kBufferBytes - 40);
  EXPECT_REJECTED(c_->SwaDecodeIndex(bad), kInvalidArgument,
                  "slots_buffer [offset");
  bad = r;
  bad.set_record_event(true);
  EXPECT_REJECTED(c_->SwaDecodeIndex(bad), kInvalidArgument,
                  "GPU ordering needs the cuda backend");
  bad = r;
  bad.set_queries(Pack({4, 0, 1, 0, 0, 0, 0, 0, 0}));  // state 4 of 4
  EXPECT_REJECTED(c_->SwaDecodeIndex(bad), kInvalidArgument, "state");
  bad = r;
  bad.mutable_slots_buffer()->set_buffer_id(their_->id());
  EXPECT_REJECTED(c_->SwaDecodeIndex(bad), kPermissionDenied,
                  "belongs to another session");
  EXPECT_TRUE(Untouched(*buf_, 0, 64));
  EXPECT_TRUE(Untouched(*their_, 0, kBufferBytes));
}

// PrefillIndex of two sequences: the compressed index from a buffer with
// entries out of range (-1 and counted), the index into a buffer.
TEST_F(IndexBuffersTest, PrefillIndexBufferFormsCountOutOfRangeEntries) {
  const std::vector<int32_t> seqlen_k = {40, 13}, seqlen_q = {5, 13};
  constexpr int32_t kWin = 6, kRatio = 4, kTopk = 5;
  const int64_t rows = 18;
  SequenceBatch batch;
  batch.seqlen_k = seqlen_k;
  batch.seqlen_q = seqlen_q;
  absl::StatusOr<PrefillLayout> pl = ComputePrefillLayout(batch, kWin, kRatio);
  ASSERT_TRUE(pl.ok()) << pl.status();
  ASSERT_EQ(pl->chunk_rows, rows);
  std::mt19937 rng(303);
  std::vector<int32_t> clean;
  int64_t invalid = 0;
  const std::vector<int32_t> comp = RandomCompressed(
      rows * kTopk, pl->compressed_rows, rng, &clean, &invalid);
  ASSERT_GT(invalid, 0);
  v1::PrefillIndexRequest r;
  r.set_num_seqs(2);
  r.set_seqlen_k(Pack(seqlen_k));
  r.set_seqlen_q(Pack(seqlen_q));
  r.set_window(kWin);
  r.set_compress_ratio(kRatio);
  r.set_topk_k(kTopk);
  // Inline: out-of-range entries are an error (host-checked input).
  r.set_compressed_index(Pack(comp));
  EXPECT_REJECTED(c_->PrefillIndex(r), kInvalidArgument, "compressed_index[");
  r.set_compressed_index(Pack(clean));
  absl::StatusOr<v1::PrefillIndexResponse> in = c_->PrefillIndex(r);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->invalid_count(), 0);
  const std::vector<int32_t> want = ReadInt32s(in->index());
  ASSERT_EQ(static_cast<int64_t>(want.size()), rows * (kWin + kTopk));

  const int64_t width = kWin + kTopk;
  WriteAt(*buf_, 4, comp);
  r.clear_compressed_index();
  *r.mutable_compressed_index_buffer() = Slice(buf_->id(), 4, rows * kTopk * 4);
  *r.mutable_index_buffer() = Slice(buf_->id(), 8 << 10, rows * width * 4);
  *r.mutable_invalid_count_buffer() = Slice(buf_->id(), 16 << 10, 8);
  absl::StatusOr<v1::PrefillIndexResponse> out = c_->PrefillIndex(r);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->index().empty());
  EXPECT_EQ(out->invalid_count(), invalid);
  EXPECT_EQ(WordAt(*buf_, 16 << 10), invalid);
  EXPECT_EQ(ReadAt(*buf_, 8 << 10, rows * width), want);
  EXPECT_EQ(out->main_kv_offset(), in->main_kv_offset());

  // Negative tests, nothing written.
  std::memset(buf_->data() + (8 << 10), kFill, rows * width * 4);
  std::memset(buf_->data() + (16 << 10), kFill, 8);
  v1::PrefillIndexRequest bad = r;
  bad.set_compressed_index(Pack(clean));
  EXPECT_REJECTED(c_->PrefillIndex(bad), kInvalidArgument, "not both");
  bad = r;
  bad.mutable_compressed_index_buffer()->set_length(8);
  EXPECT_REJECTED(c_->PrefillIndex(bad), kInvalidArgument,
                  "compressed_index_buffer.length = 8");
  bad = r;
  bad.mutable_index_buffer()->set_offset(0);
  EXPECT_REJECTED(c_->PrefillIndex(bad), kInvalidArgument,
                  "overlaps compressed_index_buffer");
  bad = r;
  bad.mutable_invalid_count_buffer()->set_offset((8 << 10) + 4);
  EXPECT_REJECTED(c_->PrefillIndex(bad), kInvalidArgument, "overlaps");
  bad = r;
  bad.mutable_index_buffer()->set_length(8);
  EXPECT_REJECTED(c_->PrefillIndex(bad), kInvalidArgument,
                  "index_buffer.length = 8");
  bad = r;
  bad.set_record_event(true);
  EXPECT_REJECTED(c_->PrefillIndex(bad), kInvalidArgument,
                  "GPU ordering needs the cuda backend");
  for (int field = 0; field < 3; ++field) {
    bad = r;
    v1::BufferSlice* s = field == 0   ? bad.mutable_compressed_index_buffer()
                         : field == 1 ? bad.mutable_index_buffer()
                                      : bad.mutable_invalid_count_buffer();
    s->set_buffer_id(their_->id());
    EXPECT_REJECTED(c_->PrefillIndex(bad), kPermissionDenied,
                    "belongs to another session");
  }
  EXPECT_TRUE(Untouched(*buf_, 8 << 10, rows * width * 4));
  EXPECT_TRUE(Untouched(*buf_, 16 << 10, 8));
  EXPECT_TRUE(Untouched(*their_, 0, kBufferBytes));
}

}  // namespace
}  // namespace kvdepot::testing
