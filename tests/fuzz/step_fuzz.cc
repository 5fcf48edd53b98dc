// The step path's untrusted inputs (SPEC §10, docs/STEP_PATH.md): a
// RegisterWorkerRequest and up to four StepRequests decoded from the fuzz
// bytes around a fixed world (CPU backend; pools "m" V41 8 x 16, "s" V41
// ring 4 x 8, "i" FP4_INDEX 8 x 16, "x" MXFP8_INDEX 7 x 12, 3 layers each;
// the worker's session holding four 256 KiB buffers, another user's session
// one), through StepRegistry as the Step service calls it. Engines record
// the plans they are given (the CUDA engine is not built here).
//
// Properties: no crash or sanitizer report; no refusal is INTERNAL,
// UNKNOWN or DATA_LOSS; an accepted step's plan is consistent: its blob no
// larger than MaxBlobElements(config), every section inside the blob,
// every inline slot inside every pool its mapping feeds, one more step in
// flight.
#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "kvdepot/v1/kvdepot.pb.h"
#include "kvdepot/v1/step.pb.h"
#include "proto/wire.h"
#include "server/backend/backend.h"
#include "server/cpu/cpu_backend.h"
#include "server/pools.h"
#include "server/sessions.h"
#include "server/step/step_engine.h"
#include "server/step/step_plan.h"
#include "server/step/step_registry.h"
#include "spdlog/spdlog.h"
#include "tests/fuzz/fuzz_input.h"

namespace kvdepot::fuzz {
namespace {

using step::RegistrationConfig;
using step::StepPlan;

constexpr int64_t kBufferBytes = int64_t{256} << 10;

// Records plans; Finish reports the oldest one done.
class Engine : public step::StepEngine {
 public:
  explicit Engine(step::CompletionFn done) : done_(std::move(done)) {}
  absl::Status Enqueue(StepPlan plan) override {
    plans.push_back(std::move(plan));
    return absl::OkStatus();
  }
  void Cancel() override {}
  void Finish() {
    if (plans.empty()) return;
    step::StepOutcome o;
    o.step_id = plans.front().step_id;
    plans.pop_front();
    done_(o);
  }
  std::deque<StepPlan> plans;

 private:
  step::CompletionFn done_;
};

class Factory : public step::StepEngineFactory {
 public:
  absl::StatusOr<std::unique_ptr<step::StepEngine>> Create(
      const RegistrationConfig& config, step::CompletionFn done) override {
    auto e = std::make_unique<Engine>(std::move(done));
    last = e.get();
    last_config = config;
    return e;
  }
  Engine* last = nullptr;
  RegistrationConfig last_config;
};

bool Refusal(const absl::Status& s) {
  return s.code() != absl::StatusCode::kInternal &&
         s.code() != absl::StatusCode::kUnknown &&
         s.code() != absl::StatusCode::kDataLoss;
}

struct World {
  World() {
    backend = MakeCpuBackend({});
    pools = std::make_unique<PoolRegistry>(backend.get(), int64_t{64} << 20);
    sessions = std::make_unique<SessionManager>(SessionLimits());
    step::RegistryOptions o;
    o.watch_interval = absl::ZeroDuration();  // no watchdog thread
    registry = std::make_unique<step::StepRegistry>(&factory, pools.get(),
                                                    sessions.get(), o);
    Pool("m", "V41", 8, 16);
    Pool("s", "V41", 4, 8);
    Pool("i", "FP4_INDEX", 8, 16);
    Pool("x", "MXFP8_INDEX", 7, 12);
    worker = Open("w", 1000);
    for (uint64_t& id : buffers) id = Buffer(worker);
    stranger = Open("o", 2000);
    strangers_buffer = Buffer(stranger);
  }
  // Unregisters first: the registry's engines go before the pools.
  ~World() { registry.reset(); }

  void Pool(const char* name, const char* format, int bs, int blocks) {
    v1::CreatePoolRequest r;
    r.set_name(name);
    r.set_format(format);
    r.set_block_size(bs);
    r.set_num_blocks(blocks);
    r.set_num_layers(3);
    FUZZ_CHECK(pools->Create(r, 1000).ok(), "pool %s", name);
  }
  Caller Open(const char* name, uid_t uid) {
    PeerCredentials p;
    p.uid = uid;
    p.gid = uid;
    p.pid = 1;
    absl::StatusOr<OpenedSession> s = sessions->OpenPeer(name, p);
    FUZZ_CHECK(s.ok(), "session %s", name);
    absl::StatusOr<Caller> c = sessions->Authenticate(s->id, absl::Now());
    FUZZ_CHECK(c.ok(), "authenticate %s", name);
    session_ids.push_back(s->id);
    return *c;
  }
  uint64_t Buffer(const Caller& c) {
    absl::StatusOr<std::unique_ptr<Memory>> m =
        backend->Allocate(kBufferBytes, "cpu");
    FUZZ_CHECK(m.ok(), "buffer");
    absl::StatusOr<std::shared_ptr<kvdepot::Buffer>> b =
        sessions->AddBuffer(c, *std::move(m));
    FUZZ_CHECK(b.ok(), "add buffer");
    return (*b)->id;
  }

  Factory factory;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<PoolRegistry> pools;
  std::unique_ptr<SessionManager> sessions;
  std::unique_ptr<step::StepRegistry> registry;
  std::vector<std::string> session_ids;
  Caller worker, stranger;
  uint64_t buffers[4] = {};
  uint64_t strangers_buffer = 0;
};

// Mostly one of the world's buffers, sometimes another user's or no
// buffer at all, rarely an arbitrary id.
uint64_t BufferId(FuzzInput& in, const World& w) {
  const uint8_t b = in.Byte() % 8;
  if (b < 4) return w.buffers[b];
  if (b == 4) return w.strangers_buffer;
  if (b == 5) return 0;
  return static_cast<uint64_t>(in.Int64());
}

// Mostly 256-aligned offsets inside a buffer.
void Ref(FuzzInput& in, const World& w, v1::StepBufferRef* r) {
  r->set_buffer_id(BufferId(in, w));
  r->set_offset(in.Bool() ? 256 * in.Range(0, 1023) : in.Int64());
  if (in.Bool())
    r->set_row_stride(in.Bool() ? 16 * in.Range(0, 256) : in.Int64());
}

std::string PoolName(FuzzInput& in) {
  static const char* kNames[] = {"m", "s", "i", "x", "m", "i", "nope", ""};
  return kNames[in.Byte() % 8];
}

void Fused(FuzzInput& in, v1::StepFused* f) {
  f->set_norm_begin(in.Int32());
  f->set_norm_end(in.Int32());
  f->set_norm_weight(in.Bytes(2048));
  f->set_eps(static_cast<float>(in.Int32()) * 1e-6f);
  f->set_rope_style(in.Int32());
  f->set_rope_offset(in.Int32());
  f->set_rope_dim(in.Int32());
  std::string cos_sin = in.Bytes(64);
  if (in.Bool()) cos_sin.resize(static_cast<size_t>(in.Range(0, 4096)));
  f->set_cos_sin(cos_sin);
  f->set_hadamard_begin(in.Int32());
  f->set_hadamard_len(in.Int32());
}

void Cache(FuzzInput& in, const World& w, v1::StepCache* c) {
  c->set_pool(PoolName(in));
  c->set_layer(in.Bool() ? in.Range(0, 3) : in.Int64());
  Ref(in, w, c->mutable_input());
  if (in.Byte() % 8 == 0) Fused(in, c->mutable_fused());
}

v1::RegisterWorkerRequest Registration(FuzzInput& in, const World& w) {
  v1::RegisterWorkerRequest r;
  r.set_doorbell_buffer_id(BufferId(in, w));
  const int layers = static_cast<int>(in.Range(0, 3));
  for (int l = 0; l < layers; ++l) {
    v1::StepLayer* layer = r.add_layers();
    if (in.Bool()) Cache(in, w, layer->mutable_main());
    if (in.Bool()) Cache(in, w, layer->mutable_swa());
    if (in.Bool()) Cache(in, w, layer->mutable_index());
    static const int32_t kRatios[] = {0, 1, 4, 16};
    const uint8_t ratio = in.Byte();
    layer->set_ratio(ratio < 8 ? kRatios[ratio % 4] : in.Int32());
    layer->set_window(in.Bool() ? static_cast<int32_t>(in.Range(0, 8))
                                : in.Int32());
    if (in.Bool()) Ref(in, w, layer->mutable_topk());
    if (in.Bool()) Ref(in, w, layer->mutable_index_out());
  }
  if (in.Bool()) {
    v1::StepSwaIndex* s = r.mutable_swa_index();
    s->set_pool(PoolName(in));
    s->set_window(in.Bool() ? static_cast<int32_t>(in.Range(0, 8))
                            : in.Int32());
    Ref(in, w, s->mutable_out());
  }
  r.set_max_tokens(in.Bool() ? static_cast<int32_t>(in.Range(0, 64))
                             : in.Int32());
  r.set_max_seqs(in.Bool() ? static_cast<int32_t>(in.Range(0, 16))
                           : in.Int32());
  r.set_max_top_k(in.Bool() ? static_cast<int32_t>(in.Range(0, 64))
                            : in.Int32());
  r.set_max_blocks_per_seq(in.Bool() ? static_cast<int32_t>(in.Range(0, 16))
                                     : in.Int32());
  r.set_name(in.Bytes(80));
  if (in.Bool()) Ref(in, w, r.mutable_block_tables());
  if (in.Bool()) Ref(in, w, r.mutable_slot_mappings());
  return r;
}

// n int32s, packed; sometimes a wrong count or stray bytes.
std::string Packed(FuzzInput& in, int64_t n, int32_t lo, int32_t hi) {
  const uint8_t shape = in.Byte() % 8;
  if (shape == 0) return in.Bytes(64);
  if (shape == 1) n = in.Range(0, 80);
  std::vector<int32_t> v(static_cast<size_t>(n < 0 ? 0 : n > 4096 ? 4096 : n));
  for (int32_t& x : v) {
    x = in.Bool() ? static_cast<int32_t>(in.Range(lo, hi)) : in.Int32();
  }
  std::string out;
  EncodeInt32s(v, &out);
  return out;
}

v1::StepRequest StepOf(FuzzInput& in, uint64_t registration, uint64_t step) {
  v1::StepRequest r;
  r.set_registration_id(in.Byte() % 16 == 0 ? static_cast<uint64_t>(in.Int64())
                                            : registration);
  r.set_step_id(in.Byte() % 16 == 0 ? static_cast<uint64_t>(in.Int64()) : step);
  const int32_t n =
      in.Bool() ? static_cast<int32_t>(in.Range(0, 40)) : in.Int32();
  const int32_t seqs =
      in.Bool() ? static_cast<int32_t>(in.Range(0, 8)) : in.Int32();
  r.set_num_tokens(n);
  r.set_num_seqs(seqs);
  r.set_slot_mapping(Packed(in, n, -1, 130));
  if (in.Bool()) r.set_compressed_slot_mapping(Packed(in, n, -1, 130));
  const int compressed = static_cast<int>(in.Range(0, 2));
  for (int k = 0; k < compressed; ++k) {
    v1::CompressedSlots* c = r.add_compressed();
    c->set_ratio(in.Bool() ? 4 : in.Int32());
    c->set_slot_mapping(Packed(in, n, -1, 130));
  }
  r.set_seq_lens(Packed(in, seqs, 0, 200));
  r.set_query_lens(Packed(in, seqs, 0, 8));
  r.set_swa_state_ids(Packed(in, seqs, -1, 8));
  if (in.Bool()) r.set_swa_valid_starts(Packed(in, seqs, 0, 200));
  const int32_t cols =
      in.Bool() ? static_cast<int32_t>(in.Range(0, 16)) : in.Int32();
  r.set_block_table_cols(cols);
  r.set_block_tables(Packed(in, int64_t{seqs} * cols, -1, 17));
  r.set_top_k(in.Bool() ? static_cast<int32_t>(in.Range(0, 64)) : in.Int32());
  if (in.Bool()) r.set_deadline_ms(static_cast<uint32_t>(in.Int32()));
  if (in.Bool()) {
    std::string positions = in.Bytes(8 * 40);
    if (in.Bool())
      positions.resize(static_cast<size_t>(8 * (n > 0 && n < 64 ? n : 1)));
    r.set_positions(positions);
  }
  r.set_block_tables_in_buffer(in.Byte() % 4 == 0);
  r.set_slot_mappings_in_buffer(in.Byte() % 4 == 0);
  return r;
}

// A PlanStep reply: a refusal, or every section inside the metadata, the
// per-row inputs consistent with seq_lens and top_k.
void CheckPlanStep(const absl::StatusOr<v1::PlanStepResponse>& p,
                   const RegistrationConfig& config) {
  if (!p.ok()) {
    FUZZ_CHECK(Refusal(p.status()), "PlanStep: %s",
               p.status().ToString().c_str());
    return;
  }
  const std::vector<int32_t> m = ReadInt32s(p->metadata());
  const int64_t size = static_cast<int64_t>(m.size());
  FUZZ_CHECK(p->metadata().size() % 16 == 0, "metadata of %zu bytes",
             p->metadata().size());
  const int64_t n = p->num_tokens();
  auto inside = [&](int64_t off, int64_t len, const char* what) {
    if (off < 0) return;
    FUZZ_CHECK(off % 4 == 0 && len >= 0 && off + len <= size,
               "PlanStep %s [%lld, +%lld) of %lld", what,
               static_cast<long long>(off), static_cast<long long>(len),
               static_cast<long long>(size));
  };
  inside(p->slots(), n, "slots");
  for (const v1::PlannedSlots& c : p->compressed()) {
    inside(c.slots(), n, "compressed");
  }
  inside(p->swa_slots(), n, "swa_slots");
  inside(p->row_seq(), n, "row_seq");
  inside(p->seq_lens(), p->num_seqs(), "seq_lens");
  inside(p->row_block_tables(), n * p->block_table_cols(), "row tables");
  inside(p->positions(), 2 * n, "positions");
  FUZZ_CHECK(
      p->compressed_size() == static_cast<int>(config.compressed_ratios.size()),
      "%d compressed sections", p->compressed_size());
  for (const v1::PlannedTopk& t : p->topk_inputs()) {
    inside(t.valid_count(), n, "valid_count");
    inside(t.num_tokens(), n, "num_tokens");
    for (int64_t r = 0; r < n; ++r) {
      const int32_t tokens = m[static_cast<size_t>(t.num_tokens() + r)];
      const int32_t valid = m[static_cast<size_t>(t.valid_count() + r)];
      FUZZ_CHECK(
          tokens >= 0 && valid >= 0 && valid <= p->top_k() && valid <= tokens,
          "row %lld: valid %d of %d tokens, top_k %d",
          static_cast<long long>(r), valid, tokens, p->top_k());
    }
  }
}

// The accepted plan against its registration (see the header comment).
void CheckPlan(const RegistrationConfig& config, const StepPlan& p) {
  const int64_t size = static_cast<int64_t>(p.blob.size());
  FUZZ_CHECK(size <= step::MaxBlobElements(config),
             "blob of %lld elements, bound %lld", static_cast<long long>(size),
             static_cast<long long>(step::MaxBlobElements(config)));
  const step::StepSections& s = p.sections;
  const int64_t n = p.num_tokens, seqs = p.num_seqs;
  FUZZ_CHECK(n >= 0 && seqs >= 0, "negative counts");
  auto inside = [&](int64_t off, int64_t len, const char* what) {
    if (off < 0) return;
    FUZZ_CHECK(off % 4 == 0, "%s at %lld: not 16-byte aligned", what,
               static_cast<long long>(off));
    FUZZ_CHECK(len >= 0 && off + len <= size, "%s [%lld, +%lld) past %lld",
               what, static_cast<long long>(off), static_cast<long long>(len),
               static_cast<long long>(size));
  };
  inside(s.slots, n, "slots");
  inside(s.compressed_slots, s.compressed_count * s.compressed_stride,
         "compressed_slots");
  inside(s.swa_slots, n, "swa_slots");
  inside(s.swa_state, n, "swa_state");
  inside(s.swa_start, n, "swa_start");
  inside(s.swa_valid, n, "swa_valid");
  inside(s.row_seq, n, "row_seq");
  inside(s.seq_lens, seqs, "seq_lens");
  inside(s.block_tables, seqs * p.block_table_cols, "block_tables");
  inside(s.gate, 4, "gate");
  inside(s.positions, 2 * n, "positions");
  if (p.slot_mappings_in_buffer) return;  // checked on the device
  auto slots_inside = [&](int64_t off, int32_t k, const char* what) {
    const int64_t bound = step::MinSlots(config, k);
    if (off < 0 || bound <= 0) return;
    for (int64_t t = 0; t < n; ++t) {
      const int32_t v = p.blob[static_cast<size_t>(off + t)];
      FUZZ_CHECK(v >= -1 && v < bound, "%s[%lld] = %d outside [-1, %lld)", what,
                 static_cast<long long>(t), v, static_cast<long long>(bound));
    }
  };
  slots_inside(s.slots, -1, "slot_mapping");
  for (int32_t k = 0; k < s.compressed_count; ++k) {
    slots_inside(s.compressed(k), k, "compressed slot mapping");
  }
}

}  // namespace
}  // namespace kvdepot::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);  // a line per registration otherwise
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvdepot;
  using namespace kvdepot::fuzz;
  // STEP_FUZZ_VERBOSE=1: what each call answered (writing seeds by hand).
  static const bool verbose = std::getenv("STEP_FUZZ_VERBOSE") != nullptr;
  FuzzInput in(data, size);
  World w;
  const v1::RegisterWorkerRequest reg = Registration(in, w);
  const Caller& owner = in.Byte() % 16 == 0 ? w.stranger : w.worker;
  absl::StatusOr<v1::RegisterWorkerResponse> made =
      w.registry->Register(owner, reg);
  if (verbose) {
    std::fprintf(stderr, "Register: %s\n", made.status().ToString().c_str());
  }
  if (!made.ok()) {
    FUZZ_CHECK(Refusal(made.status()), "Register: %s",
               made.status().ToString().c_str());
    return 0;
  }
  Engine* engine = w.factory.last;
  const RegistrationConfig config = w.factory.last_config;
  FUZZ_CHECK(engine != nullptr, "registered without an engine");
  uint64_t next = 1;
  for (int i = 0; i < 4 && in.remaining() > 0; ++i) {
    const Caller& caller = in.Byte() % 16 == 0 ? w.stranger : owner;
    const v1::StepRequest r = StepOf(in, made->registration_id(), next);
    const size_t before = engine->plans.size();
    CheckPlanStep(w.registry->PlanStep(caller, r), config);
    FUZZ_CHECK(engine->plans.size() == before, "PlanStep enqueued a step");
    absl::StatusOr<v1::StepResponse> s = w.registry->Step(caller, r);
    if (verbose) {
      std::fprintf(stderr, "Step %d: %s\n", i, s.status().ToString().c_str());
    }
    if (!s.ok()) {
      FUZZ_CHECK(Refusal(s.status()), "Step: %s",
                 s.status().ToString().c_str());
      FUZZ_CHECK(engine->plans.size() == before, "a refused step was enqueued");
    } else {
      FUZZ_CHECK(engine->plans.size() == before + 1,
                 "an accepted step was not enqueued");
      CheckPlan(config, engine->plans.back());
      ++next;
    }
    if (in.Bool()) engine->Finish();
  }
  while (!engine->plans.empty()) engine->Finish();
  FUZZ_CHECK(w.registry->Unregister(owner, made->registration_id()).ok() ||
                 &owner == &w.stranger,
             "Unregister by its owner failed");
  return 0;
}
