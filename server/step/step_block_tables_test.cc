// Device-resident block tables on the host (SPEC §10, "block tables -- in
// device memory when large"; docs/STEP_PATH.md): the registration's
// block_tables buffer (a negative test per rule, each naming its field;
// another session's buffer), the step's block_tables_in_buffer (a negative
// test per rule, nothing enqueued, no step id consumed) and the plan
// without a block_tables section. The kernel's range checks of the entries
// are //tests/gpu:step_e2e_test's.
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/step/registry_fixture.h"

namespace kvdepot::step {
namespace {

using ::testing::HasSubstr;

constexpr int kLayers = 2;
constexpr int kMaxSeqs = 4;
constexpr int kMaxBlocks = 4;           // max_blocks_per_seq
constexpr int64_t kTableStride = 32;    // bytes: 8 int32, 4 of them used
constexpr int64_t kTableOffset = 4096;  // into tables_
constexpr int64_t kTablesBytes = 8192;

class StepBlockTablesTest : public RegistryFixture {
 protected:
  void SetUp() override {
    RegistryFixture::SetUp();
    owner_ = Open("worker", 1000);
    // Another session of the same uid: it may use the pools, but buffers
    // belong to sessions (a grant names the session).
    other_ = Open("intruder", 1000);
    CreatePool("main", "V41", 16, 64, kLayers);
    CreatePool("index", "FP4_INDEX", 16, 64, kLayers);
    doorbell_ = AddBuffer(owner_, 4096);
    io_ = AddBuffer(owner_, 1 << 20);
    tables_ = AddBuffer(owner_, kTablesBytes);
  }
  uint8_t* BufferBase(uint64_t id) {
    return RegistryFixture::BufferBase(owner_, id);
  }

  // Two layers with main and index caches and phase B; the block tables
  // in tables_ (rows of 8 int32 from kTableOffset).
  v1::RegisterWorkerRequest Registration() const {
    v1::RegisterWorkerRequest r;
    r.set_doorbell_buffer_id(doorbell_);
    r.set_max_tokens(8);
    r.set_max_seqs(kMaxSeqs);
    r.set_max_top_k(16);
    r.set_max_blocks_per_seq(kMaxBlocks);
    BufferSlices slices(io_);
    auto ref = [&](v1::StepBufferRef* out, int64_t bytes) {
      slices.Next(out, bytes);
    };
    for (int l = 0; l < kLayers; ++l) {
      v1::StepLayer* layer = r.add_layers();
      layer->mutable_main()->set_pool("main");
      layer->mutable_main()->set_layer(l);
      ref(layer->mutable_main()->mutable_input(), 8 * 512 * 2);
      layer->mutable_index()->set_pool("index");
      layer->mutable_index()->set_layer(l);
      ref(layer->mutable_index()->mutable_input(), 8 * 128 * 2);
      ref(layer->mutable_topk(), 8 * 16 * 4);
      ref(layer->mutable_index_out(), 8 * 16 * 4);
    }
    r.mutable_block_tables()->set_buffer_id(tables_);
    r.mutable_block_tables()->set_offset(kTableOffset);
    r.mutable_block_tables()->set_row_stride(kTableStride);
    return r;
  }

  uint64_t Register(const v1::RegisterWorkerRequest& r) {
    return RegisterOk(owner_, r);
  }

  // Two sequences (1 and 2 query tokens), tables in the buffer, 3 columns.
  v1::StepRequest Step(uint64_t reg, uint64_t step) const {
    v1::StepRequest r;
    r.set_registration_id(reg);
    r.set_step_id(step);
    r.set_num_tokens(3);
    r.set_slot_mapping(PackInt32s({5, -1, 700}));
    r.set_num_seqs(2);
    r.set_seq_lens(PackInt32s({10, 40}));
    r.set_query_lens(PackInt32s({1, 2}));
    r.set_block_tables_in_buffer(true);
    r.set_block_table_cols(3);
    r.set_top_k(16);
    return r;
  }

  Caller owner_, other_;
  uint64_t doorbell_ = 0, io_ = 0, tables_ = 0;
};

TEST_F(StepBlockTablesTest, RegistrationKeepsTheBufferRowsAndStride) {
  ASSERT_NE(Register(Registration()), 0u);
  const BufferSpan& t = factory_.last_config.block_tables;
  ASSERT_TRUE(t.set());
  EXPECT_EQ(t.data(), BufferBase(tables_) + kTableOffset);
  EXPECT_EQ(t.row_stride, kTableStride);
  // Row stride 0 = packed rows of max_blocks_per_seq entries.
  v1::RegisterWorkerRequest r = Registration();
  r.mutable_block_tables()->set_row_stride(0);
  ASSERT_NE(Register(r), 0u);
  EXPECT_EQ(factory_.last_config.block_tables.row_stride, 4 * kMaxBlocks);
  // The last possible offset: max_seqs rows end exactly at the buffer's end.
  r = Registration();
  r.mutable_block_tables()->set_offset(
      kTablesBytes - (kMaxSeqs - 1) * kTableStride - 4 * kMaxBlocks);
  EXPECT_NE(Register(r), 0u);
  // Without it the registration takes inline tables only.
  r = Registration();
  r.clear_block_tables();
  ASSERT_NE(Register(r), 0u);
  EXPECT_FALSE(factory_.last_config.block_tables.set());
}

TEST_F(StepBlockTablesTest, EveryRegistrationRuleRefusesNamingTheField) {
  struct Case {
    std::string name;
    std::function<void(v1::RegisterWorkerRequest*)> mutate;
    absl::StatusCode code;
    std::string message;
  };
  auto bt = [](v1::RegisterWorkerRequest* r) {
    return r->mutable_block_tables();
  };
  const std::vector<Case> cases = {
      {"unknown buffer",
       [&](v1::RegisterWorkerRequest* r) { bt(r)->set_buffer_id(999); },
       absl::StatusCode::kNotFound, "block_tables.buffer_id = 999"},
      {"negative offset",
       [&](v1::RegisterWorkerRequest* r) { bt(r)->set_offset(-4); },
       absl::StatusCode::kInvalidArgument, "block_tables.offset: -4"},
      {"offset past the buffer",
       [&](v1::RegisterWorkerRequest* r) {
         bt(r)->set_offset(kTablesBytes + 4);
       },
       absl::StatusCode::kInvalidArgument, "block_tables.offset"},
      {"unaligned offset",
       [&](v1::RegisterWorkerRequest* r) { bt(r)->set_offset(4098); },
       absl::StatusCode::kInvalidArgument,
       "block_tables.offset: 4098 is not a multiple of 4"},
      {"unaligned row stride",
       [&](v1::RegisterWorkerRequest* r) { bt(r)->set_row_stride(18); },
       absl::StatusCode::kInvalidArgument, "block_tables.row_stride: 18"},
      {"row stride below max_blocks_per_seq",
       [&](v1::RegisterWorkerRequest* r) { bt(r)->set_row_stride(12); },
       absl::StatusCode::kInvalidArgument, "block_tables.row_stride: 12"},
      {"negative row stride",
       [&](v1::RegisterWorkerRequest* r) { bt(r)->set_row_stride(-16); },
       absl::StatusCode::kInvalidArgument, "block_tables.row_stride"},
      {"rows past the buffer",
       [&](v1::RegisterWorkerRequest* r) {
         bt(r)->set_offset(kTablesBytes - (kMaxSeqs - 1) * kTableStride -
                           4 * kMaxBlocks + 4);
       },
       absl::StatusCode::kInvalidArgument,
       "block_tables: 4 rows of 16 bytes every 32"},
      {"more sequences than the rows fit",
       [&](v1::RegisterWorkerRequest* r) {
         bt(r)->set_row_stride(kTablesBytes / 2);
       },
       absl::StatusCode::kInvalidArgument, "block_tables: 4 rows"},
      {"no layer with phase B",
       [](v1::RegisterWorkerRequest* r) {
         for (v1::StepLayer& l : *r->mutable_layers()) {
           l.clear_topk();
           l.clear_index_out();
         }
       },
       absl::StatusCode::kInvalidArgument,
       "block_tables: set, but no layer of this registration has phase B"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::RegisterWorkerRequest r = Registration();
    c.mutate(&r);
    absl::Status s = registry_->Register(owner_, r).status();
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
  }
  EXPECT_EQ(registry_->Counters().registrations, 0);
}

// Attack: another session's block-table buffer, not granted, cannot be
// named (the kernel would read its memory); granted, it can.
TEST_F(StepBlockTablesTest, AnotherSessionsBufferNeedsAGrant) {
  const uint64_t theirs = AddBuffer(other_, kTablesBytes);
  v1::RegisterWorkerRequest r = Registration();
  r.mutable_block_tables()->set_buffer_id(theirs);
  absl::Status s = registry_->Register(owner_, r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("block_tables.buffer_id = "));
  EXPECT_EQ(registry_->Counters().registrations, 0);
  // Its owner grants this session: accepted.
  Acl grant;
  grant.sessions.insert(owner_.session);
  ASSERT_TRUE(sessions_->GrantBuffer(other_, theirs, grant).ok());
  EXPECT_TRUE(registry_->Register(owner_, r).ok());
  // The intruder cannot name the owner's table buffer in its own
  // registration either (with its own doorbell and rows it would get
  // PERMISSION_DENIED for the rows first: name only the tables).
  v1::RegisterWorkerRequest mine = Registration();
  mine.set_doorbell_buffer_id(AddBuffer(other_, 4096));
  const uint64_t their_io = AddBuffer(other_, 1 << 20);
  for (v1::StepLayer& l : *mine.mutable_layers()) {
    l.mutable_main()->mutable_input()->set_buffer_id(their_io);
    l.mutable_index()->mutable_input()->set_buffer_id(their_io);
    l.mutable_topk()->set_buffer_id(their_io);
    l.mutable_index_out()->set_buffer_id(their_io);
  }
  ASSERT_EQ(mine.block_tables().buffer_id(), tables_);
  s = registry_->Register(other_, mine).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("block_tables.buffer_id = "));
  mine.mutable_block_tables()->set_buffer_id(theirs);
  EXPECT_TRUE(registry_->Register(other_, mine).ok());
}

TEST_F(StepBlockTablesTest, PlanHasNoTablesSectionWhenTheyAreInTheBuffer) {
  const uint64_t id = Register(Registration());
  ASSERT_NE(id, 0u);
  // Entries the host never sees: the buffer holds garbage, the step is
  // accepted (the kernel checks every entry it reads).
  int32_t* rows =
      reinterpret_cast<int32_t*>(BufferBase(tables_) + kTableOffset);
  for (int i = 0; i < kMaxSeqs * kTableStride / 4; ++i) rows[i] = -7 - i;
  absl::StatusOr<v1::StepResponse> r = registry_->Step(owner_, Step(id, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(factory_.last->plans.size(), 1u);
  const StepPlan& p = factory_.last->plans.back();
  EXPECT_TRUE(p.block_tables_in_buffer);
  EXPECT_EQ(p.sections.block_tables, -1);
  EXPECT_EQ(p.block_table_cols, 3);
  EXPECT_EQ(p.top_k, 16);
  EXPECT_GE(p.sections.row_seq, 0);
  EXPECT_GE(p.sections.seq_lens, 0);
  EXPECT_GE(p.sections.gate, 0);
  const size_t in_buffer_blob = p.blob.size();
  // The same step with inline tables: the section is there, 2 x 3 entries
  // (rounded to 4) more.
  v1::StepRequest inline_step = Step(id, 2);
  inline_step.set_block_tables_in_buffer(false);
  inline_step.set_block_tables(PackInt32s({1, 2, -1, 4, 5, 6}));
  r = registry_->Step(owner_, inline_step);
  ASSERT_TRUE(r.ok()) << r.status();
  const StepPlan& q = factory_.last->plans.back();
  EXPECT_FALSE(q.block_tables_in_buffer);
  ASSERT_GE(q.sections.block_tables, 0);
  EXPECT_EQ(q.blob[q.sections.block_tables + 5], 6);
  EXPECT_EQ(q.blob.size(), in_buffer_blob + 8);
}

TEST_F(StepBlockTablesTest, EveryStepRuleRefusesAndEnqueuesNothing) {
  v1::RegisterWorkerRequest without = Registration();
  without.clear_block_tables();
  const uint64_t plain = Register(without);
  RecordingEngine* plain_engine = factory_.last;
  v1::RegisterWorkerRequest no_b = Registration();
  no_b.clear_block_tables();
  for (v1::StepLayer& l : *no_b.mutable_layers()) {
    l.clear_topk();
    l.clear_index_out();
  }
  const uint64_t no_phase_b = Register(no_b);
  RecordingEngine* no_b_engine = factory_.last;
  const uint64_t id = Register(Registration());
  RecordingEngine* engine = factory_.last;
  ASSERT_NE(plain, 0u);
  ASSERT_NE(no_phase_b, 0u);
  ASSERT_NE(id, 0u);
  struct Case {
    std::string name;
    uint64_t registration;
    std::function<void(v1::StepRequest*)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"flag without a registered buffer", plain, [](v1::StepRequest*) {},
       "block_tables_in_buffer: set, but the registration has no "
       "block-table buffer"},
      {"flag with inline tables", id,
       [](v1::StepRequest* r) {
         r->set_block_tables(PackInt32s({1, 2, -1, 4, 5, 6}));
       },
       "block_tables: 24 bytes, but block_tables_in_buffer is set"},
      {"cols zero", id, [](v1::StepRequest* r) { r->set_block_table_cols(0); },
       "block_table_cols: 0 is outside [1, 4]"},
      {"cols above max_blocks_per_seq", id,
       [](v1::StepRequest* r) { r->set_block_table_cols(5); },
       "block_table_cols: 5 is outside [1, 4]"},
      {"cols negative", id,
       [](v1::StepRequest* r) { r->set_block_table_cols(-1); },
       "block_table_cols: -1"},
      {"flag without phase B", no_phase_b,
       [](v1::StepRequest* r) {
         r->set_top_k(0);
         r->set_block_table_cols(0);
       },
       "block_tables_in_buffer: set, but no layer of this registration has "
       "phase B"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::StepRequest r = Step(c.registration, 1);
    c.mutate(&r);
    absl::Status s = registry_->Step(owner_, r).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
  }
  for (RecordingEngine* e : {plain_engine, no_b_engine, engine}) {
    EXPECT_TRUE(e->plans.empty());
  }
  for (uint64_t reg : {plain, no_phase_b, id}) {
    absl::StatusOr<v1::RegistrationInfo> info = registry_->Status(owner_, reg);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->last_step_id(), 0u) << "a refused step consumed an id";
  }
  // The rules pass: step 1 of each is accepted.
  EXPECT_TRUE(registry_->Step(owner_, Step(id, 1)).ok());
  v1::StepRequest inline_step = Step(plain, 1);
  inline_step.set_block_tables_in_buffer(false);
  inline_step.set_block_tables(PackInt32s({1, 2, -1, 4, 5, 6}));
  EXPECT_TRUE(registry_->Step(owner_, inline_step).ok());
  v1::StepRequest no_b_step = Step(no_phase_b, 1);
  no_b_step.set_block_tables_in_buffer(false);
  no_b_step.set_top_k(0);
  no_b_step.set_block_table_cols(0);
  EXPECT_TRUE(registry_->Step(owner_, no_b_step).ok());
  EXPECT_EQ(engine->plans.size(), 1u);
}

}  // namespace
}  // namespace kvdepot::step
