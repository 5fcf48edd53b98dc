// The step path end to end with TWO worker processes (issue 13 item 6):
// each worker (this binary again, --two_workers_child=SOCKET,W) registers
// on pools the test created, takes the slots of its parity and half of the
// SWA states, and for every step produces its K/V and top-k rows with its
// own kernels (step_worker_kernels.h), marks and waits per phase, and after
// every wait(A_l) checks every slot the step stored with a kernel: the
// shared pool's record equals the worker's own library-mode store of the
// same rows (so the daemon's stores had landed when "done" was seen); after
// every step its index and SWA rows equal the planner's. Both run at once,
// kSteps steps each, random slot mappings, 3 layers. Then the test replays
// both workers' steps into the CPU reference: the pools are byte-identical.
#include <cuda_runtime_api.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "kernels/cuda/kernels.h"
#include "planner/plan.h"
#include "tests/daemon_process.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/step_harness.h"
#include "tests/gpu/step_worker_kernels.h"

namespace kvdepot::testing {
namespace {

constexpr int kSteps = 100;
constexpr int kWorkers = 2;

// The options of worker `w` (and, with create_pools, of the pools' owner).
RigOptions WorkerOptions(int w) {
  RigOptions o;
  o.prefix = "duo";
  o.create_pools = false;
  o.layers = 3;
  o.block_size = 16;
  o.num_blocks = 64;
  o.ring = 32;
  o.states = 16;
  o.window = 16;
  o.max_tokens = 32;
  o.max_seqs = 8;
  o.top_k = 24;
  o.max_blocks_per_seq = 8;
  o.slot_stride = kWorkers;
  o.slot_offset = w;
  o.state_offset = w * (o.states / kWorkers);
  o.state_count = o.states / kWorkers;
  o.kv_seed = 1300 + w;
  o.watchdog_ms = 60000;
  return o;
}
uint32_t StepSeed(int w) { return 1400 + w; }

// Worker `w`: kSteps steps; prints "ok <mismatches> <out of range> <expected
// out of range>" or "error <message>".
int RunWorker(const std::string& socket, int w) {
  auto fail = [](const absl::Status& s) {
    std::printf("error %s\n", s.ToString().c_str());
    std::fflush(stdout);
    return 1;
  };
  if (cudaSetDevice(0) != cudaSuccess) {
    return fail(absl::InternalError("no CUDA device"));
  }
  const RigOptions o = WorkerOptions(w);
  absl::StatusOr<std::unique_ptr<StepRig>> created = StepRig::Create(socket, o);
  if (!created.ok()) return fail(created.status());
  StepRig* rig = created->get();
  absl::StatusOr<Stream> stream = Stream::Create();
  if (!stream.ok()) return fail(stream.status());
  cudaStream_t s = stream->get();
  // Scratch layers for the worker's own stores, the step's slots on the
  // device, the mismatch counter.
  const PoolLayout* layouts[3] = {&rig->main_layout(), &rig->swa_layout(),
                                  &rig->index_layout()};
  uint8_t* pools[3] = {rig->main_pool(), rig->swa_pool(), rig->index_pool()};
  uint8_t* scratch[3] = {nullptr, nullptr, nullptr};
  int32_t* dev_slots = nullptr;  // [2][max_tokens]: slots, SWA slots
  unsigned long long* mismatches = nullptr;
  for (int c = 0; c < 3; ++c) {
    if (cudaMalloc(reinterpret_cast<void**>(&scratch[c]),
                   layouts[c]->layer_bytes) != cudaSuccess) {
      return fail(absl::InternalError("cudaMalloc"));
    }
  }
  if (cudaMalloc(reinterpret_cast<void**>(&dev_slots), 2 * o.max_tokens * 4) !=
          cudaSuccess ||
      cudaMalloc(reinterpret_cast<void**>(&mismatches), 8) != cudaSuccess ||
      cudaMemset(mismatches, 0, 8) != cudaSuccess) {
    return fail(absl::InternalError("cudaMalloc"));
  }
  absl::StatusOr<Pinned> host_slots = Pinned::Create(2 * o.max_tokens * 4);
  if (!host_slots.ok()) return fail(host_slots.status());
  int n = 0;
  WorkerHooks hooks;
  hooks.after_stores = [&](cudaStream_t st, int l) -> absl::Status {
    gpu::LaunchOptions lo;
    lo.stream = st;
    const int64_t in[3] = {rig->main_in(l), rig->swa_in(l), rig->index_in(l)};
    const int32_t* slots[3] = {dev_slots, dev_slots + o.max_tokens, dev_slots};
    for (int c = 0; c < 3; ++c) {
      RETURN_IF_ERROR(gpu::Store(*layouts[c], scratch[c], rig->io() + in[c],
                                 InputDtype::kBF16, slots[c], n, lo));
      RETURN_IF_ERROR(
          Cuda(static_cast<cudaError_t>(LaunchCompareSlots(
                   *layouts[c], pools[c] + layouts[c]->layer_offset(l),
                   scratch[c], slots[c], n, mismatches, st)),
               "compare kernel"));
    }
    return absl::OkStatus();
  };
  std::mt19937 rng(StepSeed(w));
  for (uint64_t step = 1; step <= kSteps; ++step) {
    StepInput in = rig->RandomStep(step, rng);
    n = in.num_tokens();
    SequenceBatch batch;
    batch.seqlen_k = in.seq_lens;
    batch.seqlen_q = in.query_lens;
    batch.state_ids = in.states;
    int32_t* h = reinterpret_cast<int32_t*>(host_slots->data());
    std::memcpy(h, in.slots.data(), n * 4);
    absl::Status st = BuildSwaStoreSlots(batch, {o.ring, o.ring, o.states},
                                         absl::MakeSpan(h + o.max_tokens, n));
    if (st.ok()) {
      st = Cuda(cudaMemcpyAsync(dev_slots, h, 2 * o.max_tokens * 4,
                                cudaMemcpyHostToDevice, s),
                "slots");
    }
    if (st.ok()) st = rig->ApplyReference(in);
    rig->StageInputs(in);
    if (st.ok()) st = rig->SendStep(in).status();
    if (st.ok()) st = rig->EnqueueWorker(s, true, hooks);
    if (st.ok()) st = SyncWithin(s, absl::Seconds(20));
    if (st.ok()) st = rig->CheckIndexRows(in);
    if (!st.ok()) {
      return fail(absl::Status(
          st.code(), absl::StrCat("step ", step, ": ", st.message())));
    }
  }
  unsigned long long count = 0;
  if (cudaMemcpy(&count, mismatches, 8, cudaMemcpyDeviceToHost) !=
      cudaSuccess) {
    return fail(absl::InternalError("reading the mismatch count"));
  }
  uint64_t bits = 0, oor = 0;
  kvd_status(rig->worker(), &bits, &oor, nullptr, nullptr);
  std::printf("ok %llu %llu %llu %llu\n", count,
              static_cast<unsigned long long>(oor),
              static_cast<unsigned long long>(rig->expected_out_of_range()),
              static_cast<unsigned long long>(bits));
  std::fflush(stdout);
  for (uint8_t* p : scratch) cudaFree(p);
  cudaFree(dev_slots);
  cudaFree(mismatches);
  return 0;
}

TEST(StepTwoWorkersTest, TwoWorkerProcessesMatchTheCpuReference) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  ASSERT_TRUE(e == cudaSuccess && count > 0)
      << "this test needs a CUDA device (" << cudaGetErrorString(e) << ")";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  absl::StatusOr<std::unique_ptr<DaemonProcess>> daemon = DaemonProcess::Start(
      {"--backend=cuda", "--log_level=warn"}, DaemonBinary());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  // The pools' owner (its registration is never stepped): the reference.
  RigOptions owner = WorkerOptions(0);
  owner.create_pools = true;
  owner.slot_stride = 1;
  owner.slot_offset = 0;
  owner.state_offset = 0;
  owner.state_count = 0;
  absl::StatusOr<std::unique_ptr<StepRig>> rig =
      StepRig::Create((*daemon)->socket_path(), owner);
  ASSERT_TRUE(rig.ok()) << rig.status();

  char self[4096];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
  ASSERT_GT(len, 0);
  self[len] = '\0';
  std::vector<pid_t> pids;
  std::vector<FILE*> outs;
  for (int w = 0; w < kWorkers; ++w) {
    int out = -1;
    absl::StatusOr<pid_t> pid = Spawn(
        {self, absl::StrCat("--two_workers_child=", (*daemon)->socket_path(),
                            ",", w)},
        &out);
    ASSERT_TRUE(pid.ok()) << pid.status();
    pids.push_back(*pid);
    outs.push_back(fdopen(out, "r"));
  }
  for (int w = 0; w < kWorkers; ++w) {
    char line[512] = {0};
    ASSERT_NE(fgets(line, sizeof(line), outs[w]), nullptr)
        << "worker " << w << " said nothing";
    unsigned long long mismatches = 1, oor = 0, expected = 1, bits = 0;
    ASSERT_EQ(std::sscanf(line, "ok %llu %llu %llu %llu", &mismatches, &oor,
                          &expected, &bits),
              4)
        << "worker " << w << ": " << line;
    EXPECT_EQ(mismatches, 0u) << "worker " << w
                              << ": slots whose record was "
                                 "not the step's after wait(A_l)";
    EXPECT_EQ(oor, expected) << "worker " << w;
    EXPECT_GT(expected, 0u) << "the top-k rows never went out of range";
    EXPECT_EQ(bits & ~uint64_t{KVD_STATUS_OUT_OF_RANGE}, 0u) << "worker " << w;
    absl::StatusOr<int> code = WaitForExit(pids[w], absl::Seconds(60));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0);
    fclose(outs[w]);
  }
  // Both workers' steps into the reference (disjoint slots and states).
  for (int w = 0; w < kWorkers; ++w) {
    std::mt19937 rng(StepSeed(w));
    for (uint64_t step = 1; step <= kSteps; ++step) {
      StepInput in = RandomStepFor(WorkerOptions(w), step, rng);
      ASSERT_TRUE((*rig)->ApplyReference(in).ok());
    }
  }
  const absl::Status pools = (*rig)->CheckPools();
  EXPECT_TRUE(pools.ok()) << pools;
  rig->reset();
  absl::StatusOr<int> code = (*daemon)->Signal(SIGTERM, absl::Seconds(60));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

}  // namespace
}  // namespace kvdepot::testing

int main(int argc, char** argv) {
  kvdepot::testing::SetStepEnvironment();
  const std::string child = "--two_workers_child=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], child.c_str(), child.size()) == 0) {
      const std::string arg = argv[i] + child.size();
      const size_t comma = arg.rfind(',');
      int w = 0;
      if (comma == std::string::npos ||
          !absl::SimpleAtoi(arg.substr(comma + 1), &w) || w < 0 ||
          w >= kvdepot::testing::kWorkers) {
        return 2;
      }
      return kvdepot::testing::RunWorker(arg.substr(0, comma), w);
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
