// Device-resident slot mappings on the host (SPEC §10; docs/STEP_PATH.md
// "Slot mappings in device memory"): the registration's slot_mappings
// buffer (a negative test per rule naming its field; the rows it must hold
// follow the registration's compressed ratios; another session's buffer),
// the step's slot_mappings_in_buffer (a negative test per rule, nothing
// enqueued, no step id consumed) and the plan whose slot sections the
// device fills. The kernel's range checks of the entries are
// //tests/gpu:step_e2e_test's (SlotMappingsInDeviceMemory).
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/step/registry_fixture.h"

namespace kvdepot::step {
namespace {

using ::testing::HasSubstr;

constexpr int kMaxTokens = 8;
constexpr int64_t kRowBytes = 4 * kMaxTokens;  // packed row
constexpr int64_t kStride = 48;                // bytes between rows
constexpr int64_t kOffset = 1024;
constexpr int64_t kBufferBytes = 4096;
// Ratios 1, 4 and 16: rows main, ratio 4, ratio 16.
constexpr int kRows = 3;

class StepSlotBufferTest : public RegistryFixture {
 protected:
  void SetUp() override {
    RegistryFixture::SetUp();
    owner_ = Open("worker", 1000);
    other_ = Open("intruder", 1000);  // same uid, another session
    CreatePool("kv", "V41", 16, 64, 3);
    CreatePool("idx", "FP4_INDEX", 16, 64, 3);
    doorbell_ = AddBuffer(owner_, 4096);
    io_ = AddBuffer(owner_, 1 << 20);
    slots_ = AddBuffer(owner_, kBufferBytes);
  }

  // Layers of ratio 1, 4 and 16, each with main and index caches, no
  // phase B; the slot mappings in slots_ (rows of kStride from kOffset).
  v1::RegisterWorkerRequest Registration() const {
    v1::RegisterWorkerRequest r;
    r.set_doorbell_buffer_id(doorbell_);
    r.set_max_tokens(kMaxTokens);
    r.set_max_seqs(4);
    BufferSlices slices(io_);
    const int ratios[] = {1, 4, 16};
    for (int l = 0; l < 3; ++l) {
      v1::StepLayer* layer = r.add_layers();
      layer->set_ratio(ratios[l]);
      for (v1::StepCache* c : {layer->mutable_main(), layer->mutable_index()}) {
        const bool main = c == layer->mutable_main();
        c->set_pool(main ? "kv" : "idx");
        c->set_layer(l);
        slices.Next(c->mutable_input(), kMaxTokens * (main ? 512 : 128) * 2);
      }
    }
    v1::StepBufferRef* s = r.mutable_slot_mappings();
    s->set_buffer_id(slots_);
    s->set_offset(kOffset);
    s->set_row_stride(kStride);
    return r;
  }

  // Three tokens of two sequences, mappings in the buffer.
  static v1::StepRequest BufferStep(uint64_t reg, uint64_t step) {
    v1::StepRequest r;
    r.set_registration_id(reg);
    r.set_step_id(step);
    r.set_num_tokens(3);
    r.set_num_seqs(2);
    r.set_seq_lens(PackInt32s({10, 40}));
    r.set_query_lens(PackInt32s({1, 2}));
    r.set_slot_mappings_in_buffer(true);
    return r;
  }
  // The same step with its mappings inline.
  static v1::StepRequest InlineStep(uint64_t reg, uint64_t step) {
    v1::StepRequest r = BufferStep(reg, step);
    r.set_slot_mappings_in_buffer(false);
    r.set_slot_mapping(PackInt32s({5, -1, 700}));
    v1::CompressedSlots* c4 = r.add_compressed();
    c4->set_ratio(4);
    c4->set_slot_mapping(PackInt32s({-1, 3, -1}));
    v1::CompressedSlots* c16 = r.add_compressed();
    c16->set_ratio(16);
    c16->set_slot_mapping(PackInt32s({-1, -1, 9}));
    return r;
  }

  absl::Status RegisterStatus(const Caller& c,
                              const v1::RegisterWorkerRequest& r) {
    return registry_->Register(c, r).status();
  }

  Caller owner_, other_;
  uint64_t doorbell_ = 0, io_ = 0, slots_ = 0;
};

TEST_F(StepSlotBufferTest, RegistrationKeepsTheRowsAndStride) {
  ASSERT_NE(RegisterOk(owner_, Registration()), 0u);
  const BufferSpan& s = factory_.last_config.slot_mappings;
  ASSERT_TRUE(s.set());
  EXPECT_EQ(s.data(), BufferBase(owner_, slots_) + kOffset);
  EXPECT_EQ(s.row_stride, kStride);
  EXPECT_EQ(factory_.last_config.compressed_ratios,
            (std::vector<int32_t>{4, 16}));
  // Row stride 0 = packed rows of max_tokens entries.
  v1::RegisterWorkerRequest r = Registration();
  r.mutable_slot_mappings()->set_row_stride(0);
  ASSERT_NE(RegisterOk(owner_, r), 0u);
  EXPECT_EQ(factory_.last_config.slot_mappings.row_stride, kRowBytes);
  // The last offset: the three rows end exactly at the buffer's end.
  r = Registration();
  r.mutable_slot_mappings()->set_offset(kBufferBytes - (kRows - 1) * kStride -
                                        kRowBytes);
  EXPECT_NE(RegisterOk(owner_, r), 0u);
  // Without it the registration takes inline mappings only.
  r = Registration();
  r.clear_slot_mappings();
  ASSERT_NE(RegisterOk(owner_, r), 0u);
  EXPECT_FALSE(factory_.last_config.slot_mappings.set());
}

TEST_F(StepSlotBufferTest, EveryRegistrationRuleRefusesNamingTheField) {
  const uint64_t tiny = AddBuffer(owner_, 64);
  // Two rows fit from here, the registration's three do not.
  const int64_t two_rows = kBufferBytes - kStride - kRowBytes;
  struct Case {
    std::string name;
    std::function<void(v1::StepBufferRef*)> mutate;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"unknown buffer", [](v1::StepBufferRef* s) { s->set_buffer_id(777); },
       absl::StatusCode::kNotFound, "slot_mappings.buffer_id = 777"},
      {"buffer too small",
       [&](v1::StepBufferRef* s) {
         s->set_buffer_id(tiny);
         s->set_offset(0);
       },
       absl::StatusCode::kInvalidArgument,
       "slot_mappings: 3 rows of 32 bytes every 48 from offset 0 pass the "
       "buffer's 64 bytes"},
      {"rows fewer than 1 + ratios",
       [&](v1::StepBufferRef* s) { s->set_offset(two_rows); },
       absl::StatusCode::kInvalidArgument, "slot_mappings: 3 rows of 32"},
      {"offset past the buffer",
       [](v1::StepBufferRef* s) { s->set_offset(kBufferBytes + 4); },
       absl::StatusCode::kInvalidArgument, "slot_mappings.offset: 4100"},
      {"negative offset", [](v1::StepBufferRef* s) { s->set_offset(-8); },
       absl::StatusCode::kInvalidArgument, "slot_mappings.offset: -8"},
      {"misaligned offset", [](v1::StepBufferRef* s) { s->set_offset(1026); },
       absl::StatusCode::kInvalidArgument,
       "slot_mappings.offset: 1026 is not a multiple of 4"},
      {"misaligned row stride",
       [](v1::StepBufferRef* s) { s->set_row_stride(42); },
       absl::StatusCode::kInvalidArgument, "slot_mappings.row_stride: 42"},
      {"row stride below max_tokens",
       [](v1::StepBufferRef* s) { s->set_row_stride(28); },
       absl::StatusCode::kInvalidArgument,
       "slot_mappings.row_stride: 28 must be a multiple of 4 in [32, 2^30]"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::RegisterWorkerRequest r = Registration();
    c.mutate(r.mutable_slot_mappings());
    const absl::Status s = RegisterStatus(owner_, r);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
  }
  EXPECT_EQ(registry_->Counters().registrations, 0);
  // The rows follow the ratios: without the ratio-16 layer two rows are
  // enough at the offset refused above.
  v1::RegisterWorkerRequest r = Registration();
  r.mutable_layers()->RemoveLast();
  r.mutable_slot_mappings()->set_offset(two_rows);
  EXPECT_NE(RegisterOk(owner_, r), 0u);
}

// Attack: another session's buffer, not granted, cannot be named (the
// import kernel would read its memory); granted, it can.
TEST_F(StepSlotBufferTest, ForeignBufferNeedsAGrant) {
  const uint64_t theirs = AddBuffer(other_, kBufferBytes);
  v1::RegisterWorkerRequest r = Registration();
  r.mutable_slot_mappings()->set_buffer_id(theirs);
  absl::Status s = RegisterStatus(owner_, r);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("slot_mappings.buffer_id = "));
  EXPECT_EQ(registry_->Counters().registrations, 0);
  Acl grant;
  grant.sessions.insert(owner_.session);
  ASSERT_TRUE(sessions_->GrantBuffer(other_, theirs, grant).ok());
  EXPECT_NE(RegisterOk(owner_, r), 0u);
}

TEST_F(StepSlotBufferTest, EveryStepRuleRefusesAndEnqueuesNothing) {
  v1::RegisterWorkerRequest without = Registration();
  without.clear_slot_mappings();
  const uint64_t plain = RegisterOk(owner_, without);
  RecordingEngine* plain_engine = factory_.last;
  const uint64_t id = RegisterOk(owner_, Registration());
  RecordingEngine* engine = factory_.last;
  ASSERT_NE(plain, 0u);
  ASSERT_NE(id, 0u);
  // Refused, INVALID_ARGUMENT naming `message`.
  auto refused = [&](const v1::StepRequest& r, const std::string& message) {
    const absl::Status s = registry_->Step(owner_, r).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(message));
  };
  refused(BufferStep(plain, 1),
          "slot_mappings_in_buffer: set, but the registration has no "
          "slot-mapping buffer");
  v1::StepRequest r = BufferStep(id, 1);
  r.set_slot_mapping(PackInt32s({1, 2, 3}));
  refused(r, "slot_mapping: set, but slot_mappings_in_buffer is set");
  r = BufferStep(id, 1);
  r.set_compressed_slot_mapping(PackInt32s({-1, -1, 2}));
  refused(r, "compressed_slot_mapping: set, but slot_mappings_in_buffer");
  r = BufferStep(id, 1);
  v1::CompressedSlots* c = r.add_compressed();
  c->set_ratio(4);
  c->set_slot_mapping(PackInt32s({-1, 1, -1}));
  refused(r, "compressed: set, but slot_mappings_in_buffer is set");
  EXPECT_TRUE(plain_engine->plans.empty());
  EXPECT_TRUE(engine->plans.empty());
  for (uint64_t reg : {plain, id}) {
    absl::StatusOr<v1::RegistrationInfo> info = registry_->Status(owner_, reg);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->last_step_id(), 0u) << "a refused step consumed an id";
  }
  // The rules pass: the buffer step, and inline steps on either.
  EXPECT_TRUE(registry_->Step(owner_, BufferStep(id, 1)).ok());
  EXPECT_TRUE(registry_->Step(owner_, InlineStep(id, 2)).ok());
  EXPECT_TRUE(registry_->Step(owner_, InlineStep(plain, 1)).ok());
  EXPECT_EQ(engine->plans.size(), 2u);
}

TEST_F(StepSlotBufferTest, PlanReservesTheSlotSectionsForTheDevice) {
  const uint64_t id = RegisterOk(owner_, Registration());
  ASSERT_NE(id, 0u);
  // What the host never sees: out-of-range and duplicated entries in the
  // buffer; the step is accepted (the import kernel checks the range).
  int32_t* rows =
      reinterpret_cast<int32_t*>(BufferBase(owner_, slots_) + kOffset);
  for (int i = 0; i < kRows * kStride / 4; ++i) rows[i] = i % 2 ? -9 : 5000;
  ASSERT_TRUE(registry_->Step(owner_, BufferStep(id, 1)).ok());
  ASSERT_EQ(factory_.last->plans.size(), 1u);
  const StepPlan p = factory_.last->plans.back();
  EXPECT_TRUE(p.slot_mappings_in_buffer);
  const StepSections& s = p.sections;
  ASSERT_GE(s.slots, 0);
  ASSERT_EQ(s.compressed_count, 2);
  EXPECT_EQ(s.compressed_stride, 4);  // 3 tokens rounded up
  ASSERT_GE(s.compressed(1), 0);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(p.blob[s.slots + i], 0) << "the device fills slots[" << i << "]";
    EXPECT_EQ(p.blob[s.compressed(0) + i], 0);
    EXPECT_EQ(p.blob[s.compressed(1) + i], 0);
  }
  // The inline step has the same sections, filled from the request.
  ASSERT_TRUE(registry_->Step(owner_, InlineStep(id, 2)).ok());
  const StepPlan& q = factory_.last->plans.back();
  EXPECT_FALSE(q.slot_mappings_in_buffer);
  EXPECT_EQ(q.blob.size(), p.blob.size());
  EXPECT_EQ(q.blob[q.sections.slots + 2], 700);
  EXPECT_EQ(q.blob[q.sections.compressed(0) + 1], 3);
  EXPECT_EQ(q.blob[q.sections.compressed(1) + 2], 9);
  // Inline mappings are still checked on the host: a duplicate is refused.
  factory_.last->Finish();
  v1::StepRequest dup = InlineStep(id, 3);
  dup.set_slot_mapping(PackInt32s({5, -1, 5}));
  const absl::Status st = registry_->Step(owner_, dup).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("slot_mapping[2] = 5"));
}

}  // namespace
}  // namespace kvdepot::step
