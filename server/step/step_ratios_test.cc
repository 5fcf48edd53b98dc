// Several compressed ratios in one registration (SPEC §10,
// docs/STEP_PATH.md): layers of ratio 1, 4 and 128 registered together,
// each ratio's main and index caches stored from its own compressed slot
// mapping (StepRequest.compressed), a negative test per rule of that
// field (each naming the field and index, nothing enqueued, no step id
// consumed), and the single-ratio form compressed_slot_mapping unchanged.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/step/registry_fixture.h"
#include "server/step/step_plan.h"

namespace kvdepot::step {
namespace {

using ::testing::HasSubstr;

constexpr int kTokens = 3;

class StepRatiosTest : public RegistryFixture {
 protected:
  void SetUp() override {
    RegistryFixture::SetUp();
    owner_ = Open("worker", 1000);
    // Ratio 1 and 4: 16 x 64 = 1024 slots; ratio 128: 16 x 4 = 64 slots,
    // so a slot can be inside one ratio's pools and outside another's.
    CreatePool("main", "V41", 16, 64, 4);
    CreatePool("index", "FP4_INDEX", 16, 64, 4);
    CreatePool("main128", "V41", 16, 4, 1);
    CreatePool("index128", "FP4_INDEX", 16, 4, 1);
    doorbell_ = AddBuffer(owner_, 4096);
    io_ = AddBuffer(owner_, 1 << 20);
  }

  // Layer 0 ratio 1, layer 1 ratio 4, layer 2 ratio 128 (main, index and
  // phase B each); layer 3 ratio 4 again, a main cache only.
  v1::RegisterWorkerRequest Registration() const {
    v1::RegisterWorkerRequest r;
    r.set_doorbell_buffer_id(doorbell_);
    r.set_max_tokens(8);
    r.set_max_seqs(4);
    r.set_max_top_k(16);
    r.set_max_blocks_per_seq(4);
    BufferSlices slices(io_);
    auto ref = [&](v1::StepBufferRef* out, int64_t bytes) {
      slices.Next(out, bytes);
    };
    const int ratios[] = {1, 4, 128, 4};
    for (int l = 0; l < 4; ++l) {
      v1::StepLayer* layer = r.add_layers();
      layer->set_ratio(ratios[l]);
      const bool big = ratios[l] == 128;
      layer->mutable_main()->set_pool(big ? "main128" : "main");
      layer->mutable_main()->set_layer(big ? 0 : l);
      ref(layer->mutable_main()->mutable_input(), 8 * 512 * 2);
      if (l == 3) continue;
      layer->mutable_index()->set_pool(big ? "index128" : "index");
      layer->mutable_index()->set_layer(big ? 0 : l);
      ref(layer->mutable_index()->mutable_input(), 8 * 128 * 2);
      ref(layer->mutable_topk(), 8 * 16 * 4);
      ref(layer->mutable_index_out(), 8 * 16 * 4);
    }
    return r;
  }

  uint64_t Register(const v1::RegisterWorkerRequest& r) {
    return RegisterOk(owner_, r);
  }

  // Two sequences (1 and 2 query tokens); ratio 4 and ratio 128 entries.
  v1::StepRequest Step(uint64_t reg, uint64_t step) const {
    v1::StepRequest r;
    r.set_registration_id(reg);
    r.set_step_id(step);
    r.set_num_tokens(kTokens);
    r.set_slot_mapping(PackInt32s({5, -1, 700}));
    r.set_num_seqs(2);
    r.set_seq_lens(PackInt32s({10, 400}));
    r.set_query_lens(PackInt32s({1, 2}));
    r.set_block_tables(PackInt32s({1, 2, -1, -1, 0, 3, -1, -1}));
    r.set_block_table_cols(4);
    r.set_top_k(16);
    AddEntry(&r, 128, {-1, -1, 63});
    AddEntry(&r, 4, {900, -1, 17});
    return r;
  }

  static void AddEntry(v1::StepRequest* r, int32_t ratio,
                       const std::vector<int32_t>& slots) {
    v1::CompressedSlots* e = r->add_compressed();
    e->set_ratio(ratio);
    e->set_slot_mapping(PackInt32s(slots));
  }

  // The slots a layer's main and index caches are stored from (what
  // cuda_engine.cc's EnqueueStep passes its stores).
  static std::vector<int32_t> LayerSlots(const RegistrationConfig& config,
                                         const StepPlan& p, int layer) {
    const int32_t k = config.layers[layer].compressed;
    const int64_t at = k >= 0 ? p.sections.compressed(k) : p.sections.slots;
    EXPECT_GE(at, 0);
    if (at < 0) return {};
    return std::vector<int32_t>(p.blob.begin() + at,
                                p.blob.begin() + at + p.num_tokens);
  }

  Caller owner_;
  uint64_t doorbell_ = 0, io_ = 0;
};

TEST_F(StepRatiosTest, RegistrationWithRatios1And4And128IsAccepted) {
  ASSERT_NE(Register(Registration()), 0u);
  const RegistrationConfig& c = factory_.last_config;
  EXPECT_EQ(c.compressed_ratios, (std::vector<int32_t>{4, 128}));
  ASSERT_EQ(c.layers.size(), 4u);
  EXPECT_EQ(c.layers[0].ratio, 1);
  EXPECT_EQ(c.layers[0].compressed, -1);
  EXPECT_EQ(c.layers[1].ratio, 4);
  EXPECT_EQ(c.layers[1].compressed, 0);
  EXPECT_EQ(c.layers[2].ratio, 128);
  EXPECT_EQ(c.layers[2].compressed, 1);
  EXPECT_EQ(c.layers[3].compressed, 0) << "same ratio, same mapping";
}

// Each ratio's layers are stored from their own mapping, whatever order
// the entries come in; the sections are contiguous (the gate fills them
// at once) and 16-byte aligned; convert_topk of each layer runs at its
// own ratio (seq_len / ratio compressed tokens).
TEST_F(StepRatiosTest, EachRatiosLayersTakeTheirOwnMapping) {
  const uint64_t id = Register(Registration());
  ASSERT_NE(id, 0u);
  absl::StatusOr<v1::StepResponse> ok = registry_->Step(owner_, Step(id, 1));
  ASSERT_TRUE(ok.ok()) << ok.status();
  const RegistrationConfig& c = factory_.last_config;
  const StepPlan& p = factory_.last->plans.back();
  const StepSections& s = p.sections;
  EXPECT_EQ(s.compressed_count, 2);
  EXPECT_EQ(s.compressed_stride, 4);
  EXPECT_EQ(s.compressed_slots % 4, 0) << "16-byte aligned";
  EXPECT_EQ(s.compressed(0), s.compressed_slots);
  EXPECT_EQ(s.compressed(1), s.compressed_slots + s.compressed_stride);
  EXPECT_EQ(s.compressed(-1), -1);
  EXPECT_EQ(s.compressed(2), -1);
  EXPECT_EQ(LayerSlots(c, p, 0), (std::vector<int32_t>{5, -1, 700}));
  EXPECT_EQ(LayerSlots(c, p, 1), (std::vector<int32_t>{900, -1, 17}));
  EXPECT_EQ(LayerSlots(c, p, 2), (std::vector<int32_t>{-1, -1, 63}));
  EXPECT_EQ(LayerSlots(c, p, 3), (std::vector<int32_t>{900, -1, 17}));
  // Compressed lengths per ratio, as convert_topk derives them from the
  // layer's ratio and the step's seq_lens (10 and 400 tokens).
  const std::vector<std::vector<int32_t>> lengths = {
      {10, 400}, {2, 100}, {0, 3}};
  for (int l = 0; l < 3; ++l) {
    for (int b = 0; b < 2; ++b) {
      EXPECT_EQ(p.blob[s.seq_lens + b] / c.layers[l].ratio, lengths[l][b])
          << "layer " << l << " sequence " << b;
    }
  }
  EXPECT_LE(static_cast<int64_t>(p.blob.size()), MaxBlobElements(c));
}

// A negative test per rule of `compressed`; each names the field and
// index, enqueues nothing and consumes no step id.
TEST_F(StepRatiosTest, EveryCompressedRuleRefuses) {
  const uint64_t id = Register(Registration());
  ASSERT_NE(id, 0u);
  struct Case {
    std::string name;
    std::function<void(v1::StepRequest*)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"missing ratio",
       [](v1::StepRequest* r) { r->mutable_compressed()->RemoveLast(); },
       "compressed: no entry for ratio 4 (this registration's compressed "
       "ratios: 4, 128; one entry each)"},
      {"no entries", [](v1::StepRequest* r) { r->clear_compressed(); },
       "compressed: this registration has 2 compressed ratios (4, 128)"},
      {"unknown ratio",
       [](v1::StepRequest* r) { r->mutable_compressed(1)->set_ratio(64); },
       "compressed[1].ratio: 64 is not a ratio of this registration (4, 128)"},
      {"ratio 1",
       [](v1::StepRequest* r) { r->mutable_compressed(0)->set_ratio(1); },
       "compressed[0].ratio: 1 is not a ratio of this registration"},
      {"duplicate",
       [](v1::StepRequest* r) { r->mutable_compressed(1)->set_ratio(128); },
       "compressed[1].ratio: 128 duplicates compressed[0].ratio"},
      {"wrong length",
       [](v1::StepRequest* r) {
         r->mutable_compressed(1)->set_slot_mapping(PackInt32s({1, 2}));
       },
       "compressed[1].slot_mapping holds 8 bytes, expected 4 bytes x "
       "(num_tokens = 3)"},
      {"inside ratio 4's pools, outside ratio 128's",
       [](v1::StepRequest* r) {
         // 100 is inside ratio 4's pools (1024 slots), not ratio 128's.
         r->mutable_compressed(0)->set_slot_mapping(PackInt32s({100, -1, -1}));
       },
       "compressed[0].slot_mapping[0] = 100 is outside [-1, 64)"},
      {"out of range in the second entry",
       [](v1::StepRequest* r) {
         r->mutable_compressed(1)->set_slot_mapping(PackInt32s({-1, 1024, -1}));
       },
       "compressed[1].slot_mapping[1] = 1024 is outside [-1, 1024)"},
      {"below -1",
       [](v1::StepRequest* r) {
         r->mutable_compressed(1)->set_slot_mapping(PackInt32s({-2, -1, -1}));
       },
       "compressed[1].slot_mapping[0] = -2"},
      {"duplicate slot",
       [](v1::StepRequest* r) {
         r->mutable_compressed(1)->set_slot_mapping(PackInt32s({9, -1, 9}));
       },
       "compressed[1].slot_mapping[2] = 9 duplicates "
       "compressed[1].slot_mapping[0]"},
      {"both forms",
       [](v1::StepRequest* r) {
         r->set_compressed_slot_mapping(PackInt32s({-1, -1, -1}));
       },
       "compressed: set together with compressed_slot_mapping: send one "
       "form"},
      {"old form with two ratios",
       [](v1::StepRequest* r) {
         r->clear_compressed();
         r->set_compressed_slot_mapping(PackInt32s({-1, -1, -1}));
       },
       "compressed_slot_mapping: this registration has 2 compressed ratios "
       "(4, 128): send one `compressed` entry per ratio"},
      {"too many entries",
       [](v1::StepRequest* r) {
         AddEntry(r, 4, {-1, -1, -1});
       },
       "compressed: 3 entries; this registration has 2 compressed ratio(s) "
       "(4, 128), one entry each"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::StepRequest r = Step(id, 1);
    c.mutate(&r);
    absl::Status s = registry_->Step(owner_, r).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
  }
  EXPECT_TRUE(factory_.last->plans.empty());
  absl::StatusOr<v1::RegistrationInfo> info = registry_->Status(owner_, id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->last_step_id(), 0u);
  EXPECT_TRUE(registry_->Step(owner_, Step(id, 1)).ok());
}

// One ratio > 1: compressed_slot_mapping as before, or one `compressed`
// entry of that ratio, never both; another ratio is refused.
TEST_F(StepRatiosTest, OneRatioTakesEitherForm) {
  v1::RegisterWorkerRequest reg = Registration();
  reg.mutable_layers()->DeleteSubrange(2, 1);  // no ratio 128
  const uint64_t id = Register(reg);
  ASSERT_NE(id, 0u);
  EXPECT_EQ(factory_.last_config.compressed_ratios, std::vector<int32_t>{4});
  uint64_t step = 1;

  v1::StepRequest old_form = Step(id, step);
  old_form.clear_compressed();
  old_form.set_compressed_slot_mapping(PackInt32s({-1, 1023, 4}));
  absl::StatusOr<v1::StepResponse> ok = registry_->Step(owner_, old_form);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(LayerSlots(factory_.last_config, factory_.last->plans.back(), 1),
            (std::vector<int32_t>{-1, 1023, 4}));
  factory_.last->Finish();

  v1::StepRequest new_form = Step(id, ++step);
  new_form.mutable_compressed()->DeleteSubrange(0, 1);  // ratio 4 only
  ok = registry_->Step(owner_, new_form);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(LayerSlots(factory_.last_config, factory_.last->plans.back(), 1),
            (std::vector<int32_t>{900, -1, 17}));
  factory_.last->Finish();

  v1::StepRequest both = new_form;
  both.set_step_id(++step);
  both.set_compressed_slot_mapping(PackInt32s({-1, -1, -1}));
  absl::Status s = registry_->Step(owner_, both).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("compressed: set together with "
                        "compressed_slot_mapping: send one form"));

  v1::StepRequest other = Step(id, step);  // entries 128 and 4
  s = registry_->Step(owner_, other).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("compressed: 2 entries; this registration has 1"));
  other.mutable_compressed(0)->set_ratio(4);
  other.mutable_compressed()->RemoveLast();
  other.mutable_compressed(0)->set_ratio(128);
  s = registry_->Step(owner_, other).status();
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("compressed[0].ratio: 128 is not a ratio of this "
                        "registration (4)"));
  EXPECT_TRUE(factory_.last->plans.empty());
}

// Without any ratio > 1 neither form is accepted.
TEST_F(StepRatiosTest, NoCompressedRatioRefusesEntries) {
  v1::RegisterWorkerRequest reg = Registration();
  for (v1::StepLayer& l : *reg.mutable_layers()) l.set_ratio(1);
  reg.mutable_layers(2)->mutable_main()->set_pool("main");
  reg.mutable_layers(2)->mutable_main()->set_layer(2);
  reg.mutable_layers(2)->mutable_index()->set_pool("index");
  reg.mutable_layers(2)->mutable_index()->set_layer(2);
  reg.mutable_layers()->RemoveLast();
  const uint64_t id = Register(reg);
  ASSERT_NE(id, 0u);
  EXPECT_TRUE(factory_.last_config.compressed_ratios.empty());
  v1::StepRequest r = Step(id, 1);
  absl::Status s = registry_->Step(owner_, r).status();
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("compressed: set, but no main or index cache of this "
                        "registration has a ratio > 1"));
  r.clear_compressed();
  ASSERT_TRUE(registry_->Step(owner_, r).ok());
  EXPECT_EQ(factory_.last->plans.back().sections.compressed_slots, -1);
}

// At most kMaxCompressedRatios distinct ratios > 1 per registration.
TEST_F(StepRatiosTest, AtMostEightCompressedRatios) {
  v1::RegisterWorkerRequest reg = Registration();
  reg.mutable_layers()->Clear();
  CreatePool("many", "V41", 16, 4, kMaxCompressedRatios + 1);
  int64_t off = 0;
  for (int l = 0; l <= kMaxCompressedRatios; ++l) {
    v1::StepLayer* layer = reg.add_layers();
    layer->set_ratio(2 << l);  // 2, 4, ..., 512
    layer->mutable_main()->set_pool("many");
    layer->mutable_main()->set_layer(l);
    layer->mutable_main()->mutable_input()->set_buffer_id(io_);
    layer->mutable_main()->mutable_input()->set_offset(off);
    off += 8 * 512 * 2;
  }
  absl::Status s = registry_->Register(owner_, reg).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("layers[8].ratio: 512 would be distinct compressed "
                        "ratio 9"));
  reg.mutable_layers()->RemoveLast();
  ASSERT_TRUE(registry_->Register(owner_, reg).ok());
  EXPECT_EQ(factory_.last_config.compressed_ratios.size(),
            static_cast<size_t>(kMaxCompressedRatios));
}

}  // namespace
}  // namespace kvdepot::step
