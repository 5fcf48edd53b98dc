// The decode step path end to end on a GPU (SPEC §10): kvdepotd
// --backend=cuda in a child process (CUDA_MODULE_LOADING=EAGER), this test
// as scheduler (Step RPCs) and worker (libkvdepot_worker on its own
// stream, rows written by its stream, mark/wait per phase). Every step's
// index rows equal the planner's; the pools stay byte-identical to the CPU
// reference; the worker's side replays from a CUDA graph; a third step in
// flight is refused; block tables and slot mappings in device memory,
// entries out of range turned into -1 and counted as the planner counts
// them; library mode on the daemon's PlanStep metadata.
#include <cuda_runtime_api.h>
#include <stdlib.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "libkvdepot/kvdepot_kernels.h"
#include "proto/step_doorbell.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/step_daemon_env.h"
#include "tests/gpu/step_harness.h"

namespace kvdepot::testing {
namespace {

// More than 8 registrations: 32 hardware connections (GPU_HOST.md), set
// before CUDA starts here and inherited by the daemon.
const bool kEnvironment =
    (SetStepEnvironment(), setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1),
     true);

StepDaemonEnv* const env = AddStepDaemonEnv();

class StepE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kEnvironment);
    ASSERT_OK(PrepareStepTest(env, &stream_));
  }

  std::unique_ptr<StepRig> MakeRig(RigOptions o) {
    absl::StatusOr<std::unique_ptr<StepRig>> rig =
        StepRig::Create(env->daemon()->socket_path(), o);
    EXPECT_TRUE(rig.ok()) << rig.status();
    return rig.ok() ? *std::move(rig) : nullptr;
  }

  // One step end to end: staged, sent, the worker's side on stream_, then
  // the reference applied and the index rows compared.
  absl::Status RunStep(StepRig* rig, const StepInput& in) {
    rig->StageInputs(in);
    RETURN_IF_ERROR(rig->SendStep(in).status());
    RETURN_IF_ERROR(rig->EnqueueWorker(stream_->get()));
    RETURN_IF_ERROR(SyncWithin(stream_->get(), absl::Seconds(30)));
    RETURN_IF_ERROR(rig->ApplyReference(in));
    return rig->CheckIndexRows(in);
  }

  std::optional<Stream> stream_;
};

// Three layers: layer 0 per token, layer 1 at ratio 4, layer 2 at 16.
RigOptions ThreeRatios(const std::string& prefix) {
  RigOptions o;
  o.prefix = prefix;
  o.layers = 3;
  o.ratio_layer = 1;
  o.ratio = 4;
  o.ratio2_layer = 2;
  o.ratio2 = 16;
  return o;
}

// StepStatus of `rig` once the daemon's completion report of step `last`
// ran (a host function, after the worker's stream passed the step).
v1::RegistrationInfo StatusAfter(StepRig* rig, uint64_t last) {
  v1::RegistrationInfo info;
  for (int i = 0; i < 500; ++i) {
    absl::StatusOr<v1::RegistrationInfo> s = rig->Status();
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) break;
    info = *s;
    if (info.completed_step_id() == last) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return info;
}

TEST_F(StepE2eTest, RandomStepsMatchTheReference) {
  RigOptions o;
  o.prefix = "e2e";
  o.layers = 3;
  std::unique_ptr<StepRig> rig = MakeRig(o);
  ASSERT_NE(rig, nullptr);
  std::mt19937 rng(1301);
  for (uint64_t step = 1; step <= 100; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    StepInput in = rig->RandomStep(step, rng);
    rig->StageInputs(in);
    // Unary calls, the rig's StepStream and its step ring take turns on
    // one registration.
    absl::StatusOr<v1::StepResponse> r = step % 3 == 0 ? rig->SendStepOnRing(in)
                                         : step % 3 == 1
                                             ? rig->SendStep(in)
                                             : rig->SendStepOnStream(in);
    ASSERT_OK(r.status());
    EXPECT_EQ(r->step_id(), step);
    ASSERT_OK(rig->EnqueueWorker(stream_->get()));
    ASSERT_OK(SyncWithin(stream_->get(), absl::Seconds(30)));
    ASSERT_OK(rig->ApplyReference(in));
    ASSERT_OK(rig->CheckIndexRows(in));
    if (step % 10 == 0) ASSERT_OK(rig->CheckPools());
  }
  uint64_t bits = 0, oor = 0, counter = 0, done = 0;
  ASSERT_EQ(kvd_status(rig->worker(), &bits, &oor, &counter, &done), KVD_OK);
  EXPECT_EQ(counter, 100u);
  EXPECT_EQ(done, 100u);
  EXPECT_GT(rig->expected_out_of_range(), 0u) << "the test must exercise -1";
  EXPECT_EQ(oor, rig->expected_out_of_range());
  EXPECT_EQ(bits, doorbell::kStatusOutOfRange);
  // Every 16th step was timed (kvdepotd's default --step_timing_every);
  // its phase times arrived with a later step: the median phase is a
  // real GPU time (events), at least a few microseconds, under 100 ms.
  absl::StatusOr<v1::RegistrationInfo> info = rig->Status();
  ASSERT_OK(info.status());
  EXPECT_EQ(info->steps_completed(), 100u);
  EXPECT_GT(info->handoff_p50_us(), 1.0);
  EXPECT_LT(info->handoff_p50_us(), 100000.0);
}

// A worker one step ahead of its scheduler (it began a step twice, so its
// step-id word says 3 while the daemon runs step 2): every phase's gate
// finds the word wrong, so step 2 writes nothing to the pools, its waits
// are still released, and the sticky status word and StepStatus say
// step_mismatch.
TEST_F(StepE2eTest, AWorkerOutOfStepWritesNothingAndIsFlagged) {
  RigOptions o;
  o.prefix = "mismatch";
  o.layers = 2;
  std::unique_ptr<StepRig> rig = MakeRig(o);
  ASSERT_NE(rig, nullptr);
  std::mt19937 rng(1307);
  const StepInput first = rig->RandomStep(1, rng);
  ASSERT_OK(RunStep(rig.get(), first));
  ASSERT_OK(rig->CheckPools());
  uint64_t bits = 0;
  ASSERT_EQ(kvd_status(rig->worker(), &bits, nullptr, nullptr, nullptr),
            KVD_OK);
  ASSERT_EQ(bits & doorbell::kStatusStepMismatch, 0u);

  const StepInput second = rig->RandomStep(2, rng);
  rig->StageInputs(second);
  ASSERT_OK(rig->SendStep(second).status());
  ASSERT_EQ(kvd_step_begin(rig->worker(), stream_->get()), KVD_OK);
  ASSERT_OK(rig->EnqueueWorker(stream_->get()));
  // A closed gate must still release the worker's waits.
  ASSERT_OK(SyncWithin(stream_->get(), absl::Seconds(30)));
  // The pools still hold step 1 only (the reference was not advanced).
  ASSERT_OK(rig->CheckPools());
  ASSERT_EQ(kvd_status(rig->worker(), &bits, nullptr, nullptr, nullptr),
            KVD_OK);
  EXPECT_NE(bits & doorbell::kStatusStepMismatch, 0u);
  const v1::RegistrationInfo info = StatusAfter(rig.get(), 2);
  EXPECT_EQ(info.completed_step_id(), 2u);
  EXPECT_NE(info.status_bits() & doorbell::kStatusStepMismatch, 0u);
}

// Block tables in device memory (RegisterWorkerRequest.block_tables, rows
// 13 int32 apart, offset 256): the worker's stream writes each step's rows
// before mark(B_0); the Step carries block_tables_in_buffer and a random
// block_table_cols in [1, 8]. About one entry in eight is replaced by one
// the host would refuse (< -1 or >= num_blocks): each the kernel reads
// becomes -1 and is counted, exactly as the planner counts it. Every
// fourth step sends its tables inline instead (the buffer then holds
// poison), on the same registration and graph slots. Layer 1 at ratio 4.
TEST_F(StepE2eTest, DeviceResidentBlockTablesMatchThePlanner) {
  RigOptions o;
  o.prefix = "devbt";
  o.layers = 3;
  o.ratio_layer = 1;
  o.ratio = 4;
  o.device_block_tables = true;
  o.table_stride = o.max_blocks_per_seq + 5;
  std::unique_ptr<StepRig> rig = MakeRig(o);
  ASSERT_NE(rig, nullptr);
  std::mt19937 rng(1305);
  const int32_t bad[] = {-2,
                         -1000,
                         std::numeric_limits<int32_t>::min(),
                         o.num_blocks,
                         o.num_blocks + 7,
                         std::numeric_limits<int32_t>::max()};
  uint64_t injected_reads = 0;  // layer 0 reads of an injected entry
  int device_steps = 0;
  for (uint64_t step = 1; step <= 80; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    StepInput in = rig->RandomStep(step, rng);
    in.inline_tables = step % 4 == 0;
    const int cols = in.inline_tables ? o.max_blocks_per_seq
                                      : std::uniform_int_distribution<int>(
                                            1, o.max_blocks_per_seq)(rng);
    std::vector<int32_t> table;
    std::vector<bool> injected;
    for (int b = 0; b < in.num_seqs(); ++b) {
      for (int c = 0; c < cols; ++c) {
        int32_t v = in.block_tables[b * o.max_blocks_per_seq + c];
        const bool inject = !in.inline_tables &&
                            std::uniform_int_distribution<int>(0, 7)(rng) == 0;
        if (inject) v = bad[std::uniform_int_distribution<int>(0, 5)(rng)];
        table.push_back(v);
        injected.push_back(inject);
      }
    }
    in.block_tables = table;
    in.block_table_cols = cols;
    device_steps += in.inline_tables ? 0 : 1;
    // Layer 0 (ratio 1): which valid top-k entries land on injected ones.
    int row = 0;
    for (int b = 0; b < in.num_seqs(); ++b) {
      const int n = in.seq_lens[b];
      for (int j = 0; j < in.query_lens[b]; ++j, ++row) {
        for (int c = 0; c < std::min(o.top_k, n); ++c) {
          const int x = in.topk[0][row * o.top_k + c];
          if (x >= 0 && x < n && x / o.block_size < cols &&
              injected[b * cols + x / o.block_size]) {
            ++injected_reads;
          }
        }
      }
    }
    rig->StageInputs(in);
    absl::StatusOr<v1::StepResponse> r = rig->SendStep(in);
    ASSERT_OK(r.status());
    ASSERT_OK(rig->EnqueueWorker(stream_->get()));
    ASSERT_OK(SyncWithin(stream_->get(), absl::Seconds(30)));
    ASSERT_OK(rig->ApplyReference(in));
    ASSERT_OK(rig->CheckIndexRows(in));
    if (step % 10 == 0) ASSERT_OK(rig->CheckPools());
  }
  EXPECT_EQ(device_steps, 60);
  EXPECT_GT(injected_reads, 20u) << "the kernel must meet injected entries";
  uint64_t bits = 0, oor = 0, counter = 0, done = 0;
  ASSERT_EQ(kvd_status(rig->worker(), &bits, &oor, &counter, &done), KVD_OK);
  EXPECT_EQ(counter, 80u);
  EXPECT_EQ(done, 80u);
  EXPECT_GT(rig->expected_out_of_range(), injected_reads);
  EXPECT_EQ(oor, rig->expected_out_of_range());
  EXPECT_EQ(bits, doorbell::kStatusOutOfRange);
  // The daemon's view agrees, once its completion report of the last step
  // ran.
  const v1::RegistrationInfo st = StatusAfter(rig.get(), 80);
  EXPECT_EQ(st.completed_step_id(), 80u);
  EXPECT_EQ(st.out_of_range(), rig->expected_out_of_range());
}

// Slot mappings in device memory (RegisterWorkerRequest.slot_mappings):
// layer 0 per token, layer 1 at ratio 4, layer 2 at ratio 16, so the
// buffer holds three rows (main, ratio 4, ratio 16), 3 int32 of padding
// apart. The worker's stream writes each step's rows before mark(A_0);
// about one entry in eight of every row is replaced by one the host would
// refuse (< -1, >= the pools' slots), poison everywhere past num_tokens;
// every sixth step sends its mappings inline on the same registration.
// Pools byte-identical to the CPU reference with the injected tokens not
// stored, index rows equal to the planner's, the out-of-range count equal
// to the planner's plus exactly the injected entries.
TEST_F(StepE2eTest, SlotMappingsInDeviceMemory) {
  RigOptions o = ThreeRatios("devslots");
  o.device_slot_mappings = true;
  o.slot_row_stride = o.max_tokens + 3;
  std::unique_ptr<StepRig> rig = MakeRig(o);
  ASSERT_NE(rig, nullptr);
  ASSERT_EQ(rig->slot_rows(), 3);
  std::mt19937 rng(1307);
  const int32_t capacity = rig->SlotCapacity();
  const int32_t bad[] = {-2, std::numeric_limits<int32_t>::min(), capacity,
                         capacity + 5, std::numeric_limits<int32_t>::max()};
  constexpr uint64_t kSteps = 48;
  uint64_t injected = 0;
  int device_steps = 0;
  for (uint64_t step = 1; step <= kSteps; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    StepInput in = rig->RandomStep(step, rng);
    in.inline_slots = step % 6 == 0;
    if (!in.inline_slots) {
      ++device_steps;
      for (std::vector<int32_t>* v :
           {&in.slots, &in.compressed_slots, &in.compressed_slots2}) {
        for (int32_t& slot : *v) {
          if (std::uniform_int_distribution<int>(0, 7)(rng) != 0) continue;
          slot = bad[std::uniform_int_distribution<int>(0, 4)(rng)];
          ++injected;
        }
      }
    }
    const v1::StepRequest request = rig->Request(in);
    ASSERT_EQ(request.slot_mappings_in_buffer(), !in.inline_slots);
    ASSERT_EQ(request.slot_mapping().empty(), !in.inline_slots);
    ASSERT_OK(RunStep(rig.get(), in));
    if (step % 6 == 5) ASSERT_OK(rig->CheckPools());
  }
  ASSERT_OK(rig->CheckPools());
  EXPECT_EQ(device_steps, 40);
  EXPECT_GT(injected, 40u) << "every row must carry injected entries";
  EXPECT_EQ(rig->dropped_slots(), injected);
  uint64_t bits = 0, oor = 0, counter = 0, done = 0;
  ASSERT_EQ(kvd_status(rig->worker(), &bits, &oor, &counter, &done), KVD_OK);
  EXPECT_EQ(done, kSteps);
  EXPECT_EQ(oor, rig->expected_out_of_range());
  EXPECT_EQ(bits, doorbell::kStatusOutOfRange);
  const v1::RegistrationInfo st = StatusAfter(rig.get(), kSteps);
  EXPECT_EQ(st.out_of_range(), rig->expected_out_of_range());
}

// Several compressed ratios in one registration: layer 1 at ratio 4,
// layer 2 at ratio 16, layer 0 per token. Each step carries
// StepRequest.compressed with one mapping per ratio; each compressed
// layer's main and index caches are stored from its own ratio's mapping
// and its convert_topk sees seq_len / ratio rows. Pools byte-identical to
// the CPU reference, index rows equal to the planner's.
TEST_F(StepE2eTest, TwoCompressedRatiosMatchTheReference) {
  std::unique_ptr<StepRig> rig = MakeRig(ThreeRatios("ratios"));
  ASSERT_NE(rig, nullptr);
  std::mt19937 rng(1306);
  int stored[2] = {0, 0};
  for (uint64_t step = 1; step <= 40; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    StepInput in = rig->RandomStep(step, rng);
    ASSERT_EQ(in.compressed_slots2.size(), in.slots.size());
    for (int32_t s : in.compressed_slots) stored[0] += s >= 0;
    for (int32_t s : in.compressed_slots2) stored[1] += s >= 0;
    ASSERT_EQ(rig->Request(in).compressed_size(), 2);
    ASSERT_OK(RunStep(rig.get(), in));
    if (step % 5 == 0) ASSERT_OK(rig->CheckPools());
  }
  EXPECT_GT(stored[0], 0);
  EXPECT_GT(stored[1], 0);
  // A step with the second ratio's entry missing is refused, naming it.
  StepInput in = rig->RandomStep(41, rng);
  v1::StepRequest r = rig->Request(in);
  r.mutable_compressed()->RemoveLast();
  grpc::ClientContext ctx;
  v1::StepResponse out;
  const grpc::Status s = rig->stub()->Step(&ctx, r, &out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("no entry for ratio 16"));
}

// A Step with block_tables_in_buffer on a registration without a
// block-table buffer, or with inline bytes too, is refused on the CUDA
// daemon as on the CPU one (//server/step:step_block_tables_test).
TEST_F(StepE2eTest, DeviceResidentBlockTablesNeedTheirBuffer) {
  RigOptions o;
  o.prefix = "devbt_refused";
  o.layers = 1;
  o.edit_step = [](const StepInput& in, v1::StepRequest* r) {
    if (in.step_id == 1) r->set_block_tables_in_buffer(true);
  };
  std::unique_ptr<StepRig> rig = MakeRig(o);
  ASSERT_NE(rig, nullptr);
  std::mt19937 rng(1306);
  StepInput in = rig->RandomStep(1, rng);
  absl::Status s = rig->SendStep(in).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()),
              ::testing::HasSubstr("block_tables_in_buffer"));
  RigOptions d;
  d.prefix = "devbt_bytes";
  d.layers = 1;
  d.device_block_tables = true;
  d.edit_step = [](const StepInput&, v1::StepRequest* r) {
    r->set_block_tables(std::string(4 * 8, '\0'));
  };
  std::unique_ptr<StepRig> both = MakeRig(d);
  ASSERT_NE(both, nullptr);
  in = both->RandomStep(1, rng);
  s = both->SendStep(in).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()),
              ::testing::HasSubstr("block_tables_in_buffer is set"));
}

TEST_F(StepE2eTest, WorkerSideReplaysFromACudaGraph) {
  RigOptions o;
  o.prefix = "graph";
  o.layers = 2;
  std::unique_ptr<StepRig> rig = MakeRig(o);
  ASSERT_NE(rig, nullptr);
  std::mt19937 rng(1302);
  StepInput in = rig->RandomStep(1, rng);
  rig->StageInputs(in);
  ASSERT_OK(rig->SendStep(in).status());
  ASSERT_OK(rig->EnqueueWorker(stream_->get(), /*copy_inputs=*/true));
  ASSERT_OK(SyncWithin(stream_->get(), absl::Seconds(30)));

  cudaGraph_t graph = nullptr;
  ASSERT_OK(Cuda(
      cudaStreamBeginCapture(stream_->get(), cudaStreamCaptureModeThreadLocal),
      "begin capture"));
  const absl::Status captured = rig->EnqueueWorker(stream_->get(), false);
  ASSERT_OK(Cuda(cudaStreamEndCapture(stream_->get(), &graph), "end capture"));
  ASSERT_OK(captured);
  cudaGraphExec_t exec = nullptr;
  ASSERT_OK(Cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate"));
  constexpr int kReplays = 120;
  for (int i = 0; i < kReplays; ++i) {
    in.step_id = 2 + i;
    ASSERT_OK(rig->SendStep(in).status());
    ASSERT_OK(Cuda(cudaGraphLaunch(exec, stream_->get()), "graph launch"));
    ASSERT_OK(SyncWithin(stream_->get(), absl::Seconds(30)));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  uint64_t bits = 0, counter = 0, done = 0;
  ASSERT_EQ(kvd_status(rig->worker(), &bits, nullptr, &counter, &done), KVD_OK);
  EXPECT_EQ(counter, 1u + kReplays);
  EXPECT_EQ(done, 1u + kReplays);
  EXPECT_EQ(bits & ~doorbell::kStatusOutOfRange, 0u);
  // Every replay stored the same rows into the same slots.
  ASSERT_OK(rig->ApplyReference(in));
  ASSERT_OK(rig->CheckPools());
  ASSERT_OK(rig->CheckIndexRows(in));
}

TEST_F(StepE2eTest, AThirdStepInFlightIsRefused) {
  RigOptions o;
  o.prefix = "depth";
  o.layers = 2;
  std::unique_ptr<StepRig> rig = MakeRig(o);
  ASSERT_NE(rig, nullptr);
  std::mt19937 rng(1303);
  StepInput in = rig->RandomStep(1, rng);
  rig->StageInputs(in);
  absl::StatusOr<v1::StepResponse> r1 = rig->SendStep(in);
  ASSERT_OK(r1.status());
  EXPECT_EQ(r1->queued(), 1);
  in.step_id = 2;
  absl::StatusOr<v1::StepResponse> r2 = rig->SendStep(in);
  ASSERT_OK(r2.status());
  EXPECT_EQ(r2->queued(), 2);
  in.step_id = 3;
  absl::StatusOr<v1::StepResponse> r3 = rig->SendStep(in);
  EXPECT_EQ(r3.status().code(), absl::StatusCode::kResourceExhausted)
      << r3.status();
  // The worker runs both queued steps; then the third is accepted.
  ASSERT_OK(rig->EnqueueWorker(stream_->get()));
  ASSERT_OK(rig->EnqueueWorker(stream_->get()));
  ASSERT_OK(SyncWithin(stream_->get(), absl::Seconds(30)));
  absl::Status third;
  for (int i = 0; i < 200; ++i) {  // the completion is reported by the host
    third = rig->SendStep(in).status();  // function; wait for it, bounded
    if (third.code() != absl::StatusCode::kResourceExhausted) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_OK(third);
  ASSERT_OK(rig->EnqueueWorker(stream_->get()));
  ASSERT_OK(SyncWithin(stream_->get(), absl::Seconds(30)));
  uint64_t bits = 0, done = 0;
  ASSERT_EQ(kvd_status(rig->worker(), &bits, nullptr, nullptr, &done), KVD_OK);
  EXPECT_EQ(done, 3u);
  EXPECT_EQ(bits & ~doorbell::kStatusOutOfRange, 0u);
}

// Ten registrations, each with its own streams in the daemon: one stalls
// (its worker has not reached the step) while the nine others finish
// theirs, then it finishes too; five more rounds after.
TEST_F(StepE2eTest, TenRegistrationsProgressIndependently) {
  constexpr int kRigs = 10;
  std::vector<std::unique_ptr<StepRig>> rigs;
  std::vector<Stream> streams;
  for (int i = 0; i < kRigs; ++i) {
    RigOptions o;
    o.prefix = "many" + std::to_string(i);
    o.layers = 1;
    o.max_tokens = 8;
    o.max_seqs = 4;
    rigs.push_back(MakeRig(o));
    ASSERT_NE(rigs.back(), nullptr);
    absl::StatusOr<Stream> s = Stream::Create();
    ASSERT_OK(s.status());
    streams.push_back(*std::move(s));
  }
  std::mt19937 rng(1304);
  for (uint64_t step = 1; step <= 6; ++step) {
    std::vector<StepInput> inputs;
    for (int i = 0; i < kRigs; ++i) {
      inputs.push_back(rigs[i]->RandomStep(step, rng));
      ASSERT_OK(rigs[i]->SendStep(inputs[i]).status());
    }
    // Registration 0 stalls first: its daemon stream waits on its doorbell.
    for (int i = 1; i < kRigs; ++i) {
      rigs[i]->StageInputs(inputs[i]);
      ASSERT_OK(rigs[i]->EnqueueWorker(streams[i].get()));
      ASSERT_OK(SyncWithin(streams[i].get(), absl::Seconds(30)));
      ASSERT_OK(rigs[i]->ApplyReference(inputs[i]));
      ASSERT_OK(rigs[i]->CheckIndexRows(inputs[i]));
    }
    rigs[0]->StageInputs(inputs[0]);
    ASSERT_OK(rigs[0]->EnqueueWorker(streams[0].get()));
    ASSERT_OK(SyncWithin(streams[0].get(), absl::Seconds(30)));
    ASSERT_OK(rigs[0]->ApplyReference(inputs[0]));
    ASSERT_OK(rigs[0]->CheckIndexRows(inputs[0]));
  }
  for (int i = 0; i < kRigs; ++i) ASSERT_OK(rigs[i]->CheckPools());
}

// Library mode on daemon-built metadata (Step.PlanStep,
// docs/LIBRARY_MODE.md): the worker sends PlanStep instead of Step,
// uploads the reply's metadata with one copy and launches kvdepot's CUDA
// entry points (libkvdepot_kernels) on its own stream with pointers into
// it: the stores at each layer's ratio, convert_topk per query row, the
// SWA decode index. No doorbell, no daemon kernel. Pools byte-identical to
// the CPU reference and index rows equal to the planner's, as the step
// path's (RandomStepsMatchTheReference), with the invalid entries counted
// as the planner counts them; no step id consumed. With `o`'s
// device_slot_mappings / device_block_tables the mappings and tables are
// the worker's own device arrays (the reply names none of them).
void LibraryModeOnPlanStep(Stream* stream, const RigOptions& options,
                           uint32_t seed) {
  absl::StatusOr<std::unique_ptr<StepRig>> made =
      StepRig::Create(env->daemon()->socket_path(), options);
  ASSERT_OK(made.status());
  StepRig* rig = made->get();
  const RigOptions& o = rig->options();
  const bool own_slots = o.device_slot_mappings;
  const bool own_tables = o.device_block_tables;
  struct Layout {
    kvdk_layout* h = nullptr;
    ~Layout() { kvdk_layout_destroy(h); }
  } main, swa, index;
  ASSERT_EQ(kvdk_layout_create("V41", 0, o.block_size, o.num_blocks, o.layers,
                               &main.h),
            KVDK_OK)
      << kvdk_last_error();
  ASSERT_EQ(kvdk_layout_create("V41", 0, o.ring, o.states, o.layers, &swa.h),
            KVDK_OK);
  ASSERT_EQ(kvdk_layout_create(o.index_format.c_str(), 0, o.block_size,
                               o.num_blocks, o.layers, &index.h),
            KVDK_OK);
  const int64_t ws_bytes = std::max(
      kvdk_cuda_workspace_bytes(KVDK_OP_STORE, o.max_tokens),
      kvdk_cuda_workspace_bytes(KVDK_OP_SWA_DECODE_INDEX, o.max_tokens));
  ASSERT_GT(ws_bytes, 0);
  struct DeviceMemory {
    void* p = nullptr;
    ~DeviceMemory() { cudaFree(p); }
    void* data() const { return p; }
  } meta, ws, invalid, own;
  ASSERT_OK(Cuda(cudaMalloc(&meta.p, 1 << 20), "cudaMalloc"));
  ASSERT_OK(Cuda(cudaMalloc(&ws.p, ws_bytes), "cudaMalloc"));
  ASSERT_OK(Cuda(cudaMalloc(&invalid.p, 8), "cudaMalloc"));
  // The worker's own mappings (3 rows of max_tokens) and tables.
  const int64_t own_tables_at = 3 * o.max_tokens;
  ASSERT_OK(Cuda(cudaMalloc(&own.p, 4 * (own_tables_at +
                                         o.max_seqs * o.max_blocks_per_seq)),
                 "cudaMalloc"));
  ASSERT_OK(Cuda(cudaMemset(invalid.data(), 0, 8), "zeroing the counter"));
  auto* invalid_count = static_cast<unsigned long long*>(invalid.data());
  int32_t* own_rows = static_cast<int32_t*>(own.data());
  cudaStream_t s = stream->get();
  uint8_t* io = rig->io();
  std::mt19937 rng(seed);
  constexpr int kSteps = 40;
  for (uint64_t step = 1; step <= kSteps; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    StepInput in = rig->RandomStep(step, rng);
    const int n = in.num_tokens();
    if (own_slots) {
      // The worker's own mappings may hold anything: the entry points'
      // device checks drop what is outside the pools.
      for (std::vector<int32_t>* v :
           {&in.slots, &in.compressed_slots, &in.compressed_slots2}) {
        for (int32_t& slot : *v) {
          if (std::uniform_int_distribution<int>(0, 7)(rng) == 0) {
            slot = std::uniform_int_distribution<int>(0, 1)(rng) == 0
                       ? -2
                       : rig->SlotCapacity() + 3;
          }
        }
      }
    }
    v1::StepRequest request = rig->Request(in);
    request.set_step_id(0);  // not read
    ASSERT_EQ(request.slot_mappings_in_buffer(), own_slots);
    ASSERT_EQ(request.block_tables_in_buffer(), own_tables);
    v1::PlanStepResponse plan;
    grpc::ClientContext ctx;
    const grpc::Status call = rig->stub()->PlanStep(&ctx, request, &plan);
    ASSERT_TRUE(call.ok()) << call.error_message();
    ASSERT_EQ(plan.num_tokens(), n);
    ASSERT_EQ(plan.compressed_size(), 2);
    ASSERT_LE(plan.metadata().size(), size_t{1} << 20);
    auto put = [&](void* dst, const void* host, size_t bytes) {
      return Cuda(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, s),
                  "copying the worker's rows");
    };
    ASSERT_OK(put(meta.data(), plan.metadata().data(), plan.metadata().size()));
    const int32_t* m = static_cast<const int32_t*>(meta.data());
    // The slots of a ratio: the reply's section, or the worker's own row.
    // The worker's rows: the main mapping, then the ratios ascending.
    const int small = std::min(o.ratio, o.ratio2);
    auto own_row = [&](int ratio) {
      return own_rows + (ratio == 1       ? 0
                         : ratio == small ? 1
                                          : 2) *
                            o.max_tokens;
    };
    auto slots_of = [&](int ratio) -> const int32_t* {
      if (own_slots) {
        EXPECT_EQ(plan.slots(), -1);
        return own_row(ratio);
      }
      if (ratio == 1) return m + plan.slots();
      for (const v1::PlannedSlots& c : plan.compressed()) {
        if (c.ratio() == ratio) return m + c.slots();
      }
      return nullptr;
    };
    if (own_slots) {
      ASSERT_OK(put(own_row(1), in.slots.data(), 4 * n));
      ASSERT_OK(put(own_row(o.ratio), in.compressed_slots.data(), 4 * n));
      ASSERT_OK(put(own_row(o.ratio2), in.compressed_slots2.data(), 4 * n));
    }
    const int cols = plan.block_table_cols();
    const int32_t* tables = m + plan.row_block_tables();
    if (own_tables) {
      // Decode: row r is sequence r, the worker's [seqs][cols] tables.
      EXPECT_EQ(plan.row_block_tables(), -1);
      ASSERT_EQ(n, in.num_seqs());
      ASSERT_OK(put(own_rows + own_tables_at, in.block_tables.data(),
                    4 * in.block_tables.size()));
      tables = own_rows + own_tables_at;
    }
    auto topk_of = [&](int ratio) -> const v1::PlannedTopk* {
      for (const v1::PlannedTopk& k : plan.topk_inputs()) {
        if (k.ratio() == ratio) return &k;
      }
      return nullptr;
    };
    for (int l = 0; l < o.layers; ++l) {
      SCOPED_TRACE(::testing::Message() << "layer " << l);
      const int ratio = LayerRatio(o, l);
      const int32_t* slots = slots_of(ratio);
      const v1::PlannedTopk* k = topk_of(ratio);
      ASSERT_NE(slots, nullptr);
      ASSERT_NE(k, nullptr);
      ASSERT_OK(put(io + rig->main_in(l), in.kv_main[l].data(), n * 1024));
      ASSERT_OK(put(io + rig->swa_in(l), in.kv_swa[l].data(), n * 1024));
      ASSERT_OK(put(io + rig->index_in(l), in.kv_index[l].data(), n * 256));
      ASSERT_OK(put(io + rig->out_off(l), in.topk[l].data(), n * o.top_k * 4));
      const struct {
        kvdk_layout* layout;
        uint8_t* pool;
        int64_t bytes;
        int64_t in;
        const int32_t* slots;
      } stores[] = {
          {main.h, rig->main_pool(), rig->main_layout().total_bytes,
           rig->main_in(l), slots},
          {swa.h, rig->swa_pool(), rig->swa_layout().total_bytes,
           rig->swa_in(l), m + plan.swa_slots()},
          {index.h, rig->index_pool(), rig->index_layout().total_bytes,
           rig->index_in(l), slots},
      };
      for (const auto& c : stores) {
        ASSERT_EQ(kvdk_store_cuda(c.layout, c.pool, c.bytes, l, io + c.in,
                                  KVDK_DTYPE_BF16, c.slots, n, ws.data(),
                                  ws_bytes, invalid_count, s),
                  KVDK_OK)
            << kvdk_last_error();
      }
      // In place over the rows copied to index_out (what CheckIndexRows
      // reads).
      ASSERT_EQ(kvdk_convert_topk_cuda(
                    index.h, reinterpret_cast<int32_t*>(io + rig->out_off(l)),
                    n, o.top_k, m + k->valid_count(), m + k->num_tokens(),
                    tables, cols, cols, invalid_count, s),
                KVDK_OK)
          << kvdk_last_error();
    }
    ASSERT_EQ(kvdk_swa_decode_index_cuda(
                  swa.h, m + plan.swa_state_ids(), m + plan.swa_starts(),
                  m + plan.swa_valid_lens(), n, o.window,
                  reinterpret_cast<int32_t*>(io + rig->swa_out()), ws.data(),
                  ws_bytes, invalid_count, s),
              KVDK_OK)
        << kvdk_last_error();
    ASSERT_OK(SyncWithin(s, absl::Seconds(30)));
    ASSERT_OK(rig->ApplyReference(in));
    ASSERT_OK(rig->CheckIndexRows(in));
    if (step % 10 == 0) ASSERT_OK(rig->CheckPools());
  }
  uint64_t counted = 0;
  ASSERT_OK(
      Cuda(cudaMemcpy(&counted, invalid.data(), 8, cudaMemcpyDeviceToHost),
           "reading the counter"));
  EXPECT_GT(rig->expected_out_of_range(), 0u) << "the test must exercise -1";
  // A dropped slot of the worker's own mappings is counted by both stores
  // that read its row (main and index cache), once by the reference.
  EXPECT_EQ(counted, rig->expected_out_of_range() + rig->dropped_slots());
  if (own_slots) {
    EXPECT_GT(rig->dropped_slots(), 20u) << "slots outside the pools";
  }
  absl::StatusOr<v1::RegistrationInfo> info = rig->Status();
  ASSERT_OK(info.status());
  EXPECT_EQ(info->last_step_id(), 0u) << "PlanStep consumes no step id";
  EXPECT_EQ(info->steps_completed(), 0u);
}

TEST_F(StepE2eTest, LibraryModeOnPlanStepMetadataMatchesTheReference) {
  LibraryModeOnPlanStep(&*stream_, ThreeRatios("libplan"), 1302);
}

// The same with the worker's own device slot mappings and block tables
// (decode steps: one query token per sequence).
TEST_F(StepE2eTest, LibraryModeOnPlanStepWithDeviceResidentInputs) {
  RigOptions o = ThreeRatios("libplandev");
  o.decode_only = true;
  o.device_slot_mappings = true;
  o.device_block_tables = true;
  LibraryModeOnPlanStep(&*stream_, o, 1303);
}

}  // namespace
}  // namespace kvdepot::testing
