// The step path's host side without a GPU: registration checks, the step
// plan's checks (a negative test per rule; a refused step changes
// nothing), step ids and queue depth, owners and grants (attacks by
// another session), the watchdog, and the CPU backend's refusal. The
// engine is a test double that records plans and finishes them on demand
// (registry_fixture.h).
#include "server/step/step_registry.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/step_doorbell.h"
#include "server/limits.h"
#include "server/step/registry_fixture.h"

namespace kvdepot::step {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kLayers = 2;

class StepRegistryTest : public RegistryFixture {
 protected:
  void SetUp() override {
    RegistryFixture::SetUp();
    owner_ = Open("worker", 1000);
    other_ = Open("intruder", 2000);
    CreatePool("main", "V41", 16, 64, kLayers);
    CreatePool("swa", "V41", 32, 16, kLayers);
    CreatePool("index", "FP4_INDEX", 16, 64, kLayers);
    doorbell_ = AddBuffer(owner_, 4096);
    io_ = AddBuffer(owner_, 1 << 20);
  }

  // Two layers with main, SWA and index caches and phase B; the SWA index.
  v1::RegisterWorkerRequest Registration() const {
    v1::RegisterWorkerRequest r;
    r.set_doorbell_buffer_id(doorbell_);
    r.set_max_tokens(8);
    r.set_max_seqs(4);
    r.set_max_top_k(16);
    r.set_max_blocks_per_seq(4);
    r.set_name("rank0");
    BufferSlices slices(io_);
    auto ref = [&](v1::StepBufferRef* out, int64_t bytes) {
      slices.Next(out, bytes);
    };
    for (int l = 0; l < kLayers; ++l) {
      v1::StepLayer* layer = r.add_layers();
      layer->set_window(8);
      for (auto [cache, pool, elements] :
           {std::tuple{layer->mutable_main(), "main", 512},
            std::tuple{layer->mutable_swa(), "swa", 512},
            std::tuple{layer->mutable_index(), "index", 128}}) {
        cache->set_pool(pool);
        cache->set_layer(l);
        ref(cache->mutable_input(), 8 * elements * 2);
      }
      ref(layer->mutable_topk(), 8 * 16 * 4);
      ref(layer->mutable_index_out(), 8 * 16 * 4);
    }
    r.mutable_swa_index()->set_pool("swa");
    r.mutable_swa_index()->set_window(8);
    ref(r.mutable_swa_index()->mutable_out(), 8 * 8 * 4);
    return r;
  }

  uint64_t Register() { return RegisterOk(owner_, Registration()); }

  // Two sequences: 1 and 2 query tokens.
  v1::StepRequest Step(uint64_t reg, uint64_t step) const {
    v1::StepRequest r;
    r.set_registration_id(reg);
    r.set_step_id(step);
    r.set_num_tokens(3);
    r.set_slot_mapping(PackInt32s({5, -1, 700}));
    r.set_num_seqs(2);
    r.set_seq_lens(PackInt32s({10, 40}));
    r.set_query_lens(PackInt32s({1, 2}));
    r.set_swa_state_ids(PackInt32s({3, 7}));
    r.set_block_tables(PackInt32s({1, 2, -1, -1, 4, 5, 6, -1}));
    r.set_block_table_cols(4);
    r.set_top_k(16);
    return r;
  }

  absl::Status StepError(v1::StepRequest r) {
    return registry_->Step(owner_, r).status();
  }

  Caller owner_, other_;
  uint64_t doorbell_ = 0, io_ = 0;
};

TEST_F(StepRegistryTest, StepBuildsOnePlanWithEverySection) {
  const uint64_t id = Register();
  ASSERT_NE(id, 0u);
  absl::StatusOr<v1::StepResponse> r = registry_->Step(owner_, Step(id, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->queued(), 1);
  ASSERT_EQ(factory_.last->plans.size(), 1u);
  const StepPlan& p = factory_.last->plans.front();
  const StepSections& s = p.sections;
  EXPECT_EQ(p.step_id, 1u);
  EXPECT_EQ(p.num_tokens, 3);
  auto at = [&](int64_t off, int i) { return p.blob[off + i]; };
  EXPECT_EQ(at(s.slots, 0), 5);
  EXPECT_EQ(at(s.slots, 1), -1);
  EXPECT_EQ(at(s.slots, 2), 700);
  // SWA ring 32: state 3 position 9; state 7 positions 38, 39.
  EXPECT_EQ(at(s.swa_slots, 0), 3 * 32 + 9);
  EXPECT_EQ(at(s.swa_slots, 1), 7 * 32 + 38 % 32);
  EXPECT_EQ(at(s.swa_slots, 2), 7 * 32 + 39 % 32);
  EXPECT_EQ(at(s.row_seq, 0), 0);
  EXPECT_EQ(at(s.row_seq, 2), 1);
  EXPECT_EQ(at(s.seq_lens, 1), 40);
  EXPECT_EQ(at(s.block_tables, 5), 5);
  // SWA decode windows (W = 8): position 9 sees 2..9.
  EXPECT_EQ(at(s.swa_start, 0), 2);
  EXPECT_EQ(at(s.swa_valid, 0), 8);
  EXPECT_EQ(p.blob.size() % 4, 0u);
  EXPECT_LE(static_cast<int64_t>(p.blob.size()),
            MaxBlobElements(factory_.last_config));
}

// A mixed step: a decode token, a new sequence's prefill chunk of four
// tokens (positions 0-3) and a chunk of two in the middle of a long
// sequence (positions 44, 45: the SWA ring of 32 wraps), in one request.
TEST_F(StepRegistryTest, MixedPrefillAndDecodeRowsGetTheirOwnPositions) {
  const uint64_t id = Register();
  ASSERT_NE(id, 0u);
  v1::StepRequest r = Step(id, 1);
  r.set_num_tokens(7);
  r.set_slot_mapping(PackInt32s({5, 100, 101, 102, 103, 700, 701}));
  r.set_num_seqs(3);
  r.set_seq_lens(PackInt32s({10, 4, 46}));
  r.set_query_lens(PackInt32s({1, 4, 2}));
  r.set_swa_state_ids(PackInt32s({3, 7, 9}));
  r.set_block_tables(PackInt32s({1, 2, -1, -1, 4, -1, -1, -1, 8, 9, 10, 11}));
  absl::StatusOr<v1::StepResponse> resp = registry_->Step(owner_, r);
  ASSERT_TRUE(resp.ok()) << resp.status();
  const StepPlan& p = factory_.last->plans.front();
  const StepSections& s = p.sections;
  auto at = [&](int64_t off, int i) { return p.blob[off + i]; };
  const int row_seq[] = {0, 1, 1, 1, 1, 2, 2};
  const int position[] = {9, 0, 1, 2, 3, 44, 45};
  const int state[] = {3, 7, 7, 7, 7, 9, 9};
  for (int i = 0; i < 7; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(at(s.row_seq, i), row_seq[i]);
    EXPECT_EQ(at(s.slots, i),
              (std::vector<int>{5, 100, 101, 102, 103, 700, 701}[i]));
    EXPECT_EQ(at(s.swa_slots, i), state[i] * 32 + position[i] % 32);
    // Window 8: position q sees [max(0, q - 7), q].
    EXPECT_EQ(at(s.swa_start, i), std::max(0, position[i] - 7));
    EXPECT_EQ(at(s.swa_valid, i), std::min(8, position[i] + 1));
  }
  EXPECT_EQ(at(s.seq_lens, 2), 46);
}

TEST_F(StepRegistryTest, StepIdsAreConsecutiveAndTwoDeep) {
  const uint64_t id = Register();
  EXPECT_EQ(StepError(Step(id, 2)).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(registry_->Step(owner_, Step(id, 1)).ok());
  EXPECT_EQ(StepError(Step(id, 1)).code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<v1::StepResponse> second =
      registry_->Step(owner_, Step(id, 2));
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->queued(), 2);
  absl::Status third = StepError(Step(id, 3));
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(third.message()), HasSubstr("in flight"));
  EXPECT_EQ(factory_.last->plans.size(), 2u);
  EXPECT_EQ(registry_->Counters().steps_rejected_queue_full, 1);
  factory_.last->Finish();
  ASSERT_TRUE(registry_->Step(owner_, Step(id, 3)).ok());
  absl::StatusOr<v1::RegistrationInfo> info = registry_->Status(owner_, id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->last_step_id(), 3u);
  EXPECT_EQ(info->completed_step_id(), 1u);
  EXPECT_EQ(info->in_flight(), 2);
}

TEST_F(StepRegistryTest, EveryStepRuleRefusesAndChangesNothing) {
  const uint64_t id = Register();
  struct Case {
    std::string name;
    std::function<void(v1::StepRequest*)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"slot out of range",
       [](v1::StepRequest* r) {
         r->set_slot_mapping(PackInt32s({5, -1, 1024}));
       },
       "slot_mapping[2] = 1024"},
      {"slot below -1",
       [](v1::StepRequest* r) {
         r->set_slot_mapping(PackInt32s({5, -2, 7}));
       },
       "slot_mapping[1] = -2"},
      {"duplicate slot",
       [](v1::StepRequest* r) {
         r->set_slot_mapping(PackInt32s({5, 9, 5}));
       },
       "slot_mapping[2]"},
      {"packed size",
       [](v1::StepRequest* r) {
         r->set_slot_mapping(PackInt32s({5, 9}));
       },
       "slot_mapping"},
      {"num_tokens too large", [](v1::StepRequest* r) { r->set_num_tokens(9); },
       "num_tokens"},
      {"num_tokens zero", [](v1::StepRequest* r) { r->set_num_tokens(0); },
       "num_tokens"},
      {"num_seqs too large", [](v1::StepRequest* r) { r->set_num_seqs(5); },
       "num_seqs"},
      {"query_lens sum",
       [](v1::StepRequest* r) {
         r->set_query_lens(PackInt32s({1, 1}));
       },
       "query_lens: sum 2"},
      {"query_lens zero",
       [](v1::StepRequest* r) {
         r->set_query_lens(PackInt32s({0, 3}));
       },
       "query_lens[0]"},
      {"seq_lens below query_lens",
       [](v1::StepRequest* r) {
         r->set_seq_lens(PackInt32s({10, 1}));
       },
       "seq_lens[1]"},
      {"state id outside the ring pool",
       [](v1::StepRequest* r) {
         r->set_swa_state_ids(PackInt32s({3, 16}));
       },
       "state"},
      {"shared ring",
       [](v1::StepRequest* r) {
         r->set_swa_state_ids(PackInt32s({3, 3}));
         r->set_seq_lens(PackInt32s({10, 10}));
       },
       "swa slots"},
      {"block table entry",
       [](v1::StepRequest* r) {
         r->set_block_tables(PackInt32s({1, 2, -1, -1, 4, 64, 6, -1}));
       },
       "block_tables[1][1] = 64"},
      {"block table cols",
       [](v1::StepRequest* r) { r->set_block_table_cols(5); },
       "block_table_cols"},
      {"top_k too large", [](v1::StepRequest* r) { r->set_top_k(17); },
       "top_k"},
      {"top_k zero", [](v1::StepRequest* r) { r->set_top_k(0); }, "top_k"},
      {"compressed slots without ratio",
       [](v1::StepRequest* r) {
         r->set_compressed_slot_mapping(PackInt32s({1, 2, 3}));
       },
       "compressed_slot_mapping"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::StepRequest r = Step(id, 1);
    c.mutate(&r);
    absl::Status s = StepError(r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
  }
  EXPECT_TRUE(factory_.last->plans.empty());
  absl::StatusOr<v1::RegistrationInfo> info = registry_->Status(owner_, id);
  EXPECT_EQ(info->last_step_id(), 0u);
  EXPECT_TRUE(registry_->Step(owner_, Step(id, 1)).ok());
}

// The largest maxima a registration may ask for (65536 tokens, 16384
// sequences of 65536 blocks: 4 GiB of block table) cost staging for 2^22
// inline entries only; a step with more inline entries is refused with the
// way out, and nothing is planned.
TEST_F(StepRegistryTest, InlineBlockTablesAreBoundedAndSoIsStaging) {
  const int32_t tokens = 4096;
  const uint64_t io = AddBuffer(owner_, 8 << 20);
  v1::RegisterWorkerRequest r;
  r.set_doorbell_buffer_id(doorbell_);
  r.set_max_tokens(tokens);
  r.set_max_seqs(tokens);
  r.set_max_top_k(16);
  r.set_max_blocks_per_seq(kMaxBlocksPerSeq);
  BufferSlices slices(io);
  v1::StepLayer* layer = r.add_layers();
  layer->mutable_main()->set_pool("main");
  slices.Next(layer->mutable_main()->mutable_input(), tokens * 512 * 2);
  layer->mutable_index()->set_pool("index");
  slices.Next(layer->mutable_index()->mutable_input(), tokens * 128 * 2);
  slices.Next(layer->mutable_topk(), tokens * 16 * 4);
  slices.Next(layer->mutable_index_out(), tokens * 16 * 4);
  const uint64_t id = RegisterOk(owner_, r);
  ASSERT_NE(id, 0u);
  // 6 x 4096 + 4096 + 2^22 + 4 entries: 16.1 MiB, not 1 GiB.
  EXPECT_LE(4 * MaxBlobElements(factory_.last_config), int64_t{17} << 20);
  v1::StepRequest step;
  step.set_registration_id(id);
  step.set_step_id(1);
  step.set_num_tokens(tokens);
  step.set_slot_mapping(PackInt32s(std::vector<int32_t>(tokens, -1)));
  step.set_num_seqs(tokens);
  step.set_seq_lens(PackInt32s(std::vector<int32_t>(tokens, 1)));
  step.set_query_lens(PackInt32s(std::vector<int32_t>(tokens, 1)));
  step.set_top_k(16);
  step.set_block_table_cols(1025);  // 4096 x 1025 > 2^22
  absl::Status s = StepError(step);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("block_tables: num_seqs * block_table_cols = 4198400 "
                        "entries inline, more than 4194304; write them to the "
                        "registered block-table buffer"));
  EXPECT_TRUE(factory_.last->plans.empty());
  // At the bound the step is planned (its table all -1).
  step.set_block_table_cols(1024);
  step.set_block_tables(
      PackInt32s(std::vector<int32_t>(int64_t{tokens} * 1024, -1)));
  EXPECT_TRUE(registry_->Step(owner_, step).ok());
}

// Layer 1 at ratio 4: its main and index caches store compressed rows
// from compressed_slot_mapping (layer 0 stays per token).
TEST_F(StepRegistryTest, CompressedMainCachesTakeTheCompressedSlots) {
  v1::RegisterWorkerRequest reg = Registration();
  reg.mutable_layers(1)->set_ratio(4);
  absl::StatusOr<v1::RegisterWorkerResponse> made =
      registry_->Register(owner_, reg);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(factory_.last_config.compressed_ratios, std::vector<int32_t>{4});
  v1::StepRequest r = Step(made->registration_id(), 1);
  r.set_compressed_slot_mapping(PackInt32s({-1, 17, -1}));
  absl::StatusOr<v1::StepResponse> ok = registry_->Step(owner_, r);
  ASSERT_TRUE(ok.ok()) << ok.status();
  const StepPlan& p = factory_.last->plans.back();
  ASSERT_GE(p.sections.compressed_slots, 0);
  EXPECT_EQ(p.sections.compressed_slots % 4, 0) << "16-byte aligned";
  EXPECT_EQ(p.blob[p.sections.compressed_slots + 0], -1);
  EXPECT_EQ(p.blob[p.sections.compressed_slots + 1], 17);
  EXPECT_EQ(p.blob[p.sections.compressed_slots + 2], -1);
  EXPECT_EQ(p.blob[p.sections.slots + 2], 700);
  EXPECT_LE(static_cast<int64_t>(p.blob.size()),
            MaxBlobElements(factory_.last_config));
}

// Each rule of compressed_slot_mapping refuses the step, naming the field
// and index, and consumes no step id.
TEST_F(StepRegistryTest, EveryCompressedSlotRuleRefuses) {
  v1::RegisterWorkerRequest reg = Registration();
  reg.mutable_layers(1)->set_ratio(4);
  // Only a main cache at ratio 4 (no index cache, no phase B) still needs
  // the compressed slots: the main pool (16 x 64 = 1024 slots) bounds them.
  reg.mutable_layers(1)->clear_index();
  reg.mutable_layers(1)->clear_topk();
  reg.mutable_layers(1)->clear_index_out();
  absl::StatusOr<v1::RegisterWorkerResponse> made =
      registry_->Register(owner_, reg);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(factory_.last_config.compressed_ratios, std::vector<int32_t>{4});
  const uint64_t id = made->registration_id();
  struct Case {
    std::string name;
    std::string compressed;  // packed; "missing" = not set
    std::string message;
  };
  const std::vector<Case> cases = {
      {"missing", "missing", "compressed_slot_mapping"},
      {"packed size", PackInt32s({1, 2}), "compressed_slot_mapping"},
      {"out of the main pool", PackInt32s({-1, 1024, -1}),
       "compressed_slot_mapping[1] = 1024 is outside [-1, 1024)"},
      {"below -1", PackInt32s({-2, 3, -1}), "compressed_slot_mapping[0] = -2"},
      {"duplicate", PackInt32s({9, -1, 9}),
       "compressed_slot_mapping[2] = 9 duplicates compressed_slot_mapping[0]"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::StepRequest r = Step(id, 1);
    if (c.compressed != "missing") r.set_compressed_slot_mapping(c.compressed);
    absl::Status s = StepError(r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
  }
  EXPECT_TRUE(factory_.last->plans.empty());
  v1::StepRequest r = Step(id, 1);
  r.set_compressed_slot_mapping(PackInt32s({-1, -1, 1023}));
  EXPECT_TRUE(registry_->Step(owner_, r).ok());
}

// Layers of two ratios > 1 are accepted (one compressed mapping each,
// step_ratios_test.cc); a layer of ratio 2 with only an SWA cache stores
// nothing compressed and adds no ratio.
TEST_F(StepRegistryTest, OnlyCompressedCachesMakeACompressedRatio) {
  v1::RegisterWorkerRequest reg = Registration();
  reg.mutable_layers(0)->set_ratio(4);
  reg.mutable_layers(1)->set_ratio(2);
  ASSERT_TRUE(registry_->Register(owner_, reg).ok());
  EXPECT_EQ(factory_.last_config.compressed_ratios,
            (std::vector<int32_t>{2, 4}));
  reg.mutable_layers(1)->clear_main();
  reg.mutable_layers(1)->clear_index();
  reg.mutable_layers(1)->clear_topk();
  reg.mutable_layers(1)->clear_index_out();
  EXPECT_TRUE(registry_->Register(owner_, reg).ok());
  EXPECT_EQ(factory_.last_config.compressed_ratios, std::vector<int32_t>{4});
  EXPECT_EQ(factory_.last_config.layers[1].compressed, -1);
}

TEST_F(StepRegistryTest, EveryRegistrationRuleRefuses) {
  struct Case {
    std::string name;
    std::function<void(v1::RegisterWorkerRequest*)> mutate;
    absl::StatusCode code;
    std::string message;
  };
  const uint64_t small = AddBuffer(owner_, 64);
  const std::vector<Case> cases = {
      {"no layers", [](v1::RegisterWorkerRequest* r) { r->clear_layers(); },
       absl::StatusCode::kInvalidArgument, "layers size"},
      {"max_tokens", [](v1::RegisterWorkerRequest* r) { r->set_max_tokens(0); },
       absl::StatusCode::kInvalidArgument, "max_tokens"},
      {"doorbell too small",
       [small](v1::RegisterWorkerRequest* r) {
         r->set_doorbell_buffer_id(small);
       },
       absl::StatusCode::kInvalidArgument, "doorbell_buffer_id"},
      {"unknown doorbell",
       [](v1::RegisterWorkerRequest* r) { r->set_doorbell_buffer_id(999); },
       absl::StatusCode::kNotFound, "doorbell_buffer_id"},
      {"layer out of range",
       [](v1::RegisterWorkerRequest* r) {
         r->mutable_layers(1)->mutable_main()->set_layer(2);
       },
       absl::StatusCode::kInvalidArgument, "layers[1].main.layer"},
      {"unknown pool",
       [](v1::RegisterWorkerRequest* r) {
         r->mutable_layers(0)->mutable_swa()->set_pool("nope");
       },
       absl::StatusCode::kNotFound, "layers[0].swa.pool"},
      {"input past the buffer",
       [](v1::RegisterWorkerRequest* r) {
         r->mutable_layers(0)->mutable_main()->mutable_input()->set_offset(
             (1 << 20) - 1024);
       },
       absl::StatusCode::kInvalidArgument, "layers[0].main.input"},
      {"negative offset",
       [](v1::RegisterWorkerRequest* r) {
         r->mutable_layers(0)->mutable_topk()->set_offset(-4);
       },
       absl::StatusCode::kInvalidArgument, "layers[0].topk.offset"},
      {"unaligned input",
       [](v1::RegisterWorkerRequest* r) {
         r->mutable_layers(0)->mutable_index()->mutable_input()->set_offset(8);
       },
       absl::StatusCode::kInvalidArgument, "layers[0].index.input.offset"},
      {"strided input",
       [](v1::RegisterWorkerRequest* r) {
         r->mutable_layers(0)->mutable_main()->mutable_input()->set_row_stride(
             4096);
       },
       absl::StatusCode::kInvalidArgument, "row_stride"},
      {"topk without index_out",
       [](v1::RegisterWorkerRequest* r) {
         r->mutable_layers(1)->clear_index_out();
       },
       absl::StatusCode::kInvalidArgument, "layers[1]"},
      {"topk without index cache",
       [](v1::RegisterWorkerRequest* r) {
         r->mutable_layers(1)->clear_index();
       },
       absl::StatusCode::kInvalidArgument, "layers[1].topk"},
      {"window beyond the ring",
       [](v1::RegisterWorkerRequest* r) {
         r->mutable_swa_index()->set_window(33);
       },
       absl::StatusCode::kInvalidArgument, "swa_index.window"},
      {"long name",
       [](v1::RegisterWorkerRequest* r) { r->set_name(std::string(65, 'n')); },
       absl::StatusCode::kInvalidArgument, "name"},
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

// Attacks: another session names the owner's doorbell or buffers, or
// drives, reads, grants or removes a registration it was not granted.
TEST_F(StepRegistryTest, AnotherSessionCanNeitherUseNorDrive) {
  EXPECT_EQ(registry_->Register(other_, Registration()).status().code(),
            absl::StatusCode::kPermissionDenied);  // someone else's doorbell
  v1::RegisterWorkerRequest r = Registration();
  r.set_doorbell_buffer_id(AddBuffer(other_, 4096));
  EXPECT_EQ(registry_->Register(other_, r).status().code(),
            absl::StatusCode::kPermissionDenied);  // someone else's rows
  const uint64_t id = Register();
  v1::StepRequest step = Step(id, 1);
  EXPECT_EQ(registry_->Step(other_, step).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(registry_->Status(other_, id).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(registry_->Unregister(other_, id).code(),
            absl::StatusCode::kPermissionDenied);
  v1::GrantRegistrationRequest g;
  g.set_registration_id(id);
  g.add_sessions(other_.session);
  EXPECT_EQ(registry_->Grant(other_, g).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(registry_->List(other_).empty());
  EXPECT_EQ(registry_->Step(Caller(), step).status().code(),
            absl::StatusCode::kUnauthenticated);
  // Granted: it may drive the registration, still not remove or grant it.
  ASSERT_TRUE(registry_->Grant(owner_, g).ok());
  EXPECT_TRUE(registry_->Step(other_, step).ok());
  EXPECT_EQ(registry_->List(other_).size(), 1u);
  EXPECT_EQ(registry_->Unregister(other_, id).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(registry_->Grant(other_, g).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(registry_->Unregister(owner_, id).ok());
  EXPECT_EQ(registry_->Status(owner_, id).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(StepRegistryTest, GrantsCannotGrowTheAccessListWithoutBound) {
  const uint64_t id = Register();
  v1::GrantRegistrationRequest g;
  g.set_registration_id(id);
  for (uint32_t u = 0; u < 200; ++u) g.add_uids(50000 + u);
  ASSERT_TRUE(registry_->Grant(owner_, g).ok());
  ASSERT_TRUE(registry_->Grant(owner_, g).ok());  // nothing new
  // 57 more would be 257 uids; this grant also names the other session,
  // which must not be let in by the refused grant.
  v1::GrantRegistrationRequest more;
  more.set_registration_id(id);
  for (uint32_t u = 0; u < 57; ++u) more.add_uids(60000 + u);
  more.add_sessions(other_.session);
  const absl::Status s = registry_->Grant(owner_, more);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()),
              ::testing::HasSubstr(absl::StrCat(
                  "registration ", id,
                  ": its access list would hold 257 uids, more than 256")));
  EXPECT_EQ(LimitOf(s), Limit::kAclEntries);
  EXPECT_EQ(registry_->Status(other_, id).status().code(),
            absl::StatusCode::kPermissionDenied);
  more.clear_uids();
  for (uint32_t u = 0; u < 56; ++u) more.add_uids(60000 + u);
  ASSERT_TRUE(registry_->Grant(owner_, more).ok());  // 256 exactly
  EXPECT_TRUE(registry_->Status(other_, id).ok());
}

TEST_F(StepRegistryTest, WatchdogCancelsALateStepOnce) {
  const uint64_t id = Register();
  v1::StepRequest r = Step(id, 1);
  r.set_deadline_ms(1);
  ASSERT_TRUE(registry_->Step(owner_, r).ok());
  registry_->Watch(absl::Now());  // not yet late (1 ms)
  registry_->Watch(absl::Now() + absl::Seconds(1));
  registry_->Watch(absl::Now() + absl::Seconds(2));
  EXPECT_EQ(factory_.last->cancels, 1);
  factory_.last->Finish(doorbell::kStatusCancelled);
  absl::StatusOr<v1::RegistrationInfo> info = registry_->Status(owner_, id);
  EXPECT_TRUE(info->cancelled());
  EXPECT_THAT(info->cancel_reason(), HasSubstr("watchdog"));
  EXPECT_EQ(info->watchdog_expiries(), 1u);
  EXPECT_EQ(info->status_bits(), doorbell::kStatusCancelled);
  absl::Status s = StepError(Step(id, 2));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("cancelled"));
  EXPECT_EQ(registry_->Counters().watchdog_expiries, 1);
}

TEST_F(StepRegistryTest, ClosedWorkerSessionCancels) {
  const uint64_t id = Register();
  ASSERT_TRUE(registry_->Step(owner_, Step(id, 1)).ok());
  registry_->Watch(absl::Now());
  EXPECT_EQ(factory_.last->cancels, 0);
  sessions_->CloseNumber(owner_.session);
  registry_->Watch(absl::Now());
  EXPECT_EQ(factory_.last->cancels, 1);
  EXPECT_EQ(registry_->Counters().cancels, 1);
  // Kept while its step is in flight and for a while after; then removed.
  registry_->Watch(absl::Now() + absl::Minutes(5));
  EXPECT_EQ(registry_->Counters().registrations, 1);
  factory_.last->Finish(doorbell::kStatusCancelled);
  registry_->Watch(absl::Now());
  EXPECT_EQ(registry_->Counters().registrations, 1);
  registry_->Watch(absl::Now() + absl::Minutes(5));
  EXPECT_EQ(registry_->Counters().registrations, 0);
  EXPECT_EQ(registry_->Status(owner_, id).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(StepRegistryTest, OutOfRangeAndStatusAreReported) {
  const uint64_t id = Register();
  ASSERT_TRUE(registry_->Step(owner_, Step(id, 1)).ok());
  factory_.last->Finish(doorbell::kStatusOutOfRange, 7);
  absl::StatusOr<v1::RegistrationInfo> info = registry_->Status(owner_, id);
  EXPECT_EQ(info->out_of_range(), 7u);
  EXPECT_EQ(info->status_bits(), doorbell::kStatusOutOfRange);
  EXPECT_EQ(info->steps_completed(), 1u);
  EXPECT_EQ(registry_->Counters().out_of_range, 7);
  EXPECT_EQ(registry_->Counters().steps_with_status, 1);
  const std::string text = registry_->RenderPrometheus();
  EXPECT_THAT(text, HasSubstr("kvdepot_step_out_of_range_total 7\n"));
  EXPECT_THAT(text, HasSubstr("kvdepot_steps_completed_total 1\n"));
  const std::string label =
      absl::StrCat("{registration=\"", id, "\",name=\"rank0\"}");
  EXPECT_THAT(
      text, HasSubstr(absl::StrCat("kvdepot_step_status_bits", label, " 4\n")));
  EXPECT_THAT(text,
              HasSubstr(absl::StrCat("kvdepot_step_registration_out_of_range",
                                     label, " 7\n")));
  EXPECT_THAT(
      text, HasSubstr(absl::StrCat("kvdepot_step_registration_completed_total",
                                   label, " 1\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("kvdepot_step_last_finished_id",
                                           label, " 1\n")));
  EXPECT_THAT(text,
              HasSubstr(absl::StrCat("kvdepot_step_cancelled", label, " 0\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("kvdepot_step_latency_us_count{"
                                           "registration=\"",
                                           id, "\",name=\"rank0\"} 1\n")));
}

// The phase times an engine reports land in the registration's phase
// histograms by kind (phase 0 begins the step, then A and B per layer) and
// their median in StepStatus' handoff_p50_us.
TEST_F(StepRegistryTest, PhaseTimesFillTheHistogramsAndTheMedian) {
  const uint64_t id = Register();
  ASSERT_TRUE(registry_->Step(owner_, Step(id, 1)).ok());
  EXPECT_EQ(registry_->Status(owner_, id)->handoff_p50_us(), 0);
  // begin 3 us; A: 15, 15; B: 15, 700. The median of A and B is rank 2
  // of 4, the second of the three values in (10, 20]: 10 + 10 * 2 / 3.
  factory_.last->Finish(0, 0, {3, 15, 15, 15, 700}, /*instantiated=*/true);
  EXPECT_DOUBLE_EQ(registry_->Status(owner_, id)->handoff_p50_us(),
                   10 + 10 * 2.0 / 3);
  const std::string text = registry_->RenderPrometheus();
  const std::string label =
      absl::StrCat("registration=\"", id, "\",name=\"rank0\"");
  EXPECT_THAT(text, HasSubstr(absl::StrCat("kvdepot_step_phase_us_count{",
                                           label, ",phase=\"begin\"} 1\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("kvdepot_step_phase_us_count{",
                                           label, ",phase=\"A\"} 2\n")));
  EXPECT_THAT(text,
              HasSubstr(absl::StrCat("kvdepot_step_phase_us_bucket{", label,
                                     ",phase=\"B\",le=\"500\"} 1\n")));
  EXPECT_THAT(text, HasSubstr("kvdepot_step_graph_instantiations_total 1\n"));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("kvdepot_step_phase_us_sum{", label,
                                           ",phase=\"B\"} 715\n")));
}

// Every metric family is one group of lines (HELP, TYPE, then all its
// samples), as the text format requires, with two registrations.
TEST_F(StepRegistryTest, MetricFamiliesAreNotInterleaved) {
  const uint64_t a = Register();
  const uint64_t b = Register();
  ASSERT_NE(a, b);
  const std::string text = registry_->RenderPrometheus();
  std::vector<std::string> order;  // family of each sample line, in order
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    std::string family(line.substr(0, line.find_first_of("{ ")));
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      for (const char* histogram :
           {"kvdepot_step_latency_us", "kvdepot_step_phase_us"}) {
        if (family == absl::StrCat(histogram, suffix)) family = histogram;
      }
    }
    if (order.empty() || order.back() != family) order.push_back(family);
  }
  std::set<std::string> seen;
  for (const std::string& f : order) {
    EXPECT_TRUE(seen.insert(f).second) << f << " is split in:\n" << text;
  }
  EXPECT_TRUE(seen.count("kvdepot_step_cancelled"));
}

// A watchdog cancel shows in the registration's own metrics.
TEST_F(StepRegistryTest, WatchdogCancelShowsInTheRegistrationsMetrics) {
  const uint64_t id = Register();
  v1::StepRequest r = Step(id, 1);
  r.set_deadline_ms(1);
  ASSERT_TRUE(registry_->Step(owner_, r).ok());
  registry_->Watch(absl::Now() + absl::Seconds(1));
  const std::string text = registry_->RenderPrometheus();
  const std::string label =
      absl::StrCat("{registration=\"", id, "\",name=\"rank0\"}");
  EXPECT_THAT(text,
              HasSubstr(absl::StrCat("kvdepot_step_cancelled", label, " 1\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat(
                        "kvdepot_step_registration_watchdog_expiries_total",
                        label, " 1\n")));
  EXPECT_THAT(text,
              HasSubstr(absl::StrCat("kvdepot_step_in_flight", label, " 1\n")));
  EXPECT_THAT(text, HasSubstr("kvdepot_step_cancels_total 1\n"));
  EXPECT_THAT(text, HasSubstr("kvdepot_step_watchdog_expiries_total 1\n"));
  factory_.last->Finish(doorbell::kStatusCancelled);
}

// Attack: a registration name cannot end its label or forge a line.
TEST_F(StepRegistryTest, RegistrationNameIsEscapedInMetrics) {
  v1::RegisterWorkerRequest req = Registration();
  req.set_name("x\"} 1\nkvdepot_forged 1\n\\\x01\xff");
  absl::StatusOr<v1::RegisterWorkerResponse> reg =
      registry_->Register(owner_, req);
  ASSERT_TRUE(reg.ok()) << reg.status();
  const std::string text = registry_->RenderPrometheus();
  EXPECT_THAT(text, Not(HasSubstr("\nkvdepot_forged")));
  EXPECT_THAT(text,
              HasSubstr(absl::StrCat("kvdepot_step_in_flight{registration=\"",
                                     reg->registration_id(),
                                     "\",name=\"x\\\"} 1\\nkvdepot_forged "
                                     "1\\n\\\\??\"} 0\n")));
}

TEST(StepEngineTest, WithoutAGpuRegistrationIsAFailedPrecondition) {
  std::unique_ptr<StepEngineFactory> f = MakeUnavailableEngineFactory("cpu");
  absl::StatusOr<std::unique_ptr<StepEngine>> e =
      f->Create(RegistrationConfig(), [](const StepOutcome&) {});
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(e.status().message()), HasSubstr("cpu backend"));
}

}  // namespace
}  // namespace kvdepot::step
