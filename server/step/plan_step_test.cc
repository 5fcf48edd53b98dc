// Step.PlanStep (library mode on daemon-built metadata, docs/LIBRARY_MODE.md)
// without a GPU: the reply's sections hold what Step's plan holds plus the
// per-row convert_topk inputs; library mode's CPU entry points run on the
// metadata as the reply names it and write the same pool bytes and index
// rows as the reference applied to the request itself, at ratios 1 and 4,
// over random steps with several query tokens per sequence; PlanStep
// consumes no step id and enqueues nothing; every refusal (another
// session, a cancelled or unknown registration, bad fields, a reply past
// its bound) changes nothing; device-resident tables and slot mappings are
// left to the worker.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/reference/reference.h"
#include "libkvdepot/kvdepot_kernels.h"
#include "planner/decode_index.h"
#include "planner/plan.h"
#include "proto/wire.h"
#include "server/step/registry_fixture.h"
#include "server/step/step_plan.h"

namespace kvdepot::step {
namespace {

using ::testing::HasSubstr;

constexpr int kLayers = 2;  // layer 0 at ratio 1, layer 1 at ratio 4
constexpr int kRatio = 4;
constexpr int kBlock = 16, kBlocks = 64;  // main and index pools
constexpr int kRing = 32, kStates = 16;   // the SWA pool
constexpr int kWindow = 8;
constexpr int kMaxTokens = 8, kMaxSeqs = 4, kTopK = 16, kCols = 4;

class PlanStepTest : public RegistryFixture {
 protected:
  void SetUp() override {
    RegistryFixture::SetUp();
    owner_ = Open("worker", 1000);
    other_ = Open("intruder", 2000);
    CreatePool("main", "V41", kBlock, kBlocks, kLayers);
    CreatePool("swa", "V41", kRing, kStates, kLayers);
    CreatePool("index", "FP4_INDEX", kBlock, kBlocks, kLayers);
    doorbell_ = AddBuffer(owner_, 4096);
    io_ = AddBuffer(owner_, 1 << 20);
  }

  // Main, SWA and index caches and phase B on both layers; the SWA index.
  v1::RegisterWorkerRequest Registration() const {
    v1::RegisterWorkerRequest r;
    r.set_doorbell_buffer_id(doorbell_);
    r.set_max_tokens(kMaxTokens);
    r.set_max_seqs(kMaxSeqs);
    r.set_max_top_k(kTopK);
    r.set_max_blocks_per_seq(kCols);
    BufferSlices slices(io_);
    for (int l = 0; l < kLayers; ++l) {
      v1::StepLayer* layer = r.add_layers();
      layer->set_window(kWindow);
      layer->set_ratio(l == 1 ? kRatio : 1);
      for (auto [cache, pool, elements] :
           {std::tuple{layer->mutable_main(), "main", 512},
            std::tuple{layer->mutable_swa(), "swa", 512},
            std::tuple{layer->mutable_index(), "index", 128}}) {
        cache->set_pool(pool);
        cache->set_layer(l);
        slices.Next(cache->mutable_input(), kMaxTokens * elements * 2);
      }
      slices.Next(layer->mutable_topk(), kMaxTokens * kTopK * 4);
      slices.Next(layer->mutable_index_out(), kMaxTokens * kTopK * 4);
    }
    r.mutable_swa_index()->set_pool("swa");
    r.mutable_swa_index()->set_window(kWindow);
    slices.Next(r.mutable_swa_index()->mutable_out(), kMaxTokens * kWindow * 4);
    return r;
  }

  // Two sequences: 1 and 2 query tokens.
  v1::StepRequest Fixed(uint64_t reg) const {
    v1::StepRequest r;
    r.set_registration_id(reg);
    r.set_step_id(1);
    r.set_num_tokens(3);
    r.set_slot_mapping(PackInt32s({5, -1, 700}));
    r.set_compressed_slot_mapping(PackInt32s({-1, 64, -1}));
    r.set_num_seqs(2);
    r.set_seq_lens(PackInt32s({10, 40}));
    r.set_query_lens(PackInt32s({1, 2}));
    r.set_swa_state_ids(PackInt32s({3, 7}));
    r.set_block_tables(PackInt32s({1, 2, -1, -1, 4, 5, 6, -1}));
    r.set_block_table_cols(kCols);
    r.set_top_k(kTopK);
    return r;
  }

  Caller owner_, other_;
  uint64_t doorbell_ = 0, io_ = 0;
};

std::vector<int32_t> Section(const std::vector<int32_t>& m, int64_t at,
                             int64_t n) {
  EXPECT_GE(at, 0);
  EXPECT_EQ(at % 4, 0) << "sections are 16-byte aligned";
  EXPECT_LE(at + n, static_cast<int64_t>(m.size()));
  if (at < 0 || at + n > static_cast<int64_t>(m.size())) return {};
  return std::vector<int32_t>(m.begin() + at, m.begin() + at + n);
}

const v1::PlannedTopk* TopkAt(const v1::PlanStepResponse& p, int32_t ratio) {
  for (const v1::PlannedTopk& t : p.topk_inputs()) {
    if (t.ratio() == ratio) return &t;
  }
  return nullptr;
}

TEST_F(PlanStepTest, SectionsHoldTheStepPlanAndThePerRowInputs) {
  const uint64_t id = RegisterOk(owner_, Registration());
  ASSERT_NE(id, 0u);
  absl::StatusOr<v1::PlanStepResponse> p =
      registry_->PlanStep(owner_, Fixed(id));
  ASSERT_TRUE(p.ok()) << p.status();
  // The same request through Step: the engine's plan.
  ASSERT_TRUE(registry_->Step(owner_, Fixed(id)).ok());
  const StepPlan& plan = factory_.last->plans.back();
  const StepSections& s = plan.sections;
  const std::vector<int32_t> m = ReadInt32s(p->metadata());
  auto blob = [&](int64_t at, int64_t n) { return Section(plan.blob, at, n); };

  EXPECT_EQ(p->num_tokens(), 3);
  EXPECT_EQ(p->num_seqs(), 2);
  EXPECT_EQ(p->top_k(), kTopK);
  EXPECT_EQ(p->block_table_cols(), kCols);
  EXPECT_EQ(Section(m, p->slots(), 3), (std::vector<int32_t>{5, -1, 700}));
  ASSERT_EQ(p->compressed_size(), 1);
  EXPECT_EQ(p->compressed(0).ratio(), kRatio);
  EXPECT_EQ(Section(m, p->compressed(0).slots(), 3),
            (std::vector<int32_t>{-1, 64, -1}));
  EXPECT_EQ(Section(m, p->swa_slots(), 3), blob(s.swa_slots, 3));
  EXPECT_EQ(Section(m, p->swa_slots(), 3),
            (std::vector<int32_t>{3 * 32 + 9, 7 * 32 + 6, 7 * 32 + 7}));
  EXPECT_EQ(Section(m, p->swa_state_ids(), 3), blob(s.swa_state, 3));
  EXPECT_EQ(Section(m, p->swa_starts(), 3), blob(s.swa_start, 3));
  EXPECT_EQ(Section(m, p->swa_valid_lens(), 3), blob(s.swa_valid, 3));
  EXPECT_EQ(Section(m, p->row_seq(), 3), (std::vector<int32_t>{0, 1, 1}));
  EXPECT_EQ(Section(m, p->seq_lens(), 2), (std::vector<int32_t>{10, 40}));
  EXPECT_EQ(p->positions(), -1) << "no fused RoPE cache";
  // One table row per query row: sequence 1's row twice.
  EXPECT_EQ(Section(m, p->row_block_tables(), 3 * kCols),
            (std::vector<int32_t>{1, 2, -1, -1, 4, 5, 6, -1, 4, 5, 6, -1}));
  // Ratio 1: 10 and 40 tokens; ratio 4: 2 and 10; valid = min(16, n).
  ASSERT_EQ(p->topk_inputs_size(), 2);
  const v1::PlannedTopk* r1 = TopkAt(*p, 1);
  const v1::PlannedTopk* r4 = TopkAt(*p, kRatio);
  ASSERT_NE(r1, nullptr);
  ASSERT_NE(r4, nullptr);
  EXPECT_EQ(Section(m, r1->num_tokens(), 3),
            (std::vector<int32_t>{10, 40, 40}));
  EXPECT_EQ(Section(m, r1->valid_count(), 3),
            (std::vector<int32_t>{10, 16, 16}));
  EXPECT_EQ(Section(m, r4->num_tokens(), 3), (std::vector<int32_t>{2, 10, 10}));
  EXPECT_EQ(Section(m, r4->valid_count(), 3),
            (std::vector<int32_t>{2, 10, 10}));
  EXPECT_EQ(registry_->Counters().steps_planned, 1);
}

TEST_F(PlanStepTest, ConsumesNoStepIdAndEnqueuesNothing) {
  const uint64_t id = RegisterOk(owner_, Registration());
  ASSERT_NE(id, 0u);
  v1::StepRequest r = Fixed(id);
  for (uint64_t step : {0, 1, 7, 1}) {  // step_id is not read
    r.set_step_id(step);
    ASSERT_TRUE(registry_->PlanStep(owner_, r).ok());
  }
  EXPECT_TRUE(factory_.last->plans.empty());
  absl::StatusOr<v1::RegistrationInfo> info = registry_->Status(owner_, id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->last_step_id(), 0u);
  EXPECT_EQ(info->in_flight(), 0);
  // Step 1 is still the next step, and a full queue does not stop plans.
  ASSERT_TRUE(registry_->Step(owner_, Fixed(id)).ok());
  r.set_step_id(2);
  ASSERT_TRUE(registry_->Step(owner_, r).ok());
  EXPECT_TRUE(registry_->PlanStep(owner_, r).ok());
  EXPECT_EQ(registry_->Counters().steps_planned, 5);
}

// Each refusal has Step's code and message, and nothing is counted.
TEST_F(PlanStepTest, RefusalsNameTheFieldAndChangeNothing) {
  const uint64_t id = RegisterOk(owner_, Registration());
  ASSERT_NE(id, 0u);
  struct Case {
    std::function<void(v1::StepRequest*)> edit;
    absl::StatusCode code;
    std::string message;
  };
  const Case cases[] = {
      {[](v1::StepRequest* r) {
         r->set_slot_mapping(PackInt32s({5, 5, 1}));
       },
       absl::StatusCode::kInvalidArgument, "slot_mapping[1]"},
      {[](v1::StepRequest* r) {
         r->set_slot_mapping(PackInt32s({5, 1, 1024}));
       },
       absl::StatusCode::kInvalidArgument, "slot_mapping[2] = 1024"},
      {[](v1::StepRequest* r) {
         r->set_compressed_slot_mapping(PackInt32s({-2, -1, -1}));
       },
       absl::StatusCode::kInvalidArgument, "compressed_slot_mapping[0]"},
      {[](v1::StepRequest* r) {
         r->set_query_lens(PackInt32s({1, 1}));
       },
       absl::StatusCode::kInvalidArgument, "query_lens"},
      {[](v1::StepRequest* r) {
         r->set_swa_state_ids(PackInt32s({3, kStates}));
       },
       absl::StatusCode::kInvalidArgument, "state_ids[1]"},
      {[](v1::StepRequest* r) {
         r->set_block_tables(PackInt32s({1, 2, -1, -1, 4, 5, 6, kBlocks}));
       },
       absl::StatusCode::kInvalidArgument, "block_tables[1][3]"},
      {[](v1::StepRequest* r) { r->set_top_k(kTopK + 1); },
       absl::StatusCode::kInvalidArgument, "top_k"},
      {[](v1::StepRequest* r) {
         r->set_block_tables("");
         r->set_block_tables_in_buffer(true);
       },
       absl::StatusCode::kInvalidArgument, "block_tables_in_buffer"},
      {[](v1::StepRequest* r) {
         r->set_slot_mapping("");
         r->set_compressed_slot_mapping("");
         r->set_slot_mappings_in_buffer(true);
       },
       absl::StatusCode::kInvalidArgument, "slot_mappings_in_buffer"},
      {[](v1::StepRequest* r) {
         r->set_registration_id(r->registration_id() + 9);
       },
       absl::StatusCode::kNotFound, "registration_id"},
  };
  for (const Case& c : cases) {
    v1::StepRequest r = Fixed(id);
    c.edit(&r);
    absl::Status plan = registry_->PlanStep(owner_, r).status();
    EXPECT_EQ(plan.code(), c.code) << c.message << ": " << plan;
    EXPECT_THAT(std::string(plan.message()), HasSubstr(c.message));
    // Step refuses the same request the same way (the device-resident
    // forms need buffers this registration lacks).
    absl::Status step = registry_->Step(owner_, r).status();
    EXPECT_EQ(step.code(), c.code) << c.message << ": " << step;
  }
  EXPECT_EQ(registry_->Counters().steps_planned, 0);
  EXPECT_TRUE(factory_.last->plans.empty());
}

// Another session can neither plan nor learn the registration's layout
// until the owner grants it; a cancelled registration plans nothing.
TEST_F(PlanStepTest, OnlyTheOwnerOrAGranteePlans) {
  const uint64_t id = RegisterOk(owner_, Registration());
  ASSERT_NE(id, 0u);
  absl::Status s = registry_->PlanStep(other_, Fixed(id)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("registration_id"));
  v1::GrantRegistrationRequest g;
  g.set_registration_id(id);
  g.add_sessions(other_.session);
  ASSERT_TRUE(registry_->Grant(owner_, g).ok());
  EXPECT_TRUE(registry_->PlanStep(other_, Fixed(id)).ok());
  EXPECT_EQ(registry_->Counters().steps_planned, 1);

  sessions_->CloseNumber(owner_.session);
  registry_->Watch(absl::Now());
  s = registry_->PlanStep(other_, Fixed(id)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("cancelled"));
  EXPECT_EQ(registry_->Counters().steps_planned, 1);
}

// Device-resident tables and slot mappings are the worker's own: the reply
// names no slot section and no row tables, still the SWA sections and the
// convert_topk inputs; tables in the buffer need one query token per
// sequence (row r = sequence r), else INVALID_ARGUMENT naming the flag.
TEST_F(PlanStepTest, DeviceResidentFormsAreLeftToTheWorker) {
  const uint64_t tables = AddBuffer(owner_, 4 * kMaxSeqs * kCols);
  const uint64_t slots = AddBuffer(owner_, 4 * 2 * kMaxTokens);
  v1::RegisterWorkerRequest reg = Registration();
  reg.mutable_block_tables()->set_buffer_id(tables);
  reg.mutable_slot_mappings()->set_buffer_id(slots);
  const uint64_t id = RegisterOk(owner_, reg);
  ASSERT_NE(id, 0u);
  v1::StepRequest r = Fixed(id);
  r.clear_block_tables();
  r.set_block_tables_in_buffer(true);
  r.clear_slot_mapping();
  r.clear_compressed_slot_mapping();
  r.set_slot_mappings_in_buffer(true);
  // Sequence 1 has two query tokens: its row cannot be repeated here.
  absl::Status s = registry_->PlanStep(owner_, r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("block_tables_in_buffer"));
  // Three sequences of one token each (decode).
  r.set_num_seqs(3);
  r.set_seq_lens(PackInt32s({10, 39, 40}));
  r.set_query_lens(PackInt32s({1, 1, 1}));
  r.set_swa_state_ids(PackInt32s({3, 7, 9}));
  absl::StatusOr<v1::PlanStepResponse> p = registry_->PlanStep(owner_, r);
  ASSERT_TRUE(p.ok()) << p.status();
  const std::vector<int32_t> m = ReadInt32s(p->metadata());
  EXPECT_EQ(p->slots(), -1);
  ASSERT_EQ(p->compressed_size(), 1);
  EXPECT_EQ(p->compressed(0).ratio(), kRatio);
  EXPECT_EQ(p->compressed(0).slots(), -1);
  EXPECT_EQ(p->row_block_tables(), -1);
  EXPECT_EQ(Section(m, p->swa_slots(), 3),
            (std::vector<int32_t>{3 * 32 + 9, 7 * 32 + 6, 9 * 32 + 7}));
  const v1::PlannedTopk* r4 = TopkAt(*p, kRatio);
  ASSERT_NE(r4, nullptr);
  EXPECT_EQ(Section(m, r4->num_tokens(), 3), (std::vector<int32_t>{2, 9, 10}));
  EXPECT_EQ(Section(m, r4->valid_count(), 3), (std::vector<int32_t>{2, 9, 10}));
  // Either form alone.
  r.clear_slot_mappings_in_buffer();
  r.set_slot_mapping(PackInt32s({5, -1, 700}));
  r.set_compressed_slot_mapping(PackInt32s({-1, 64, -1}));
  p = registry_->PlanStep(owner_, r);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(Section(ReadInt32s(p->metadata()), p->slots(), 3),
            (std::vector<int32_t>{5, -1, 700}));
  EXPECT_EQ(p->row_block_tables(), -1);
  EXPECT_EQ(registry_->Counters().steps_planned, 2);
  EXPECT_TRUE(factory_.last->plans.empty());
}

// A step of one sequence whose query rows times the table's columns would
// make a 64 MiB+ reply: refused before anything is allocated, naming
// num_tokens; one column fewer (just under the bound) is answered.
TEST_F(PlanStepTest, AReplyPastItsBoundIsRefusedBeforeItIsBuilt) {
  constexpr int kRows = 4096;
  constexpr int kWide = 4096;  // 4096 x 4096 x 4 = 64 MiB of table rows
  CreatePool("bigindex", "FP4_INDEX", 16, 64, 1);
  const uint64_t io = AddBuffer(owner_, int64_t{kRows} * (256 + 2 * 64) + 4096);
  v1::RegisterWorkerRequest reg;
  reg.set_doorbell_buffer_id(doorbell_);
  reg.set_max_tokens(kRows);
  reg.set_max_seqs(1);
  reg.set_max_top_k(16);
  reg.set_max_blocks_per_seq(kWide);
  BufferSlices slices(io);
  v1::StepLayer* layer = reg.add_layers();
  layer->mutable_index()->set_pool("bigindex");
  slices.Next(layer->mutable_index()->mutable_input(), int64_t{kRows} * 256);
  slices.Next(layer->mutable_topk(), int64_t{kRows} * 16 * 4);
  slices.Next(layer->mutable_index_out(), int64_t{kRows} * 16 * 4);
  const uint64_t id = RegisterOk(owner_, reg);
  ASSERT_NE(id, 0u);
  auto request = [&](int cols) {
    v1::StepRequest r;
    r.set_registration_id(id);
    r.set_num_tokens(kRows);
    r.set_slot_mapping(PackInt32s(std::vector<int32_t>(kRows, -1)));
    r.set_num_seqs(1);
    r.set_seq_lens(PackInt32s({kRows}));
    r.set_query_lens(PackInt32s({kRows}));
    r.set_block_tables(PackInt32s(std::vector<int32_t>(cols, 0)));
    r.set_block_table_cols(cols);
    r.set_top_k(16);
    return r;
  };
  absl::Status s = registry_->PlanStep(owner_, request(kWide)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("num_tokens"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("67108864"));
  EXPECT_TRUE(registry_
                  ->Step(owner_,
                         [&] {
                           v1::StepRequest r = request(kWide);
                           r.set_step_id(1);
                           return r;
                         }())
                  .ok())
      << "Step carries the tables once per sequence: no such bound";
  absl::StatusOr<v1::PlanStepResponse> p =
      registry_->PlanStep(owner_, request(kWide - 8));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_LE(static_cast<int64_t>(p->metadata().size()), int64_t{64} << 20);
  EXPECT_EQ(registry_->Counters().steps_planned, 1);
}

// One random step (fixed seed): sequences of 1 or 2 query tokens, slots
// distinct within each mapping, some -1, top-k entries partly out of
// range.
struct RandomStep {
  v1::StepRequest request;
  std::vector<int32_t> slots, compressed, seq_lens, query_lens, states, tables;
  std::vector<std::vector<uint16_t>> kv_main, kv_swa, kv_index;  // [layer]
  std::vector<std::vector<int32_t>> topk;  // [layer][n * top_k]
  int n = 0, seqs = 0;
};

RandomStep Draw(uint64_t reg, std::mt19937& rng) {
  auto uniform = [&rng](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  RandomStep s;
  s.seqs = uniform(1, kMaxSeqs);
  for (int b = 0; b < s.seqs; ++b) {
    const int q = std::min(uniform(1, 2), kMaxTokens - s.n - (s.seqs - b - 1));
    s.query_lens.push_back(q);
    s.seq_lens.push_back(uniform(q, kBlock * kCols));
    s.n += q;
  }
  std::vector<int32_t> pool(kBlock * kBlocks);
  std::iota(pool.begin(), pool.end(), 0);
  auto mapping = [&](int keep_one_in) {
    std::shuffle(pool.begin(), pool.end(), rng);
    std::vector<int32_t> m(pool.begin(), pool.begin() + s.n);
    for (int32_t& x : m) {
      if (uniform(0, keep_one_in - 1) != 0) x = -1;
    }
    return m;
  };
  s.slots = mapping(1);
  s.slots[static_cast<size_t>(uniform(0, s.n - 1))] = -1;
  s.compressed = mapping(3);
  std::vector<int32_t> states(kStates);
  std::iota(states.begin(), states.end(), 0);
  std::shuffle(states.begin(), states.end(), rng);
  s.states.assign(states.begin(), states.begin() + s.seqs);
  for (int i = 0; i < s.seqs * kCols; ++i) {
    s.tables.push_back(uniform(0, 19) == 0 ? -1 : uniform(0, kBlocks - 1));
  }
  auto bf16_rows = [&](int elements) {
    std::vector<uint16_t> v(static_cast<size_t>(s.n) * elements);
    // Finite BF16 values of either sign, magnitudes around 2^-8..2^8.
    for (uint16_t& x : v) {
      x = static_cast<uint16_t>((uniform(0, 1) << 15) |
                                (uniform(119, 135) << 7) | uniform(0, 127));
    }
    return v;
  };
  for (int l = 0; l < kLayers; ++l) {
    s.kv_main.push_back(bf16_rows(512));
    s.kv_swa.push_back(bf16_rows(512));
    s.kv_index.push_back(bf16_rows(128));
    std::vector<int32_t> t(static_cast<size_t>(s.n) * kTopK);
    for (int32_t& x : t) x = uniform(-2, kBlock * kCols + 2);
    s.topk.push_back(std::move(t));
  }
  v1::StepRequest& r = s.request;
  r.set_registration_id(reg);
  r.set_num_tokens(s.n);
  r.set_slot_mapping(PackInt32s(s.slots));
  r.set_compressed_slot_mapping(PackInt32s(s.compressed));
  r.set_num_seqs(s.seqs);
  r.set_seq_lens(PackInt32s(s.seq_lens));
  r.set_query_lens(PackInt32s(s.query_lens));
  r.set_swa_state_ids(PackInt32s(s.states));
  r.set_block_tables(PackInt32s(s.tables));
  r.set_block_table_cols(kCols);
  r.set_top_k(kTopK);
  return s;
}

// A pool as library mode holds it: a kvdk layout and its bytes.
struct LibPool {
  kvdk_layout* layout = nullptr;
  kvdk_layout_info info{};
  std::vector<uint8_t> bytes;

  LibPool(const char* format, int block_size, int blocks) {
    EXPECT_EQ(
        kvdk_layout_create(format, 0, block_size, blocks, kLayers, &layout),
        KVDK_OK)
        << kvdk_last_error();
    EXPECT_EQ(kvdk_layout_get_info(layout, &info, sizeof info), KVDK_OK);
    bytes.assign(static_cast<size_t>(info.total_bytes), 0);
  }
  ~LibPool() { kvdk_layout_destroy(layout); }
  void Store(int layer, const std::vector<uint16_t>& kv, const int32_t* slots,
             int n) {
    ASSERT_EQ(
        kvdk_store_cpu(layout, bytes.data(), static_cast<int64_t>(bytes.size()),
                       layer, kv.data(), KVDK_DTYPE_BF16, slots, n),
        KVDK_OK)
        << kvdk_last_error();
  }
};

// The same pool for the reference: kernels/reference on the registry's
// layout, from the request's own arrays.
struct RefPool {
  PoolLayout layout;
  std::vector<uint8_t> bytes;

  explicit RefPool(const PoolLayout& l)
      : layout(l), bytes(static_cast<size_t>(l.total_bytes), 0) {}
  void Store(int layer, const std::vector<uint16_t>& kv,
             const std::vector<int32_t>& slots) {
    ASSERT_TRUE(kvdepot::Store(layout,
                               bytes.data() + layer * layout.layer_stride,
                               kv.data(), InputDtype::kBF16, slots)
                    .ok());
  }
};

// Library mode on PlanStep's metadata (the calls LIBRARY_MODE.md lists)
// against the reference applied to the request: pools byte-identical,
// index rows and SWA decode index equal, invalid entries counted alike.
TEST_F(PlanStepTest, LibraryModeOnPlannedMetadataMatchesTheReference) {
  const uint64_t id = RegisterOk(owner_, Registration());
  ASSERT_NE(id, 0u);
  const RegistrationConfig& config = factory_.last_config;
  LibPool lib_main("V41", kBlock, kBlocks), lib_swa("V41", kRing, kStates),
      lib_index("FP4_INDEX", kBlock, kBlocks);
  RefPool ref_main(config.layers[0].main.layout),
      ref_swa(config.layers[0].swa.layout),
      ref_index(config.layers[0].index.layout);
  ASSERT_EQ(lib_main.info.total_bytes, ref_main.layout.total_bytes);
  ASSERT_EQ(lib_swa.info.total_bytes, ref_swa.layout.total_bytes);
  ASSERT_EQ(lib_index.info.total_bytes, ref_index.layout.total_bytes);

  std::mt19937 rng(20261206);
  int64_t invalid_seen = 0;
  for (int step = 0; step < 40; ++step) {
    SCOPED_TRACE(step);
    RandomStep s = Draw(id, rng);
    absl::StatusOr<v1::PlanStepResponse> p =
        registry_->PlanStep(owner_, s.request);
    ASSERT_TRUE(p.ok()) << p.status();
    const std::vector<int32_t> m = ReadInt32s(p->metadata());
    const int32_t* base = m.data();
    const int n = s.n;
    ASSERT_EQ(p->num_tokens(), n);
    ASSERT_EQ(p->compressed_size(), 1);

    SequenceBatch batch;
    batch.seqlen_k = s.seq_lens;
    batch.seqlen_q = s.query_lens;
    batch.state_ids = s.states;
    SwaParams ring;
    ring.ring_size = kRing;
    ring.window = kRing;
    ring.num_states = kStates;
    std::vector<int32_t> swa_slots(static_cast<size_t>(n));
    ASSERT_TRUE(
        BuildSwaStoreSlots(batch, ring, absl::MakeSpan(swa_slots)).ok());

    for (int l = 0; l < kLayers; ++l) {
      SCOPED_TRACE(l);
      const int ratio = l == 1 ? kRatio : 1;
      // Library mode: the section of the layer's ratio.
      const int32_t* slots =
          base + (ratio > 1 ? p->compressed(0).slots() : p->slots());
      lib_main.Store(l, s.kv_main[l], slots, n);
      lib_swa.Store(l, s.kv_swa[l], base + p->swa_slots(), n);
      lib_index.Store(l, s.kv_index[l], slots, n);
      const v1::PlannedTopk* t = TopkAt(*p, ratio);
      ASSERT_NE(t, nullptr);
      std::vector<int32_t> lib_out = s.topk[l];
      int64_t lib_invalid = 0;
      ASSERT_EQ(kvdk_convert_topk_cpu(
                    lib_index.layout, lib_out.data(), n, kTopK,
                    base + t->valid_count(), base + t->num_tokens(),
                    base + p->row_block_tables(), kCols, kCols, &lib_invalid),
                KVDK_OK)
          << kvdk_last_error();

      // The reference, from the request.
      const std::vector<int32_t>& ref_slots =
          ratio > 1 ? s.compressed : s.slots;
      ref_main.Store(l, s.kv_main[l], ref_slots);
      ref_swa.Store(l, s.kv_swa[l], swa_slots);
      ref_index.Store(l, s.kv_index[l], ref_slots);
      std::vector<int32_t> ref_out = s.topk[l];
      int64_t ref_invalid = 0;
      int row = 0;
      for (int b = 0; b < s.seqs; ++b) {
        const int32_t tokens = s.seq_lens[b] / ratio;
        const int32_t valid = std::min(tokens, kTopK);
        BlockTableView table;
        table.data = absl::MakeConstSpan(s.tables).subspan(b * kCols, kCols);
        table.num_rows = 1;
        table.num_cols = kCols;
        table.row_stride = kCols;
        for (int j = 0; j < s.query_lens[b]; ++j, ++row) {
          absl::StatusOr<int64_t> bad =
              ConvertTopk(absl::MakeSpan(ref_out).subspan(row * kTopK, kTopK),
                          kTopK, {valid}, {tokens}, table, kBlock, kBlocks);
          ASSERT_TRUE(bad.ok()) << bad.status();
          ref_invalid += *bad;
        }
      }
      EXPECT_EQ(lib_out, ref_out);
      EXPECT_EQ(lib_invalid, ref_invalid);
      invalid_seen += ref_invalid;
    }
    // The SWA decode index, once per step.
    std::vector<int32_t> lib_swa_index(static_cast<size_t>(n) * kWindow, 7);
    ASSERT_EQ(
        kvdk_swa_decode_index_cpu(
            lib_swa.layout, base + p->swa_state_ids(), base + p->swa_starts(),
            base + p->swa_valid_lens(), n, kWindow, lib_swa_index.data()),
        KVDK_OK)
        << kvdk_last_error();
    SwaParams window = ring;
    window.window = kWindow;
    std::vector<int32_t> ref_swa_index(lib_swa_index.size(), 9);
    ASSERT_TRUE(
        BuildSwaDecodeIndex(batch, window, absl::MakeSpan(ref_swa_index)).ok());
    EXPECT_EQ(lib_swa_index, ref_swa_index);
  }
  EXPECT_EQ(lib_main.bytes, ref_main.bytes);
  EXPECT_EQ(lib_swa.bytes, ref_swa.bytes);
  EXPECT_EQ(lib_index.bytes, ref_index.bytes);
  EXPECT_GT(invalid_seen, 0) << "the steps exercise out-of-range entries";
  // Something was stored (the comparison is not of two zeroed pools).
  EXPECT_NE(std::count(ref_main.bytes.begin(), ref_main.bytes.end(), 0),
            static_cast<std::ptrdiff_t>(ref_main.bytes.size()));
}

}  // namespace
}  // namespace kvdepot::step
