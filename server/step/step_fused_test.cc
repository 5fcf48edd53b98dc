// The fused-store parameters of the step path on the host (SPEC §8, §10):
// registration checks of StepCache.fused (a negative test per rule, each
// naming its field), the smallest cos/sin cache bounding every step, and
// the step's positions (size, range, set without RoPE) with their blob
// section. The GPU side is //tests/gpu:step_fused_test.
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "server/cpu/cpu_backend.h"
#include "server/pools.h"
#include "server/sessions.h"
#include "server/step/plan_export.h"
#include "server/step/step_config.h"
#include "server/step/step_plan.h"

namespace kvdepot::step {
namespace {

using ::testing::HasSubstr;

constexpr int kMaxTokens = 8;

std::string Pack(std::vector<int32_t> v) {
  std::string out;
  EncodeInt32s(v, &out);
  return out;
}

std::string Positions(std::vector<int64_t> v) {
  std::string out(v.size() * 8, '\0');
  if (!v.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// DeepSeek MLA's ranges on DS_MLA_FP8 (norm [0, 512), interleaved RoPE on
// [512, 576)) with a cos/sin cache of `max_pos` rows.
v1::StepFused MlaFused(int64_t max_pos) {
  v1::StepFused f;
  f.set_norm_begin(0);
  f.set_norm_end(512);
  f.set_norm_weight(std::string(1024, '\x3f'));
  f.set_eps(1e-6f);
  f.set_rope_style(2);
  f.set_rope_offset(512);
  f.set_rope_dim(64);
  f.set_cos_sin(std::string(static_cast<size_t>(max_pos * 64 * 4), '\0'));
  return f;
}

class StepFusedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = MakeCpuBackend({});
    pools_ = std::make_unique<PoolRegistry>(backend_.get(), int64_t{1} << 30);
    sessions_ = std::make_unique<SessionManager>(SessionLimits());
    PeerCredentials p;
    p.uid = 1000;
    p.gid = 1000;
    p.pid = 1;
    absl::StatusOr<OpenedSession> s = sessions_->OpenPeer("worker", p);
    ASSERT_TRUE(s.ok()) << s.status();
    absl::StatusOr<Caller> c = sessions_->Authenticate(s->id, absl::Now());
    ASSERT_TRUE(c.ok()) << c.status();
    caller_ = *c;
    for (auto [name, format] :
         {std::pair{"mla", "DS_MLA_FP8"}, std::pair{"v41", "V41"},
          std::pair{"idx", "MXFP8_INDEX"}}) {
      v1::CreatePoolRequest r;
      r.set_name(name);
      r.set_format(format);
      r.set_block_size(7);
      r.set_num_blocks(16);
      r.set_num_layers(2);
      ASSERT_TRUE(pools_->Create(r, 1000).ok()) << name;
    }
    doorbell_ = AddBuffer(4096);
    io_ = AddBuffer(1 << 20);
  }

  uint64_t AddBuffer(int64_t size) {
    absl::StatusOr<std::unique_ptr<Memory>> m = backend_->Allocate(size, "cpu");
    EXPECT_TRUE(m.ok());
    absl::StatusOr<std::shared_ptr<Buffer>> b =
        sessions_->AddBuffer(caller_, *std::move(m));
    EXPECT_TRUE(b.ok()) << b.status();
    return (*b)->id;
  }

  // Layer 0: an MLA main cache (fused, cos/sin of 100 rows); layer 1: a
  // V41 main cache (fused, Hadamard only) and an MXFP8 index cache (fused,
  // NeoX RoPE with a cos/sin of 40 rows).
  v1::RegisterWorkerRequest Registration() const {
    v1::RegisterWorkerRequest r;
    r.set_doorbell_buffer_id(doorbell_);
    r.set_max_tokens(kMaxTokens);
    r.set_max_seqs(4);
    int64_t off = 0;
    auto cache = [&](v1::StepCache* c, const char* pool, int layer,
                     int elements) {
      c->set_pool(pool);
      c->set_layer(layer);
      c->mutable_input()->set_buffer_id(io_);
      c->mutable_input()->set_offset(off);
      off += (kMaxTokens * elements * 2 + 255) / 256 * 256;
    };
    v1::StepLayer* l0 = r.add_layers();
    cache(l0->mutable_main(), "mla", 0, 576);
    *l0->mutable_main()->mutable_fused() = MlaFused(100);
    v1::StepLayer* l1 = r.add_layers();
    cache(l1->mutable_main(), "v41", 1, 512);
    l1->mutable_main()->mutable_fused()->set_hadamard_begin(128);
    l1->mutable_main()->mutable_fused()->set_hadamard_len(256);
    cache(l1->mutable_index(), "idx", 1, 128);
    v1::StepFused* f = l1->mutable_index()->mutable_fused();
    f->set_rope_style(1);
    f->set_rope_offset(64);
    f->set_rope_dim(64);
    f->set_cos_sin(std::string(40 * 64 * 4, '\0'));
    return r;
  }

  absl::StatusOr<RegistrationConfig> Resolve(
      const v1::RegisterWorkerRequest& r) const {
    return ResolveRegistration(r, caller_, *pools_, *sessions_);
  }

  v1::StepRequest Step(std::vector<int64_t> positions) const {
    v1::StepRequest s;
    s.set_step_id(1);
    s.set_num_tokens(3);
    s.set_slot_mapping(Pack({0, 5, -1}));
    s.set_num_seqs(1);
    s.set_seq_lens(Pack({9}));
    s.set_query_lens(Pack({3}));
    s.set_positions(Positions(positions));
    return s;
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<PoolRegistry> pools_;
  std::unique_ptr<SessionManager> sessions_;
  Caller caller_;
  uint64_t doorbell_ = 0, io_ = 0;
};

TEST_F(StepFusedTest, RegistersFusedCachesAndKeepsTheirArrays) {
  absl::StatusOr<RegistrationConfig> c = Resolve(Registration());
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_NE(c->layers[0].main.fused, nullptr);
  const FusedCacheConfig& mla = *c->layers[0].main.fused;
  EXPECT_EQ(mla.params.max_position, 100);
  EXPECT_EQ(mla.norm_weight.size(), 512u);
  EXPECT_EQ(mla.norm_weight[3], 0x3f3f);
  EXPECT_EQ(mla.params.rope, RopeStyle::kInterleaved);
  EXPECT_EQ(c->layers[1].main.fused->params.hadamard_len, 256);
  EXPECT_EQ(c->layers[1].main.fused->params.rope, RopeStyle::kNone);
  EXPECT_EQ(c->layers[1].index.fused->params.rope, RopeStyle::kNeox);
  EXPECT_EQ(c->layers[1].swa.fused, nullptr);
  // The shortest cos/sin cache bounds every step's positions.
  EXPECT_EQ(c->max_position, 40);
  EXPECT_GE(MaxBlobElements(*c), 2 * kMaxTokens);
}

TEST_F(StepFusedTest, RefusesEveryBadParameterNamingTheField) {
  struct Case {
    const char* name;
    void (*edit)(v1::StepFused*);
    const char* error;
  };
  const Case cases[] = {
      {"rope style", [](v1::StepFused* f) { f->set_rope_style(3); },
       "layers[0].main.fused.rope_style: 3 is not"},
      {"weight size", [](v1::StepFused* f) { f->set_norm_weight("ab"); },
       "layers[0].main.fused.norm_weight: 2 bytes"},
      {"norm not on 8",
       [](v1::StepFused* f) {
         f->set_norm_end(508);
         f->set_norm_weight(std::string(1016, 'a'));
       },
       "multiples of 8"},
      {"norm past the token",
       [](v1::StepFused* f) {
         f->set_norm_end(584);
         f->set_norm_weight(std::string(1168, 'a'));
       },
       "norm range"},
      {"norm ends an int32 overflow apart (step_fuzz)",
       [](v1::StepFused* f) {
         f->set_norm_begin(56);
         f->set_norm_end(std::numeric_limits<int32_t>::min());
         f->clear_norm_weight();
       },
       "norm range [56, -2147483648) is not inside"},
      {"eps negative", [](v1::StepFused* f) { f->set_eps(-1.0f); }, "eps = -1"},
      {"eps NaN", [](v1::StepFused* f) { f->set_eps(std::nanf("")); },
       "must be finite"},
      {"rope dim odd",
       [](v1::StepFused* f) {
         f->set_rope_dim(63);
         f->set_cos_sin(std::string(63 * 4 * 2, '\0'));
       },
       "rope_dim = 63"},
      {"rope dim zero", [](v1::StepFused* f) { f->set_rope_dim(0); },
       "layers[0].main.fused.rope_dim: 0 is outside"},
      {"rope past the token", [](v1::StepFused* f) { f->set_rope_offset(520); },
       "rope range"},
      {"cos_sin ragged",
       [](v1::StepFused* f) { f->set_cos_sin(std::string(300, '\0')); },
       "layers[0].main.fused.cos_sin: 300 bytes"},
      {"cos_sin empty", [](v1::StepFused* f) { f->clear_cos_sin(); },
       "layers[0].main.fused.cos_sin: 0 bytes"},
      {"cos_sin without rope", [](v1::StepFused* f) { f->set_rope_style(0); },
       "set without RoPE"},
      {"hadamard not a power of two",
       [](v1::StepFused* f) { f->set_hadamard_len(96); },
       "is not a power of two"},
      {"hadamard unsupported power",
       [](v1::StepFused* f) { f->set_hadamard_len(32); }, "does not support"},
      {"hadamard past the token",
       [](v1::StepFused* f) {
         f->set_hadamard_begin(128);
         f->set_hadamard_len(512);
       },
       "hadamard range"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::RegisterWorkerRequest r = Registration();
    c.edit(r.mutable_layers(0)->mutable_main()->mutable_fused());
    absl::StatusOr<RegistrationConfig> got = Resolve(r);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument)
        << got.status();
    EXPECT_THAT(std::string(got.status().message()), HasSubstr(c.error));
  }
}

TEST_F(StepFusedTest, ChecksThePositionsOfEveryStep) {
  absl::StatusOr<RegistrationConfig> c = Resolve(Registration());
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<StepPlan> plan =
      BuildStepPlan(*c, Step({0, 39, 7}), absl::Seconds(1));
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_GE(plan->sections.positions, 0);
  ASSERT_EQ(plan->sections.positions % 4, 0) << "16-byte aligned";
  int64_t got[3];
  std::memcpy(got, plan->blob.data() + plan->sections.positions, 24);
  EXPECT_EQ(got[0], 0);
  EXPECT_EQ(got[1], 39);
  EXPECT_EQ(got[2], 7);

  // Beyond the shortest cache (40 rows), negative, wrong size, missing.
  plan = BuildStepPlan(*c, Step({0, 40, 7}), absl::Seconds(1));
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(plan.status().message()),
              HasSubstr("positions[1]: 40 is outside [0, 40)"));
  plan = BuildStepPlan(*c, Step({0, 1, -1}), absl::Seconds(1));
  EXPECT_THAT(std::string(plan.status().message()),
              HasSubstr("positions[2]: -1 is outside"));
  plan = BuildStepPlan(*c, Step({0, 1}), absl::Seconds(1));
  EXPECT_THAT(std::string(plan.status().message()),
              HasSubstr("positions: 16 bytes; num_tokens = 3 needs 24"));
  v1::StepRequest none = Step({});
  plan = BuildStepPlan(*c, none, absl::Seconds(1));
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("positions"));

  // A registration without RoPE takes no positions.
  v1::RegisterWorkerRequest r = Registration();
  r.mutable_layers(0)->mutable_main()->clear_fused();
  r.mutable_layers(1)->mutable_index()->clear_fused();
  absl::StatusOr<RegistrationConfig> plain = Resolve(r);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->max_position, 0);
  plan = BuildStepPlan(*plain, Step({0, 1, 2}), absl::Seconds(1));
  EXPECT_THAT(std::string(plan.status().message()),
              HasSubstr("positions: set, but no cache"));
  plan = BuildStepPlan(*plain, Step({}), absl::Seconds(1));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->sections.positions, -1);
}

// PlanStep's reply (library mode) carries the checked positions where it
// says, int64 little-endian and 8-byte aligned, what
// kvdk_fused_store_cuda's params.positions takes.
TEST_F(StepFusedTest, PlanStepRepliesCarryThePositions) {
  absl::StatusOr<RegistrationConfig> c = Resolve(Registration());
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<StepPlan> plan =
      BuildStepPlan(*c, Step({0, 39, 7}), absl::Seconds(1));
  ASSERT_TRUE(plan.ok()) << plan.status();
  absl::StatusOr<v1::PlanStepResponse> reply =
      ExportStepPlan(*c, *std::move(plan));
  ASSERT_TRUE(reply.ok()) << reply.status();
  const int64_t at = reply->positions();
  ASSERT_GE(at, 0);
  EXPECT_EQ(at % 2, 0) << "8-byte aligned";
  ASSERT_LE(4 * (at + 6), static_cast<int64_t>(reply->metadata().size()));
  int64_t got[3];
  std::memcpy(got, reply->metadata().data() + 4 * at, 24);
  EXPECT_EQ(got[0], 0);
  EXPECT_EQ(got[1], 39);
  EXPECT_EQ(got[2], 7);
  EXPECT_EQ(reply->row_block_tables(), -1) << "no phase B here";
  EXPECT_EQ(reply->topk_inputs_size(), 0);
}

// A fused main cache of ratio > 1 (the compressed MLA rows): the fused
// parameters are kept as for ratio 1, and each step carries positions and
// compressed_slot_mapping, the latter checked against that cache's pool
// (7 x 16 = 112 slots).
TEST_F(StepFusedTest, AFusedMainCacheOfRatioAboveOneTakesCompressedSlots) {
  v1::RegisterWorkerRequest r = Registration();
  r.mutable_layers(0)->set_ratio(4);
  absl::StatusOr<RegistrationConfig> c = Resolve(r);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_NE(c->layers[0].main.fused, nullptr);
  EXPECT_EQ(c->layers[0].main.fused->params.rope, RopeStyle::kInterleaved);
  EXPECT_EQ(c->compressed_ratios, std::vector<int32_t>{4});
  EXPECT_EQ(c->layers[0].compressed, 0);
  v1::StepRequest s = Step({3, 4, 5});
  s.set_compressed_slot_mapping(Pack({-1, 111, -1}));
  absl::StatusOr<StepPlan> plan = BuildStepPlan(*c, s, absl::Seconds(1));
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_GE(plan->sections.compressed_slots, 0);
  ASSERT_GE(plan->sections.positions, 0);
  EXPECT_EQ(plan->blob[plan->sections.compressed_slots + 1], 111);
  s.set_compressed_slot_mapping(Pack({-1, 112, -1}));
  plan = BuildStepPlan(*c, s, absl::Seconds(1));
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(plan.status().message()),
              HasSubstr("compressed_slot_mapping[1] = 112 is outside "
                        "[-1, 112)"));
  s.clear_compressed_slot_mapping();
  plan = BuildStepPlan(*c, s, absl::Seconds(1));
  EXPECT_THAT(std::string(plan.status().message()),
              HasSubstr("compressed_slot_mapping"));
  // At ratio 1 the same registration refuses compressed slots.
  s = Step({3, 4, 5});
  s.set_compressed_slot_mapping(Pack({-1, 1, -1}));
  absl::StatusOr<RegistrationConfig> flat = Resolve(Registration());
  ASSERT_TRUE(flat.ok()) << flat.status();
  plan = BuildStepPlan(*flat, s, absl::Seconds(1));
  EXPECT_THAT(std::string(plan.status().message()),
              HasSubstr("compressed_slot_mapping: set, but no main or index "
                        "cache"));
}

// window 0 means no SWA part, as in PrefillLoad: an SWA cache needs a
// window inside its ring.
TEST_F(StepFusedTest, AnSwaCacheNeedsAWindowInsideItsRing) {
  v1::RegisterWorkerRequest r = Registration();
  v1::StepCache* swa = r.mutable_layers(1)->mutable_swa();
  swa->set_pool("v41");
  swa->set_layer(0);
  swa->mutable_input()->set_buffer_id(io_);
  swa->mutable_input()->set_offset(512 << 10);
  absl::StatusOr<RegistrationConfig> c = Resolve(r);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("layers[1].window: 0 is outside [1, 7]"));
  r.mutable_layers(1)->set_window(8);
  c = Resolve(r);
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("layers[1].window: 8 is outside [1, 7]"));
  r.mutable_layers(1)->set_window(7);
  c = Resolve(r);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->needs_swa_states);
}

}  // namespace
}  // namespace kvdepot::step
