// The index RPCs on the GPU (SPEC §7, §9): kvdepotd --backend=cuda in a
// child process runs ConvertTopk, SwaDecodeIndex and PrefillIndex on its
// CUDA kernels over buffers in device memory that this test (another
// process) mapped by CUDA IPC. Every result is compared entry by entry with
// the planner (the CPU backend's answer, //tests:e2e_index_buffers_test) on
// random inputs with out-of-range indices and table entries (-1, counted),
// block sizes 1, 7 and 133; in place, misaligned (staged) and inline
// operands; the invalid count in the reply and in an invalid_count_buffer
// word; record_event (answered before the GPU finished: the count is -1 in
// the reply and in the word after the daemon's event) and a client event
// the daemon must await (the input is written 200 ms late).
#include <cuda_runtime_api.h>

#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_events.h"
#include "common/cuda/cuda_mappings.h"
#include "gtest/gtest.h"
#include "planner/plan.h"
#include "proto/wire.h"
#include "tests/e2e_util.h"
#include "tests/gpu/gpu_fixture.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/index_cases.h"

namespace kvdepot::testing {
namespace {

constexpr int64_t kBufferBytes = 4 << 20;
constexpr int32_t kNumBlocks = 50;
constexpr uint8_t kFill = 0x5A;
constexpr absl::Duration kDelay = absl::Milliseconds(200);

v1::BufferSlice Slice(uint64_t id, int64_t offset, int64_t length) {
  v1::BufferSlice s;
  s.set_buffer_id(id);
  s.set_offset(offset);
  s.set_length(length);
  return s;
}

class CudaIndexTest : public GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (HasFatalFailure()) return;
    for (int32_t bs : {1, 7, 133}) {
      absl::StatusOr<v1::PoolInfo> p = client_->CreateOrGetPool(
          PoolRequest(absl::StrCat("gidx", bs), "V41", 0, bs, kNumBlocks, 1));
      ASSERT_TRUE(p.ok()) << p.status();
    }
    absl::StatusOr<v1::PoolInfo> swa =
        client_->CreateOrGetPool(PoolRequest("gidx_swa", "V41", 0, 8, 4, 1));
    ASSERT_TRUE(swa.ok()) << swa.status();
    absl::StatusOr<v1::BufferInfo> b =
        AllocateCudaBuffer(*client_, kBufferBytes);
    ASSERT_TRUE(b.ok()) << b.status();
    id_ = b->buffer_id();
    absl::StatusOr<CudaIpcMapping> m = CudaIpcMapping::Open(b->handle());
    ASSERT_TRUE(m.ok()) << m.status();
    buf_.emplace(*std::move(m));
    // cudaMemset runs on the legacy stream, unordered with stream_ (a
    // non-blocking stream): wait for it, or it may land after a test's
    // first Put on stream_ and overwrite that input.
    ASSERT_OK(Cuda(cudaMemset(buf_->data(), kFill, kBufferBytes), "fill"));
    ASSERT_OK(Cuda(cudaDeviceSynchronize(), "fill done"));
  }
  void TearDown() override {
    buf_.reset();
    if (id_ != 0) (void)client_->ReleaseBuffer(id_);
  }

  // Writes `v` at `offset` (after `delay` on the stream when > 0).
  void Put(int64_t offset, const std::vector<int32_t>& v,
           absl::Duration delay = absl::ZeroDuration()) {
    if (delay > absl::ZeroDuration()) {
      ASSERT_OK(DelayStream(stream_->get(), delay));
    }
    ASSERT_OK(
        Cuda(cudaMemcpyAsync(buf_->data() + offset, v.data(), v.size() * 4,
                             cudaMemcpyHostToDevice, stream_->get()),
             "writing an input"));
    if (delay == absl::ZeroDuration()) ASSERT_OK(stream_->Sync());
  }
  std::vector<int32_t> Get(int64_t offset, int64_t n) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    EXPECT_TRUE(Cuda(cudaMemcpy(v.data(), buf_->data() + offset, n * 4,
                                cudaMemcpyDeviceToHost),
                     "reading an output")
                    .ok());
    return v;
  }
  int64_t Word(int64_t offset) {
    int64_t w = 0;
    EXPECT_TRUE(
        Cuda(cudaMemcpy(&w, buf_->data() + offset, 8, cudaMemcpyDeviceToHost),
             "reading a word")
            .ok());
    return w;
  }

  v1::ConvertTopkRequest Request(const TopkCase& c) const {
    v1::ConvertTopkRequest r;
    r.set_pool(absl::StrCat("gidx", c.block_size));
    r.set_batch(c.batch);
    r.set_k(c.k);
    r.set_valid_count(Pack(c.valid));
    r.set_num_tokens(Pack(c.tokens));
    r.set_max_blocks_per_seq(c.cols);
    return r;
  }

  uint64_t id_ = 0;
  std::optional<CudaIpcMapping> buf_;
};

// Every placement of the operands; the same slots and count each time.
TEST_F(CudaIndexTest, ConvertTopkOnTheGpuEqualsThePlanner) {
  std::mt19937 rng(401);
  for (int32_t bs : {1, 7, 133}) {
    SCOPED_TRACE(absl::StrCat("block_size ", bs));
    // k = 300: two column tiles per row; 79 sequences.
    const TopkCase c = RandomTopk(bs, kNumBlocks, 79, 300, 37, rng);
    int64_t invalid = 0;
    const std::vector<int32_t> want = ExpectedSlots(c, &invalid);
    int64_t converted = 0;
    for (int32_t s : want) converted += s >= 0 ? 1 : 0;
    ASSERT_GT(converted, 0);
    ASSERT_GT(invalid, 0);
    const int64_t n = c.batch * c.k;
    const int64_t topk_at = 0, table_at = 1 << 20, slots_at = 2 << 20;
    const int64_t word_at = 3 << 20;
    Put(table_at, c.table);
    struct Variant {
      const char* name;
      int64_t topk_at;   // -1 = inline
      int64_t slots_at;  // -1 = inline reply
      bool table_inline;
    };
    const Variant variants[] = {
        {"in place", topk_at, topk_at, false},
        {"separate", topk_at, slots_at, false},
        {"misaligned in place (staged)", topk_at + 2, topk_at + 2, false},
        {"misaligned output (staged)", topk_at, slots_at + 6, true},
        {"inline topk", -1, slots_at, false},
        {"inline reply", topk_at, -1, false},
    };
    for (const Variant& v : variants) {
      SCOPED_TRACE(v.name);
      v1::ConvertTopkRequest r = Request(c);
      if (v.topk_at >= 0) {
        Put(v.topk_at, c.topk);
        *r.mutable_topk_buffer() = Slice(id_, v.topk_at, n * 4);
      } else {
        r.set_topk(Pack(c.topk));
      }
      if (v.slots_at >= 0) {
        *r.mutable_slots_buffer() = Slice(id_, v.slots_at, n * 4);
      }
      if (v.table_inline) {
        r.set_block_table(Pack(c.table));
      } else {
        *r.mutable_block_table_buffer() =
            Slice(id_, table_at, c.batch * c.cols * 4);
      }
      ASSERT_OK(Cuda(cudaMemset(buf_->data() + word_at, kFill, 8), "word"));
      *r.mutable_invalid_count_buffer() = Slice(id_, word_at, 8);
      absl::StatusOr<v1::ConvertTopkResponse> out = client_->ConvertTopk(r);
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ(out->invalid_count(), invalid);
      EXPECT_EQ(Word(word_at), invalid);
      EXPECT_EQ(v.slots_at >= 0 ? Get(v.slots_at, n) : ReadInt32s(out->slots()),
                want);
      if (v.slots_at >= 0 && v.slots_at != v.topk_at && v.topk_at >= 0) {
        EXPECT_EQ(Get(v.topk_at, n), c.topk) << "the input was changed";
      }
    }
  }
}

// record_event: the reply comes before the GPU finished, with the count
// -1; the word holds it once the daemon's event fired. The client's own
// event orders a late write of the input before the kernel.
TEST_F(CudaIndexTest, ConvertTopkOrderedByEvents) {
  std::mt19937 rng(402);
  const TopkCase c = RandomTopk(7, kNumBlocks, 33, 64, 19, rng);
  int64_t invalid = 0;
  const std::vector<int32_t> want = ExpectedSlots(c, &invalid);
  ASSERT_GT(invalid, 0);
  const int64_t n = c.batch * c.k;
  Put(1 << 20, c.table);
  ASSERT_OK(Cuda(cudaMemset(buf_->data(), 0, n * 4), "old topk"));
  ASSERT_OK(Cuda(cudaDeviceSynchronize(), "old topk done"));
  absl::StatusOr<CudaIpcEvent> mine = CudaIpcEvent::Create(0);
  ASSERT_TRUE(mine.ok()) << mine.status();
  Put(0, c.topk, kDelay);
  ASSERT_OK(mine->Record(stream_->get()));
  v1::ConvertTopkRequest r = Request(c);
  *r.mutable_topk_buffer() = Slice(id_, 0, n * 4);
  *r.mutable_block_table_buffer() = Slice(id_, 1 << 20, c.batch * c.cols * 4);
  *r.mutable_slots_buffer() = Slice(id_, 2 << 20, n * 4);
  *r.mutable_invalid_count_buffer() = Slice(id_, 3 << 20, 8);
  r.set_wait_event_ipc_handle(mine->handle());
  r.set_record_event(true);
  absl::StatusOr<v1::ConvertTopkResponse> out = client_->ConvertTopk(r);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->invalid_count(), -1);
  ASSERT_EQ(out->recorded_event_ipc_handle().size(), kCudaIpcHandleBytes);
  absl::StatusOr<CudaIpcEvent> theirs = CudaIpcEvent::Open(
      "recorded_event_ipc_handle", out->recorded_event_ipc_handle(), 0);
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  ASSERT_OK(theirs->Wait(stream_->get()));
  ASSERT_OK(stream_->Sync());
  EXPECT_EQ(Get(0, n), c.topk) << "the client's late write did not land";
  EXPECT_EQ(Get(2 << 20, n), want);
  EXPECT_EQ(Word(3 << 20), invalid);

  // record_event with an inline reply is refused.
  r.clear_slots_buffer();
  r.clear_wait_event_ipc_handle();
  absl::StatusOr<v1::ConvertTopkResponse> bad = client_->ConvertTopk(r);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument)
      << bad.status();
}

// The two halves of the test above apart: record_event on inputs that
// are in place before the call, then the client's event alone.
TEST_F(CudaIndexTest, ConvertTopkRecordEventAlone) {
  std::mt19937 rng(402);
  const TopkCase c = RandomTopk(7, kNumBlocks, 33, 64, 19, rng);
  int64_t invalid = 0;
  const std::vector<int32_t> want = ExpectedSlots(c, &invalid);
  const int64_t n = c.batch * c.k;
  Put(1 << 20, c.table);
  Put(0, c.topk);
  v1::ConvertTopkRequest r = Request(c);
  *r.mutable_topk_buffer() = Slice(id_, 0, n * 4);
  *r.mutable_block_table_buffer() = Slice(id_, 1 << 20, c.batch * c.cols * 4);
  *r.mutable_slots_buffer() = Slice(id_, 2 << 20, n * 4);
  *r.mutable_invalid_count_buffer() = Slice(id_, 3 << 20, 8);
  r.set_record_event(true);
  absl::StatusOr<v1::ConvertTopkResponse> out = client_->ConvertTopk(r);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->recorded_event_ipc_handle().size(), kCudaIpcHandleBytes);
  absl::StatusOr<CudaIpcEvent> theirs = CudaIpcEvent::Open(
      "recorded_event_ipc_handle", out->recorded_event_ipc_handle(), 0);
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  ASSERT_OK(theirs->Wait(stream_->get()));
  ASSERT_OK(stream_->Sync());
  EXPECT_EQ(Get(2 << 20, n), want);
  EXPECT_EQ(Word(3 << 20), invalid);
}

TEST_F(CudaIndexTest, ConvertTopkWaitEventAlone) {
  std::mt19937 rng(402);
  const TopkCase c = RandomTopk(7, kNumBlocks, 33, 64, 19, rng);
  int64_t invalid = 0;
  const std::vector<int32_t> want = ExpectedSlots(c, &invalid);
  const int64_t n = c.batch * c.k;
  Put(1 << 20, c.table);
  ASSERT_OK(Cuda(cudaMemset(buf_->data(), 0, n * 4), "old topk"));
  ASSERT_OK(Cuda(cudaDeviceSynchronize(), "old topk done"));
  absl::StatusOr<CudaIpcEvent> mine = CudaIpcEvent::Create(0);
  ASSERT_TRUE(mine.ok()) << mine.status();
  Put(0, c.topk, kDelay);
  ASSERT_OK(mine->Record(stream_->get()));
  v1::ConvertTopkRequest r = Request(c);
  *r.mutable_topk_buffer() = Slice(id_, 0, n * 4);
  *r.mutable_block_table_buffer() = Slice(id_, 1 << 20, c.batch * c.cols * 4);
  *r.mutable_slots_buffer() = Slice(id_, 2 << 20, n * 4);
  r.set_wait_event_ipc_handle(mine->handle());
  absl::StatusOr<v1::ConvertTopkResponse> out = client_->ConvertTopk(r);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->invalid_count(), invalid);
  EXPECT_EQ(Get(2 << 20, n), want);
}

TEST_F(CudaIndexTest, SwaDecodeIndexIntoDeviceMemory) {
  std::mt19937 rng(403);
  const int32_t window = 8;
  std::vector<int32_t> queries;
  const int64_t n = 300;
  std::uniform_int_distribution<int32_t> state(0, 3), start(0, 100000),
      len(0, window);
  for (int64_t i = 0; i < n; ++i) {
    queries.insert(queries.end(), {state(rng), start(rng), len(rng)});
  }
  v1::SwaDecodeIndexRequest r;
  r.set_pool("gidx_swa");
  r.set_window(window);
  r.set_num_queries(n);
  r.set_queries(Pack(queries));
  absl::StatusOr<v1::SwaDecodeIndexResponse> in = client_->SwaDecodeIndex(r);
  ASSERT_TRUE(in.ok()) << in.status();
  const std::vector<int32_t> want = ReadInt32s(in->slots());
  ASSERT_EQ(static_cast<int64_t>(want.size()), n * window);
  for (int64_t at : {int64_t{0}, int64_t{4 << 10} + 2}) {
    *r.mutable_slots_buffer() = Slice(id_, at, n * window * 4);
    r.set_record_event(at == 0);
    absl::StatusOr<v1::SwaDecodeIndexResponse> out = client_->SwaDecodeIndex(r);
    ASSERT_TRUE(out.ok()) << out.status();
    if (at == 0) {
      absl::StatusOr<CudaIpcEvent> theirs = CudaIpcEvent::Open(
          "recorded_event_ipc_handle", out->recorded_event_ipc_handle(), 0);
      ASSERT_TRUE(theirs.ok()) << theirs.status();
      ASSERT_OK(theirs->Wait(stream_->get()));
      ASSERT_OK(stream_->Sync());
    }
    EXPECT_EQ(Get(at, n * window), want) << "offset " << at;
  }
}

TEST_F(CudaIndexTest, PrefillIndexCountsOutOfRangeCompressedRows) {
  const std::vector<int32_t> seqlen_k = {4000, 133, 77},
                             seqlen_q = {64, 133, 7};
  constexpr int32_t kWin = 128, kRatio = 4, kTopk = 300;
  SequenceBatch batch;
  batch.seqlen_k = seqlen_k;
  batch.seqlen_q = seqlen_q;
  absl::StatusOr<PrefillLayout> pl = ComputePrefillLayout(batch, kWin, kRatio);
  ASSERT_TRUE(pl.ok()) << pl.status();
  const int64_t rows = pl->chunk_rows, width = kWin + kTopk;
  std::mt19937 rng(404);
  std::vector<int32_t> clean;
  int64_t invalid = 0;
  const std::vector<int32_t> comp = RandomCompressed(
      rows * kTopk, pl->compressed_rows, rng, &clean, &invalid);
  ASSERT_GT(invalid, 0);
  v1::PrefillIndexRequest r;
  r.set_num_seqs(3);
  r.set_seqlen_k(Pack(seqlen_k));
  r.set_seqlen_q(Pack(seqlen_q));
  r.set_window(kWin);
  r.set_compress_ratio(kRatio);
  r.set_topk_k(kTopk);
  r.set_compressed_index(Pack(clean));
  absl::StatusOr<v1::PrefillIndexResponse> in = client_->PrefillIndex(r);
  ASSERT_TRUE(in.ok()) << in.status();
  const std::vector<int32_t> want = ReadInt32s(in->index());
  ASSERT_EQ(static_cast<int64_t>(want.size()), rows * width);
  r.clear_compressed_index();
  for (int64_t at : {int64_t{0}, int64_t{2}}) {
    SCOPED_TRACE(absl::StrCat("offset ", at));
    Put(at, comp);
    *r.mutable_compressed_index_buffer() = Slice(id_, at, rows * kTopk * 4);
    *r.mutable_index_buffer() = Slice(id_, (1 << 20) + at, rows * width * 4);
    *r.mutable_invalid_count_buffer() = Slice(id_, 3 << 20, 8);
    absl::StatusOr<v1::PrefillIndexResponse> out = client_->PrefillIndex(r);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->invalid_count(), invalid);
    EXPECT_EQ(Word(3 << 20), invalid);
    EXPECT_EQ(Get((1 << 20) + at, rows * width), want);
  }
  // The index inline, the compressed rows from device memory.
  r.clear_index_buffer();
  absl::StatusOr<v1::PrefillIndexResponse> mixed = client_->PrefillIndex(r);
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  EXPECT_EQ(ReadInt32s(mixed->index()), want);
  EXPECT_EQ(mixed->invalid_count(), invalid);
}

}  // namespace
}  // namespace kvdepot::testing
