// The fused store on the step path (SPEC §8, §10) on a GPU: kvdepotd
// --backend=cuda in a child process, a registration whose main caches are
// stored with the fused kernel (layer 0: RMSNorm over [0, 512), NeoX RoPE on
// [448, 512), Hadamard on [0, 256); layer 1: interleaved RoPE on [448, 512)
// with its own, longer cos/sin cache), positions sent with every step; the
// same with layer 1 at ratio 4 (compressed rows from
// compressed_slot_mapping). The
// pools stay byte-identical to the CPU fused reference (kernels/reference/
// fused.h) over many random steps, SWA and index caches to the plain
// reference; a step with a position beyond the shortest cos/sin cache is
// refused without consuming its id; bad parameters refuse the
// registration.
#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/fused.h"
#include "kernels/reference/fused.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/step_daemon_env.h"
#include "tests/gpu/step_harness.h"

namespace kvdepot::testing {
namespace {

const bool kEnvironment = (SetStepEnvironment(), true);

StepDaemonEnv* const env = AddStepDaemonEnv();

constexpr int kLayers = 2;
constexpr int64_t kMaxPos[kLayers] = {64, 80};

uint16_t Bf16Of(float x) {
  uint32_t u = 0;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// One layer's fused parameters, host copies (the registration and the
// reference use the same ones).
struct LayerFused {
  FusedParams params;
  std::vector<uint16_t> weight;
  std::vector<float> cos_sin;

  v1::StepFused Proto() const {
    v1::StepFused f;
    f.set_norm_begin(params.norm_begin);
    f.set_norm_end(params.norm_end);
    f.set_norm_weight(std::string(reinterpret_cast<const char*>(weight.data()),
                                  weight.size() * 2));
    f.set_eps(params.eps);
    f.set_rope_style(static_cast<int>(params.rope));
    f.set_rope_offset(params.rope_offset);
    f.set_rope_dim(params.rope_dim);
    f.set_cos_sin(std::string(reinterpret_cast<const char*>(cos_sin.data()),
                              cos_sin.size() * 4));
    f.set_hadamard_begin(params.hadamard_begin);
    f.set_hadamard_len(params.hadamard_len);
    return f;
  }
};

std::vector<LayerFused> MakeFused(std::mt19937& rng) {
  std::uniform_real_distribution<float> w(0.5f, 1.5f), cs(-1.0f, 1.0f);
  std::vector<LayerFused> out(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    LayerFused& f = out[l];
    FusedParams& p = f.params;
    if (l == 0) {
      p.norm_begin = 0;
      p.norm_end = 512;
      for (int i = 0; i < 512; ++i) f.weight.push_back(Bf16Of(w(rng)));
      p.eps = 1e-6f;
      p.hadamard_begin = 0;
      p.hadamard_len = 256;
    }
    p.rope = l == 0 ? RopeStyle::kNeox : RopeStyle::kInterleaved;
    p.rope_offset = 448;
    p.rope_dim = 64;
    p.max_position = kMaxPos[l];
    for (int64_t i = 0; i < kMaxPos[l] * 64; ++i) f.cos_sin.push_back(cs(rng));
    p.norm_weight = f.weight.data();
    p.cos_sin = f.cos_sin.data();
  }
  return out;
}

// Positions of a step's tokens: inside the shorter cache (64).
std::vector<int64_t> PositionsOf(const StepInput& in) {
  std::vector<int64_t> p;
  for (int i = 0; i < in.num_tokens(); ++i) {
    p.push_back(static_cast<int64_t>((in.step_id * 13 + i * 7) % kMaxPos[0]));
  }
  return p;
}

std::string PackPositions(const std::vector<int64_t>& p) {
  std::string s(p.size() * 8, '\0');
  std::memcpy(s.data(), p.data(), s.size());
  return s;
}

class StepFusedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kEnvironment);
    ASSERT_OK(PrepareStepTest(env, &stream_));
    std::mt19937 rng(1401);
    fused_ = MakeFused(rng);
  }

  // A rig whose main caches are fused; `edit` may spoil the parameters.
  RigOptions Options(const std::string& prefix) {
    RigOptions o;
    o.prefix = prefix;
    o.layers = kLayers;
    const std::vector<LayerFused>* fused = &fused_;
    o.edit_registration = [fused](v1::RegisterWorkerRequest* r) {
      for (int l = 0; l < kLayers; ++l) {
        *r->mutable_layers(l)->mutable_main()->mutable_fused() =
            (*fused)[l].Proto();
      }
    };
    o.edit_step = [](const StepInput& in, v1::StepRequest* r) {
      r->set_positions(PackPositions(PositionsOf(in)));
    };
    o.main_reference = [fused](int l, const StepInput& in,
                               const PoolLayout& layout, uint8_t* bytes) {
      const std::vector<int64_t> positions = PositionsOf(in);
      FusedParams p = (*fused)[l].params;
      p.positions = positions.data();
      return FusedStore(layout, bytes, in.kv_main[l].data(), p, in.slots,
                        nullptr);
    };
    return o;
  }

  std::vector<LayerFused> fused_;
  std::optional<Stream> stream_;
};

TEST_F(StepFusedTest, FusedStoresMatchTheCpuReferenceOverManySteps) {
  absl::StatusOr<std::unique_ptr<StepRig>> rig =
      StepRig::Create(env->daemon()->socket_path(), Options("fused"));
  ASSERT_OK(rig.status());
  std::mt19937 rng(1402);
  for (uint64_t step = 1; step <= 40; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    StepInput in = (*rig)->RandomStep(step, rng);
    (*rig)->StageInputs(in);
    ASSERT_OK((*rig)->SendStep(in).status());
    ASSERT_OK((*rig)->EnqueueWorker(stream_->get()));
    ASSERT_OK(SyncWithin(stream_->get(), absl::Seconds(30)));
    ASSERT_OK((*rig)->ApplyReference(in));
    ASSERT_OK((*rig)->CheckIndexRows(in));
    if (step % 5 == 0) ASSERT_OK((*rig)->CheckPools());
  }
}

// Layer 1 at ratio 4: its fused main cache and its index cache store
// compressed rows from compressed_slot_mapping (mostly -1), layer 0 per
// token; convert_topk of layer 1 sees seq_len / 4 rows. Pools and index
// rows equal the CPU references (the fused reference at the compressed
// slots).
TEST_F(StepFusedTest, CompressedFusedMainCacheMatchesTheCpuReference) {
  RigOptions o = Options("fusedratio");
  o.ratio_layer = 1;
  o.ratio = 4;
  o.main_reference = [fused = &fused_, o](int l, const StepInput& in,
                                          const PoolLayout& layout,
                                          uint8_t* bytes) {
    const std::vector<int64_t> positions = PositionsOf(in);
    FusedParams p = (*fused)[l].params;
    p.positions = positions.data();
    return FusedStore(layout, bytes, in.kv_main[l].data(), p,
                      LayerSlots(o, in, l), nullptr);
  };
  absl::StatusOr<std::unique_ptr<StepRig>> rig =
      StepRig::Create(env->daemon()->socket_path(), o);
  ASSERT_OK(rig.status());
  std::mt19937 rng(1404);
  int compressed = 0;
  for (uint64_t step = 1; step <= 30; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    StepInput in = (*rig)->RandomStep(step, rng);
    ASSERT_EQ(in.compressed_slots.size(), in.slots.size());
    for (int32_t s : in.compressed_slots) compressed += s >= 0;
    (*rig)->StageInputs(in);
    ASSERT_OK((*rig)->SendStep(in).status());
    ASSERT_OK((*rig)->EnqueueWorker(stream_->get()));
    ASSERT_OK(SyncWithin(stream_->get(), absl::Seconds(30)));
    ASSERT_OK((*rig)->ApplyReference(in));
    ASSERT_OK((*rig)->CheckIndexRows(in));
    if (step % 5 == 0) ASSERT_OK((*rig)->CheckPools());
  }
  EXPECT_GT(compressed, 0);
}

TEST_F(StepFusedTest, PositionsBeyondTheCosSinCacheAreRefused) {
  absl::StatusOr<std::unique_ptr<StepRig>> rig =
      StepRig::Create(env->daemon()->socket_path(), Options("fusedpos"));
  ASSERT_OK(rig.status());
  std::mt19937 rng(1403);
  StepInput in = (*rig)->RandomStep(1, rng);
  for (int64_t bad : {kMaxPos[0], int64_t{-1}}) {
    v1::StepRequest r = (*rig)->Request(in);
    std::vector<int64_t> p = PositionsOf(in);
    p.back() = bad;
    r.set_positions(PackPositions(p));
    grpc::ClientContext ctx;
    v1::StepResponse out;
    const grpc::Status s = (*rig)->stub()->Step(&ctx, r, &out);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr("positions["));
  }
  // The refused step consumed nothing: step 1 runs, byte-exact.
  (*rig)->StageInputs(in);
  ASSERT_OK((*rig)->SendStep(in).status());
  ASSERT_OK((*rig)->EnqueueWorker(stream_->get()));
  ASSERT_OK(SyncWithin(stream_->get(), absl::Seconds(30)));
  ASSERT_OK((*rig)->ApplyReference(in));
  ASSERT_OK((*rig)->CheckPools());
}

TEST_F(StepFusedTest, BadParametersRefuseTheRegistration) {
  RigOptions o = Options("fusedbad");
  o.edit_registration = [this](v1::RegisterWorkerRequest* r) {
    v1::StepFused f = fused_[0].Proto();
    f.set_hadamard_len(96);
    *r->mutable_layers(0)->mutable_main()->mutable_fused() = f;
  };
  absl::StatusOr<std::unique_ptr<StepRig>> rig =
      StepRig::Create(env->daemon()->socket_path(), o);
  ASSERT_FALSE(rig.ok());
  EXPECT_THAT(std::string(rig.status().message()),
              ::testing::HasSubstr("not a power of two"));
}

}  // namespace
}  // namespace kvdepot::testing
