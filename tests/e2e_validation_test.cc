// End to end: every class of invalid request is rejected with the right
// code and a message naming the field (and index), and no pool byte
// changes.
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"

namespace kvdepot::testing {
namespace {

using ::testing::HasSubstr;

#define EXPECT_REJECTED(expr, want_code, substr)                     \
  do {                                                               \
    const absl::Status _s = (expr).status();                         \
    EXPECT_EQ(_s.code(), absl::StatusCode::want_code) << _s;         \
    EXPECT_THAT(std::string(_s.message()), HasSubstr(substr)) << _s; \
  } while (0)

class ValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start();
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    c_ = ConnectOrDie(daemon_->socket_path());
    ASSERT_NE(c_, nullptr);
    // v: V41, block 7, 5 blocks (35 slots), 2 layers. swa: rings of 8.
    // main: compressed pool, blocks of 4.
    for (const v1::CreatePoolRequest& r :
         {PoolRequest("v", "V41", 0, 7, 5, 2),
          PoolRequest("idx", "MXFP8_INDEX", 0, 3, 4, 1),
          PoolRequest("swa", "V41", 0, 8, 2, 1),
          PoolRequest("main", "V41", 0, 4, 6, 1)}) {
      ASSERT_TRUE(c_->CreatePool(r).ok()) << r.name();
    }
    std::mt19937 rng(301);
    for (const char* name : {"v", "swa", "main"}) {
      absl::StatusOr<v1::PoolInfo> info = c_->GetPool(name);
      ASSERT_TRUE(info.ok());
      std::vector<int32_t> slots;
      for (int32_t s = 0;
           s < info->layout().block_size() * info->layout().num_blocks(); ++s) {
        slots.push_back(s);
      }
      v1::StoreRequest r = StoreRequest(name, 0, slots, v1::INPUT_DTYPE_FP32);
      *r.mutable_kv() = InlineData(Fp32Bytes(RandomKv(slots.size(), 512, rng)));
      ASSERT_TRUE(c_->Store(r).ok());
    }
    absl::StatusOr<BufferMapping> buf = c_->AllocateBuffer(1 << 20);
    ASSERT_TRUE(buf.ok());
    buf_ = std::make_unique<BufferMapping>(*std::move(buf));
    for (const char* name : {"v", "idx", "swa", "main"}) {
      absl::StatusOr<const PoolMapping*> m = c_->MapPool(name);
      ASSERT_TRUE(m.ok());
      const uint8_t* p = (*m)->data();
      snapshots_.emplace_back(p, p + (*m)->layout().total_bytes());
      mappings_.push_back(*m);
    }
    ASSERT_FALSE(AllZero(snapshots_[0].data(), snapshots_[0].size()));
  }

  void TearDown() override {
    for (size_t i = 0; i < mappings_.size(); ++i) {
      EXPECT_EQ(0, std::memcmp(mappings_[i]->data(), snapshots_[i].data(),
                               snapshots_[i].size()))
          << "pool " << mappings_[i]->info().name() << " changed";
    }
  }

  // A valid store of 3 tokens into pool v, layer 0.
  v1::StoreRequest GoodStore() {
    v1::StoreRequest r = StoreRequest("v", 0, {0, 5, 9}, v1::INPUT_DTYPE_BF16);
    *r.mutable_kv() = InlineData(std::string(3 * 512 * 2, '\x01'));
    return r;
  }
  // A valid load of pool v by segments, inline output.
  v1::LoadRequest GoodLoad(std::vector<int32_t> segs, int64_t total_k) {
    v1::LoadRequest r;
    r.set_pool("v");
    *r.mutable_segments() = SegmentsProto(segs, total_k);
    *r.mutable_data() = InlineOutput();
    return r;
  }
  v1::PrefillLoadRequest GoodPrefill() {
    v1::PrefillLoadRequest r;
    r.set_swa_pool("swa");
    r.set_main_pool("main");
    r.set_num_seqs(2);
    r.set_seqlen_k(Pack({10, 3}));
    r.set_seqlen_q(Pack({2, 3}));
    r.set_swa_state_id(Pack({0, 1}));
    r.set_window(4);
    r.set_compress_ratio(2);
    r.set_max_blocks_per_seq(2);
    r.set_block_table(Pack({1, 2, 3, 4}));
    r.set_dtype(v1::INPUT_DTYPE_BF16);
    *r.mutable_chunk_kv() = InlineData(std::string(5 * 512 * 2, '\x02'));
    *r.mutable_output() = InlineOutput();
    return r;
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<KVCacheClient> c_;
  std::unique_ptr<BufferMapping> buf_;
  std::vector<const PoolMapping*> mappings_;
  std::vector<std::vector<uint8_t>> snapshots_;
};

TEST_F(ValidationTest, StoreRejectsEveryInvalidField) {
  // The baseline requests are valid (each case below breaks one thing) ...
  ASSERT_TRUE(c_->Load(GoodLoad({0, 0, 7, 0}, 7)).ok());
  // ... and are not run against the pool: the snapshot must stay.
  v1::StoreRequest r = GoodStore();
  r.set_pool("nope");
  EXPECT_REJECTED(c_->Store(r), kNotFound, "pool = \"nope\"");
  r = GoodStore();
  r.set_layer(2);
  EXPECT_REJECTED(c_->Store(r), kInvalidArgument,
                  "layer = 2 is outside [0, 2)");
  r = GoodStore();
  r.set_slot_mapping(Pack({0, 35, 9}));
  EXPECT_REJECTED(c_->Store(r), kInvalidArgument, "slot_mapping[1] = 35");
  r = GoodStore();
  r.set_slot_mapping(Pack({-2, 5, 9}));
  EXPECT_REJECTED(c_->Store(r), kInvalidArgument, "slot_mapping[0] = -2");
  r = GoodStore();
  r.set_slot_mapping(Pack({9, 5, 9}));
  EXPECT_REJECTED(c_->Store(r), kInvalidArgument, "slot_mapping[2] = 9");
  r = GoodStore();
  r.set_num_tokens(4);
  EXPECT_REJECTED(
      c_->Store(r), kInvalidArgument,
      "slot_mapping holds 12 bytes, expected 4 bytes x (num_tokens = 4) = 16");
  r = GoodStore();
  r.set_num_tokens(-1);
  EXPECT_REJECTED(c_->Store(r), kInvalidArgument, "num_tokens = -1 is outside");
  r = GoodStore();
  *r.mutable_kv() = InlineData(std::string(100, 'x'));
  EXPECT_REJECTED(c_->Store(r), kInvalidArgument,
                  "kv.inline_data holds 100 bytes");
  r = GoodStore();
  *r.mutable_kv() = buf_->Slice((1 << 20) - 100, 3 * 512 * 2);
  EXPECT_REJECTED(c_->Store(r), kInvalidArgument, "kv.slice [offset 1048476");
  r = GoodStore();
  *r.mutable_kv() = buf_->Slice(0, 5);
  EXPECT_REJECTED(c_->Store(r), kInvalidArgument, "kv.slice.length = 5");
  r = GoodStore();
  r.mutable_kv()->mutable_slice()->set_buffer_id(987654);
  EXPECT_REJECTED(c_->Store(r), kNotFound, "kv.slice.buffer_id = 987654");
  r = GoodStore();
  r.set_dtype(static_cast<v1::InputDtype>(7));
  EXPECT_REJECTED(c_->Store(r), kInvalidArgument, "dtype = 7");
  r = GoodStore();
  r.clear_kv();
  EXPECT_REJECTED(c_->Store(r), kInvalidArgument, "kv must be");
  r = GoodStore();
  r.set_wait_event_ipc_handle(std::string(64, '\x01'));
  EXPECT_REJECTED(c_->Store(r), kInvalidArgument,
                  "wait_event_ipc_handle: GPU ordering needs the cuda backend");
  r = GoodStore();
  r.set_record_event(true);
  EXPECT_REJECTED(c_->Store(r), kInvalidArgument, "record_event: GPU ordering");
  r = GoodStore();
  r.set_session_id("feedface");
  EXPECT_REJECTED(c_->Store(r), kUnauthenticated,
                  "the session id is malformed, unknown");
  EXPECT_THAT(std::string(c_->Store(r).status().message()),
              ::testing::Not(::testing::HasSubstr("feedface")));
}

TEST_F(ValidationTest, LoadRejectsEveryInvalidPlan) {
  EXPECT_REJECTED(c_->Load(GoodLoad({5, 0, 7, 0}, 7)), kInvalidArgument,
                  "segments[0].src_block_id = 5");
  EXPECT_REJECTED(c_->Load(GoodLoad({0, 0, 7, 0, 1, 2, 8, 7}, 13)),
                  kInvalidArgument, "segments[1]");
  EXPECT_REJECTED(c_->Load(GoodLoad({0, 0, 7, 0, 1, 0, 3, 5}, 8)),
                  kInvalidArgument, "segments[1]");
  EXPECT_REJECTED(c_->Load(GoodLoad({0, 0, 7, 3}, 7)), kInvalidArgument,
                  "segments[0]");
  EXPECT_REJECTED(c_->Load(GoodLoad({0, 0, 7, -1}, 7)), kInvalidArgument,
                  "segments[0].dst_offset = -1");
  v1::LoadRequest r = GoodLoad({0, 0, 7, 0}, 7);
  r.mutable_segments()->set_num_segments(2);
  EXPECT_REJECTED(c_->Load(r), kInvalidArgument,
                  "segments.segments holds 16 bytes, expected 4 bytes x (4 * "
                  "segments.num_segments = 8) = 32");
  r = GoodLoad({0, 0, 7, 0}, 7);
  *r.mutable_scales() = InlineOutput();
  EXPECT_REJECTED(c_->Load(r), kInvalidArgument, "scales must be unset");
  r = GoodLoad({0, 0, 7, 0}, 7);
  *r.mutable_data() = buf_->Slice(0, 100);
  EXPECT_REJECTED(c_->Load(r), kInvalidArgument, "data.slice.length = 100");
  r = GoodLoad({0, 0, 7, 0}, 7);
  r.set_record_event(true);
  EXPECT_REJECTED(c_->Load(r), kInvalidArgument, "record_event: GPU ordering");
  r = GoodLoad({0, 0, 7, 0}, 7);
  r.clear_segments();
  EXPECT_REJECTED(c_->Load(r), kInvalidArgument,
                  "plan: set segments or sequences");
  // Index format: data and scales must not overlap in one buffer.
  r = GoodLoad({0, 0, 3, 0}, 3);
  r.set_pool("idx");
  *r.mutable_data() = buf_->Slice(0, 3 * 128);
  *r.mutable_scales() = buf_->Slice(8, 3 * 4);
  EXPECT_REJECTED(c_->Load(r), kInvalidArgument, "overlaps scales");

  // Sequences + block tables.
  v1::LoadRequest s;
  s.set_pool("v");
  *s.mutable_data() = InlineOutput();
  v1::SequencePlan* sp = s.mutable_sequences();
  sp->set_num_seqs(2);
  sp->set_seqlen_k(Pack({7, 10}));
  sp->set_max_blocks_per_seq(2);
  sp->set_block_table(Pack({0, 1, 2, 3}));
  ASSERT_TRUE(c_->Load(s).ok());
  sp->set_block_table(Pack({0, 1, 2, 9}));
  EXPECT_REJECTED(c_->Load(s), kInvalidArgument, "block_table[1][1] = 9");
  sp->set_block_table(Pack({0, 1, 2}));
  EXPECT_REJECTED(c_->Load(s), kInvalidArgument,
                  "sequences.block_table holds 12 bytes");
  sp->set_block_table(Pack({0, 1, 2, 3}));
  sp->set_seqlen_k(Pack({7, 15}));
  EXPECT_REJECTED(c_->Load(s), kInvalidArgument, "seqlen_k[1] = 15");
  sp->set_seqlen_k(Pack({-1, 10}));
  EXPECT_REJECTED(c_->Load(s), kInvalidArgument, "seqlen_k[0] = -1");
  sp->set_seqlen_k(Pack({7, 10}));
  sp->set_compress_ratio(-3);
  EXPECT_REJECTED(c_->Load(s), kInvalidArgument,
                  "sequences.compress_ratio = -3");
  sp->set_compress_ratio(1);
  sp->set_num_seqs(0);
  EXPECT_REJECTED(c_->Load(s), kInvalidArgument, "sequences.num_seqs = 0");
}

// A plan is bounded like the segments Load accepts (--max_array_elements
// / 4 = 4194304 at the default), before it is built: a block table within
// its own bound could otherwise make a plan of 4x its size (BuildPlan's of
// a 60 MB table took 240 MB per call, kept by the handler thread). A plan
// within that bound whose reply cannot fit one message is refused clearly.
TEST_F(ValidationTest, PlansAreBoundedBeforeTheyAreBuilt) {
  constexpr int64_t kMaxSegments = (int64_t{1} << 24) / 4;
  auto plan = [](int64_t blocks) {
    v1::BuildPlanRequest r;
    r.set_pool("v");  // blocks of 7 tokens
    v1::SequencePlan* sp = r.mutable_sequences();
    sp->set_num_seqs(1);
    sp->set_seqlen_k(Pack({static_cast<int32_t>(7 * blocks)}));
    sp->set_max_blocks_per_seq(blocks);
    sp->set_block_table(Pack(std::vector<int32_t>(blocks, 0)));  // valid
    return r;
  };
  EXPECT_REJECTED(c_->BuildPlan(plan(kMaxSegments + 1)), kInvalidArgument,
                  "sequences: the plan would have 4194305 segments, more "
                  "than the 4194304");
  v1::LoadRequest load;
  load.set_pool("v");
  *load.mutable_sequences() = plan(kMaxSegments + 1).sequences();
  *load.mutable_data() = InlineOutput();
  EXPECT_REJECTED(c_->Load(load), kInvalidArgument,
                  "the plan would have 4194305 segments");
  // At the bound the plan is built; its 64 MiB of segments and the
  // cu_rows do not fit a reply.
  EXPECT_REJECTED(c_->BuildPlan(plan(kMaxSegments)), kInvalidArgument,
                  "sequences: the plan and cu_rows take 67108872 bytes, more "
                  "than max_inline_bytes = 67108864");
  absl::StatusOr<v1::BuildPlanResponse> ok = c_->BuildPlan(plan(1000));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->plan().num_segments(), 1000);
}

TEST_F(ValidationTest, PrefillLoadRejectsEveryInvalidField) {
  v1::PrefillLoadRequest r = GoodPrefill();
  r.set_window(9);
  EXPECT_REJECTED(c_->PrefillLoad(r), kInvalidArgument, "window = 9");
  r = GoodPrefill();
  r.set_swa_state_id(Pack({0, 2}));
  EXPECT_REJECTED(c_->PrefillLoad(r), kInvalidArgument, "[1] = 2");
  r = GoodPrefill();
  r.set_swa_state_id(Pack({1, 1}));
  EXPECT_REJECTED(c_->PrefillLoad(r), kInvalidArgument,
                  "swa_state_id: two sequences share a ring slot");
  r = GoodPrefill();
  r.set_seqlen_q(Pack({2, 4}));
  EXPECT_REJECTED(c_->PrefillLoad(r), kInvalidArgument, "seqlen_q[1] = 4");
  r = GoodPrefill();
  *r.mutable_chunk_kv() = InlineData("short");
  EXPECT_REJECTED(c_->PrefillLoad(r), kInvalidArgument, "chunk_kv.inline_data");
  r = GoodPrefill();
  r.set_swa_layer(1);
  EXPECT_REJECTED(c_->PrefillLoad(r), kInvalidArgument, "swa_layer = 1");
  r = GoodPrefill();
  r.set_block_table(Pack({1, 2, 3, 6}));
  r.set_seqlen_k(Pack({10, 12}));
  r.set_seqlen_q(Pack({2, 3}));
  EXPECT_REJECTED(c_->PrefillLoad(r), kInvalidArgument,
                  "block_table[1][1] = 6");
  r = GoodPrefill();
  r.set_main_pool("idx");
  EXPECT_REJECTED(c_->PrefillLoad(r), kInvalidArgument, "do_cast");
  // Input and output overlapping in one buffer.
  r = GoodPrefill();
  *r.mutable_chunk_kv() = buf_->Slice(0, 5 * 512 * 2);
  *r.mutable_output() = buf_->Slice(4096, 4 * 2 * 1024 + 5 * 1024 + 6 * 1024);
  EXPECT_REJECTED(c_->PrefillLoad(r), kInvalidArgument, "overlaps output");
  // GPU ordering on the CPU backend (its replies mean done), checked
  // before anything else: a request otherwise good.
  r = GoodPrefill();
  r.set_record_event(true);
  EXPECT_REJECTED(c_->PrefillLoad(r), kInvalidArgument,
                  "record_event: GPU ordering needs the cuda backend");
  r = GoodPrefill();
  r.set_wait_event_ipc_handle(std::string(64, 'x'));
  EXPECT_REJECTED(c_->PrefillLoad(r), kInvalidArgument,
                  "wait_event_ipc_handle: GPU ordering needs the cuda backend");
}

TEST_F(ValidationTest, IndexPoolBufferAndSessionRequestsAreChecked) {
  v1::ConvertTopkRequest t;
  t.set_pool("main");
  t.set_batch(1);
  t.set_k(2);
  t.set_topk(Pack({0, 1}));
  t.set_valid_count(Pack({3}));
  t.set_num_tokens(Pack({8}));
  t.set_max_blocks_per_seq(2);
  t.set_block_table(Pack({0, 1}));
  EXPECT_REJECTED(c_->ConvertTopk(t), kInvalidArgument, "valid_count[0] = 3");
  t.set_topk(Pack({0}));
  EXPECT_REJECTED(c_->ConvertTopk(t), kInvalidArgument, "topk holds 4 bytes");

  v1::SwaDecodeIndexRequest w;
  w.set_pool("swa");
  w.set_window(9);
  w.set_num_queries(1);
  w.set_queries(Pack({0, 0, 1}));
  EXPECT_REJECTED(c_->SwaDecodeIndex(w), kInvalidArgument, "window = 9");
  w.set_window(4);
  w.set_queries(Pack({2, 0, 1}));
  EXPECT_REJECTED(c_->SwaDecodeIndex(w), kInvalidArgument, "[0] = 2");

  v1::PrefillIndexRequest p;
  p.set_num_seqs(1);
  p.set_seqlen_k(Pack({10}));
  p.set_seqlen_q(Pack({2}));
  p.set_window(4);
  p.set_compress_ratio(2);
  p.set_topk_k(3);
  p.set_compressed_index(Pack({0, 1, 2}));
  EXPECT_REJECTED(c_->PrefillIndex(p), kInvalidArgument,
                  "compressed_index holds 12 bytes");

  EXPECT_REJECTED(c_->CreatePool(PoolRequest("x", "V42", 0, 4, 4, 1)),
                  kInvalidArgument, "format = \"V42\"");
  EXPECT_REJECTED(c_->CreatePool(PoolRequest("x", "V41", 0, 0, 4, 1)),
                  kInvalidArgument, "block_size = 0");
  EXPECT_REJECTED(c_->CreatePool(PoolRequest("x", "BF16", 3, 4, 4, 1)),
                  kInvalidArgument, "bf16_elements = 3");
  EXPECT_REJECTED(c_->CreatePool(PoolRequest("a/b", "V41", 0, 4, 4, 1)),
                  kInvalidArgument, "name = \"a/b\"");
  EXPECT_REJECTED(c_->CreatePool(PoolRequest("v", "V41", 0, 4, 4, 1)),
                  kAlreadyExists, "pool \"v\" already exists");
  EXPECT_REJECTED(c_->CreatePool(PoolRequest("x", "V41", 0, 4, 4, 0)),
                  kInvalidArgument, "num_layers = 0");
  EXPECT_REJECTED(c_->GetPool("nope"), kNotFound, "name = \"nope\"");
  EXPECT_EQ(c_->DeletePool("nope").code(), absl::StatusCode::kNotFound);

  EXPECT_REJECTED(c_->AllocateBuffer(0), kInvalidArgument, "size = 0");
  v1::ImportBufferRequest ib;
  ib.set_session_id(c_->session_id());
  // Memory is never named: any shm name (another session's, a pool's, a
  // root-owned object) is refused before anything is opened.
  for (const char* name :
       {"/kvdepot-does-not-exist", "/../etc/passwd", "/dev/shm/x"}) {
    ib.mutable_handle()->set_shm_name(name);
    ib.mutable_handle()->set_size(4096);
    EXPECT_REJECTED(c_->ImportBuffer(ib), kFailedPrecondition,
                    "(memfds, CUDA VMM exports) on the companion socket");
  }
  EXPECT_EQ(c_->ReleaseBuffer(424242).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvdepot::testing
