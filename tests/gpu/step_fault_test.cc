// Faults of the step path on a GPU (SPEC §10, issue 13 item 5):
//   - a worker process SIGKILLed with the daemon's stream parked on its
//     doorbell while another worker shares its pools: the other never
//     stalls; the daemon notices the closed session, releases from its
//     control stream, the cancelled phases write nothing and the
//     registration reports the cancel;
//   - a step that never comes: the worker library's watchdog releases its
//     own waits and every later call fails;
//   - kvdepotd SIGKILLed mid-step: the same watchdog releases the worker;
//   - a worker SIGSTOPped mid-step while another shares its pools: the
//     other never stalls; the daemon's step watchdog (deadline_ms) cancels
//     and releases from its control stream; registration C, started while
//     the stopped one is parked, launches a store kernel the daemon never
//     ran before (MXFP8_INDEX) and finishes; the cancelled phases write
//     nothing; after SIGCONT the stopped worker finishes its step and sees
//     the sticky cancelled status.
// The victim worker is this binary again (--step_fault_child=SOCKET, or
// --step_stop_child=SOCKET: the same, then on "go" from stdin it enqueues
// the rest of its step and prints "bits <status bits> next <rc>").
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "proto/step_doorbell.h"
#include "tests/daemon_process.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/step_daemon_env.h"
#include "tests/gpu/step_harness.h"

extern char** environ;

namespace kvdepot::testing {
namespace {

constexpr int kVictimLayers = 3;
constexpr uint32_t kStopDeadlineMs = 8000;

// The victim: registers 3 layers on the shared pools, sends step 1, runs
// phase S and A_0, then stops before B_0 (the daemon's stream parks on
// that flag) and says "parked".
int RunVictim(const std::string& socket, bool resume) {
  if (cudaSetDevice(0) != cudaSuccess) return 2;
  RigOptions o;
  o.prefix = "shared";
  o.create_pools = false;
  o.layers = kVictimLayers;
  o.watchdog_ms = 600000;
  // The stopped victim is caught by the daemon's step watchdog.
  if (resume) o.deadline_ms = kStopDeadlineMs;
  absl::StatusOr<std::unique_ptr<StepRig>> rig = StepRig::Create(socket, o);
  if (!rig.ok()) {
    std::fprintf(stderr, "victim: %s\n", rig.status().ToString().c_str());
    return 3;
  }
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  std::mt19937 rng(77);
  StepInput in = (*rig)->RandomStep(1, rng);
  (*rig)->StageInputs(in);
  if (!(*rig)->SendStep(in).ok()) return 4;
  kvd_worker* w = (*rig)->worker();
  if (kvd_step_begin(w, s) != KVD_OK || kvd_wait(w, s, KVD_BEGIN) != KVD_OK ||
      kvd_mark(w, s, kvd_phase_a(0)) != KVD_OK ||
      kvd_wait(w, s, kvd_phase_a(0)) != KVD_OK) {
    return 5;
  }
  if (!SyncWithin(s, absl::Seconds(30)).ok()) return 6;
  std::printf("parked\n");
  std::fflush(stdout);
  if (!resume) {
    while (true) pause();
  }
  char line[16];
  if (fgets(line, sizeof(line), stdin) == nullptr) return 7;
  // The rest of step 1: B_0, then A/B of the other layers. The daemon
  // released every flag, so nothing waits; the gate wrote nothing.
  for (int l = 0; l < kVictimLayers; ++l) {
    if (l > 0 && (kvd_mark(w, s, kvd_phase_a(l)) != KVD_OK ||
                  kvd_wait(w, s, kvd_phase_a(l)) != KVD_OK)) {
      return 8;
    }
    if (kvd_mark(w, s, kvd_phase_b(l)) != KVD_OK ||
        kvd_wait(w, s, kvd_phase_b(l)) != KVD_OK) {
      return 8;
    }
  }
  if (!SyncWithin(s, absl::Seconds(30)).ok()) return 9;
  uint64_t bits = 0;
  if (kvd_status(w, &bits, nullptr, nullptr, nullptr) != KVD_OK) return 10;
  // A later step of the cancelled registration is refused by the daemon.
  StepInput next = (*rig)->RandomStep(2, rng);
  const absl::Status st = (*rig)->SendStep(next).status();
  std::printf("bits %llu next %d\n", static_cast<unsigned long long>(bits),
              static_cast<int>(st.code()));
  std::fflush(stdout);
  return 0;
}

// Spawns argv with pipes for its stdout (*out) and stdin (*in).
absl::StatusOr<pid_t> SpawnWithStdin(const std::vector<std::string>& argv,
                                     int* out, int* in) {
  std::vector<char*> args;
  for (const std::string& a : argv) {
    args.push_back(const_cast<char*>(a.c_str()));
  }
  args.push_back(nullptr);
  int o[2], i[2];
  if (pipe2(o, O_CLOEXEC) != 0) return absl::InternalError("pipe2");
  if (pipe2(i, O_CLOEXEC) != 0) return absl::InternalError("pipe2");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, o[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, i[0], STDIN_FILENO);
  pid_t pid = 0;
  const int rc =
      posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(o[1]);
  close(i[0]);
  if (rc != 0) {
    close(o[0]);
    close(i[1]);
    return absl::InternalError("posix_spawn");
  }
  *out = o[0];
  *in = i[1];
  return pid;
}

// A daemon of its own per test (not StepDaemonEnv's shared one): tests here
// SIGKILL the daemon or check its exit code, and look for other
// registrations than their own.
std::unique_ptr<DaemonProcess> StartDaemon() {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = StartStepDaemon();
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

class StepFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    ASSERT_TRUE(e == cudaSuccess && count > 0)
        << "this test needs a CUDA device (" << cudaGetErrorString(e) << ")";
    ASSERT_OK(Cuda(cudaSetDevice(0), "cudaSetDevice(0)"));
    absl::StatusOr<Stream> s = Stream::Create();
    ASSERT_OK(s.status());
    stream_.emplace(*std::move(s));
  }
  // One full step of `rig`, checked against the planner.
  void RunStep(StepRig* rig, uint64_t step, std::mt19937& rng) {
    StepInput in = rig->RandomStep(step, rng);
    rig->StageInputs(in);
    ASSERT_OK(rig->SendStep(in).status());
    ASSERT_OK(rig->EnqueueWorker(stream_->get()));
    ASSERT_OK(SyncWithin(stream_->get(), absl::Seconds(10)));
    ASSERT_OK(rig->ApplyReference(in));
    ASSERT_OK(rig->CheckIndexRows(in));
  }
  // A rig of `daemon` with prefix, layers, pool layers (0 = layers) and
  // worker watchdog (0 = the default).
  std::unique_ptr<StepRig> MakeRig(const DaemonProcess& daemon,
                                   const std::string& prefix, int layers,
                                   int pool_layers = 0, int watchdog_ms = 0) {
    RigOptions o;
    o.prefix = prefix;
    o.layers = layers;
    o.pool_layers = pool_layers;
    if (watchdog_ms > 0) o.watchdog_ms = watchdog_ms;
    absl::StatusOr<std::unique_ptr<StepRig>> rig =
        StepRig::Create(daemon.socket_path(), o);
    EXPECT_TRUE(rig.ok()) << rig.status();
    return rig.ok() ? *std::move(rig) : nullptr;
  }
  std::optional<Stream> stream_;
};

// This test binary's path (the victim workers are this binary again).
std::string SelfExe() {
  char self[4096];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
  return len > 0 ? std::string(self, static_cast<size_t>(len)) : std::string();
}

bool AllZero(const uint8_t* device, int64_t bytes) {
  std::vector<uint8_t> host(bytes);
  if (cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost) !=
      cudaSuccess) {
    return false;
  }
  for (uint8_t b : host) {
    if (b != 0) return false;
  }
  return true;
}

TEST_F(StepFaultTest, KilledWorkerIsReleasedAndTheOtherNeverStalls) {
  std::unique_ptr<DaemonProcess> daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  // The survivor owns the shared pools (3 layers) and drives layer 0 only.
  std::unique_ptr<StepRig> rig =
      MakeRig(*daemon, "shared", /*layers=*/1, kVictimLayers);
  ASSERT_NE(rig, nullptr);
  std::mt19937 rng(1305);
  RunStep(rig.get(), 1, rng);

  const std::string self = SelfExe();
  ASSERT_FALSE(self.empty());
  int out = -1;
  absl::StatusOr<pid_t> victim =
      Spawn({self, "--step_fault_child=" + daemon->socket_path()}, &out);
  ASSERT_OK(victim.status());
  FILE* f = fdopen(out, "r");
  char line[64] = {0};
  ASSERT_NE(fgets(line, sizeof(line), f), nullptr) << "the victim exited";
  ASSERT_STREQ(line, "parked\n");

  // The victim's daemon stream is parked on its B_0 flag: ours goes on.
  for (uint64_t step = 2; step <= 11; ++step) RunStep(rig.get(), step, rng);
  // Pool layers 1 and 2 belong to the victim's phases that never ran.
  const PoolLayout& ml = rig->main_layout();
  ASSERT_TRUE(
      AllZero(rig->main_pool() + ml.layer_offset(1), 2 * ml.layer_stride));

  ASSERT_EQ(kill(*victim, SIGKILL), 0);
  ASSERT_OK(WaitForExit(*victim, absl::Seconds(30)).status());
  fclose(f);

  // The daemon cancels (closed session) and releases: the victim's step
  // finishes, cancelled, without writing.
  v1::RegistrationInfo victim_info;
  bool seen = false;
  for (int i = 0; i < 500 && !seen; ++i) {
    grpc::ClientContext ctx;
    v1::ListRegistrationsRequest r;
    r.set_session_id(rig->client()->session_id());
    v1::ListRegistrationsResponse list;
    ASSERT_TRUE(rig->stub()->ListRegistrations(&ctx, r, &list).ok());
    for (const v1::RegistrationInfo& info : list.registrations()) {
      if (info.registration_id() != rig->registration_id() &&
          info.cancelled() && info.completed_step_id() == 1) {
        victim_info = info;
        seen = true;
      }
    }
    if (!seen) absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(seen) << "the victim's registration was not cancelled and "
                       "released (the daemon runs as this uid: admin)";
  EXPECT_NE(victim_info.cancel_reason().find("session closed"),
            std::string::npos)
      << victim_info.cancel_reason();
  EXPECT_NE(victim_info.status_bits() & doorbell::kStatusCancelled, 0u);
  EXPECT_TRUE(
      AllZero(rig->main_pool() + ml.layer_offset(1), 2 * ml.layer_stride));
  const PoolLayout& il = rig->index_layout();
  EXPECT_TRUE(
      AllZero(rig->index_pool() + il.layer_offset(1), 2 * il.layer_stride));
  for (uint64_t step = 12; step <= 21; ++step) RunStep(rig.get(), step, rng);
  rig.reset();
  absl::StatusOr<int> code = daemon->Signal(SIGTERM, absl::Seconds(60));
  ASSERT_OK(code.status());
  EXPECT_EQ(*code, 0);
}

// The victim's registration as listed (admin: the daemon runs as this
// uid; the victim's has the name of `rig`'s but another id), once `done`
// holds for it; false after ~20 s.
bool AwaitVictim(StepRig* rig,
                 const std::function<bool(const v1::RegistrationInfo&)>& done,
                 v1::RegistrationInfo* out) {
  for (int i = 0; i < 1000; ++i) {
    grpc::ClientContext ctx;
    v1::ListRegistrationsRequest r;
    r.set_session_id(rig->client()->session_id());
    v1::ListRegistrationsResponse list;
    if (!rig->stub()->ListRegistrations(&ctx, r, &list).ok()) return false;
    for (const v1::RegistrationInfo& info : list.registrations()) {
      if (info.registration_id() != rig->registration_id() &&
          info.name() == rig->options().prefix && done(info)) {
        *out = info;
        return true;
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

TEST_F(StepFaultTest, StoppedWorkerIsCancelledByTheWatchdogAndSeesItAfter) {
  std::unique_ptr<DaemonProcess> daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  std::unique_ptr<StepRig> rig =
      MakeRig(*daemon, "shared", /*layers=*/1, kVictimLayers);
  ASSERT_NE(rig, nullptr);
  std::mt19937 rng(1308);
  RunStep(rig.get(), 1, rng);

  const std::string self = SelfExe();
  ASSERT_FALSE(self.empty());
  int out = -1, in = -1;
  absl::StatusOr<pid_t> victim = SpawnWithStdin(
      {self, "--step_stop_child=" + daemon->socket_path()}, &out, &in);
  ASSERT_OK(victim.status());
  FILE* from = fdopen(out, "r");
  FILE* to = fdopen(in, "w");
  char line[128] = {0};
  ASSERT_NE(fgets(line, sizeof(line), from), nullptr) << "the victim exited";
  ASSERT_STREQ(line, "parked\n");
  ASSERT_EQ(kill(*victim, SIGSTOP), 0);

  // Registration C, while the victim's daemon stream is parked: a store
  // kernel the daemon never launched before (MXFP8_INDEX) finishes.
  {
    RigOptions c;
    c.prefix = "fresh";
    c.layers = 2;
    c.index_format = "MXFP8_INDEX";
    absl::StatusOr<std::unique_ptr<StepRig>> fresh =
        StepRig::Create(daemon->socket_path(), c);
    ASSERT_OK(fresh.status());
    std::mt19937 rng_c(1309);
    for (uint64_t step = 1; step <= 3; ++step) {
      RunStep(fresh->get(), step, rng_c);
    }
    ASSERT_OK((*fresh)->CheckPools());
  }
  v1::RegistrationInfo info;
  ASSERT_TRUE(AwaitVictim(
      rig.get(), [](const v1::RegistrationInfo&) { return true; }, &info));
  EXPECT_FALSE(info.cancelled())
      << "C took longer than the victim's deadline: " << info.cancel_reason();

  // Ours goes on while the victim is stopped.
  for (uint64_t step = 2; step <= 11; ++step) RunStep(rig.get(), step, rng);
  const PoolLayout& ml = rig->main_layout();
  const PoolLayout& il = rig->index_layout();

  // The deadline passes: the watchdog cancels and releases.
  ASSERT_TRUE(AwaitVictim(
      rig.get(),
      [](const v1::RegistrationInfo& i) {
        return i.cancelled() && i.completed_step_id() == 1;
      },
      &info))
      << "the stopped victim's step was not cancelled and released";
  EXPECT_NE(info.cancel_reason().find("deadline"), std::string::npos)
      << info.cancel_reason();
  EXPECT_GE(info.watchdog_expiries(), 1u);
  EXPECT_NE(info.status_bits() & doorbell::kStatusCancelled, 0u);
  EXPECT_TRUE(
      AllZero(rig->main_pool() + ml.layer_offset(1), 2 * ml.layer_stride));
  EXPECT_TRUE(
      AllZero(rig->index_pool() + il.layer_offset(1), 2 * il.layer_stride));
  for (uint64_t step = 12; step <= 21; ++step) RunStep(rig.get(), step, rng);

  // SIGCONT: the victim finishes its (cancelled) step and sees the status.
  ASSERT_EQ(kill(*victim, SIGCONT), 0);
  std::fputs("go\n", to);
  std::fflush(to);
  ASSERT_NE(fgets(line, sizeof(line), from), nullptr) << "the victim exited";
  unsigned long long bits = 0;
  int next = 0;
  ASSERT_EQ(std::sscanf(line, "bits %llu next %d", &bits, &next), 2) << line;
  EXPECT_NE(bits & KVD_STATUS_CANCELLED, 0u) << line;
  EXPECT_EQ(next, static_cast<int>(absl::StatusCode::kFailedPrecondition))
      << line;
  absl::StatusOr<int> victim_code = WaitForExit(*victim, absl::Seconds(30));
  ASSERT_OK(victim_code.status());
  EXPECT_EQ(*victim_code, 0);
  fclose(from);
  fclose(to);
  EXPECT_TRUE(
      AllZero(rig->main_pool() + ml.layer_offset(1), 2 * ml.layer_stride));
  rig.reset();
  absl::StatusOr<int> code = daemon->Signal(SIGTERM, absl::Seconds(60));
  ASSERT_OK(code.status());
  EXPECT_EQ(*code, 0);
}

TEST_F(StepFaultTest, AStepThatNeverComesIsReleasedByTheWorkerWatchdog) {
  std::unique_ptr<DaemonProcess> daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  std::unique_ptr<StepRig> rig =
      MakeRig(*daemon, "orphan", /*layers=*/2,
              /*pool_layers=*/0, /*watchdog_ms=*/300);
  ASSERT_NE(rig, nullptr);
  std::mt19937 rng(1306);
  StepInput in = rig->RandomStep(1, rng);
  rig->StageInputs(in);
  // No Step request: the worker's stream parks on the begin phase.
  ASSERT_OK(rig->EnqueueWorker(stream_->get()));
  ASSERT_OK(SyncWithin(stream_->get(), absl::Seconds(20)));
  uint64_t bits = 0;
  ASSERT_EQ(kvd_status(rig->worker(), &bits, nullptr, nullptr, nullptr),
            KVD_OK);
  EXPECT_NE(bits & KVD_STATUS_WORKER_WATCHDOG, 0u);
  EXPECT_EQ(kvd_mark(rig->worker(), stream_->get(), 1), KVD_ERR_RELEASED);
  EXPECT_EQ(kvd_step_begin(rig->worker(), stream_->get()), KVD_ERR_RELEASED);
  rig.reset();
  absl::StatusOr<int> code = daemon->Signal(SIGTERM, absl::Seconds(60));
  ASSERT_OK(code.status());
  EXPECT_EQ(*code, 0);
}

TEST_F(StepFaultTest, KilledDaemonIsCaughtByTheWorkerWatchdog) {
  std::unique_ptr<DaemonProcess> daemon = StartDaemon();
  ASSERT_NE(daemon, nullptr);
  std::unique_ptr<StepRig> rig =
      MakeRig(*daemon, "lost", /*layers=*/2,
              /*pool_layers=*/0, /*watchdog_ms=*/300);
  ASSERT_NE(rig, nullptr);
  std::mt19937 rng(1307);
  RunStep(rig.get(), 1, rng);
  StepInput in = rig->RandomStep(2, rng);
  rig->StageInputs(in);
  ASSERT_OK(rig->SendStep(in).status());
  ASSERT_OK(daemon->Signal(SIGKILL, absl::Seconds(30)).status());
  // The doorbell outlives the daemon (this process holds the mapping).
  ASSERT_OK(rig->EnqueueWorker(stream_->get()));
  ASSERT_OK(SyncWithin(stream_->get(), absl::Seconds(20)));
  uint64_t bits = 0;
  ASSERT_EQ(kvd_status(rig->worker(), &bits, nullptr, nullptr, nullptr),
            KVD_OK);
  EXPECT_NE(bits & KVD_STATUS_WORKER_WATCHDOG, 0u);
  EXPECT_EQ(kvd_step_begin(rig->worker(), stream_->get()), KVD_ERR_RELEASED);
}

}  // namespace
}  // namespace kvdepot::testing

int main(int argc, char** argv) {
  kvdepot::testing::SetStepEnvironment();
  const std::string child = "--step_fault_child=";
  const std::string stop_child = "--step_stop_child=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], child.c_str(), child.size()) == 0) {
      return kvdepot::testing::RunVictim(argv[i] + child.size(), false);
    }
    if (std::strncmp(argv[i], stop_child.c_str(), stop_child.size()) == 0) {
      return kvdepot::testing::RunVictim(argv[i] + stop_child.size(), true);
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
