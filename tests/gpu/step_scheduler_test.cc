// step_scheduler (step_benchmark's scheduler process) against a CPU
// kvdepotd, no GPU, with each API (sync, callback, stream): the pipe
// protocol, the session travelling in the request, the daemon's status
// codes coming back (on a stream, as each message's reply while the stream
// stays open), the CPU report. The CPU
// backend has no step path, so a fake Step service stands in for a daemon
// whose registration has two steps in flight: the refused step is sent
// again (step_send_retry.h), within the budget, and nothing else is.
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/kvdepot_client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvdepot/v1/step.grpc.pb.h"
#include "kvdepot/v1/step.pb.h"
#include "tests/daemon_process.h"
#include "tests/gpu/step_bench_sched.h"

namespace kvdepot::testing {
namespace {

class StepSchedulerTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
        DaemonProcess::Start({"--backend=cpu", "--log_level=warn"});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    request_ = ::testing::TempDir() + "/step_request.bin";
  }
  // The scheduler on a request of `session` for registration 999.
  std::unique_ptr<SchedulerProcess> Start(const std::string& session) {
    v1::StepRequest r;
    r.set_session_id(session);
    r.set_registration_id(999);
    r.set_num_tokens(2);
    r.set_slot_mapping(std::string(8, '\0'));
    std::ofstream(request_, std::ios::binary) << r.SerializeAsString();
    std::vector<std::string> argv = {"tests/gpu/step_scheduler",
                                     "--socket=" + daemon_->socket_path(),
                                     "--request=" + request_};
    for (absl::string_view flag : absl::StrSplit(GetParam(), ' ')) {
      argv.emplace_back(flag);
    }
    absl::StatusOr<std::unique_ptr<SchedulerProcess>> p =
        SchedulerProcess::Start(argv);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *std::move(p) : nullptr;
  }
  std::unique_ptr<DaemonProcess> daemon_;
  std::string request_;
};

TEST_P(StepSchedulerTest, AnUnknownSessionIsUnauthenticated) {
  std::unique_ptr<SchedulerProcess> p = Start(std::string(32, 'a'));
  ASSERT_NE(p, nullptr);
  for (uint64_t step = 1; step <= 3; ++step) {
    const absl::Status s = p->Send(step);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
    EXPECT_FALSE(s.message().empty());
  }
  absl::StatusOr<double> cpu = p->Finish();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_GT(*cpu, 0.0);  // two counted steps did some work
}

TEST_P(StepSchedulerTest, ARealSessionReachesTheStepService) {
  ClientOptions o;
  o.address = daemon_->socket_path();
  absl::StatusOr<std::unique_ptr<KVCacheClient>> c = KVCacheClient::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  std::unique_ptr<SchedulerProcess> p = Start((*c)->session_id());
  ASSERT_NE(p, nullptr);
  // The session is accepted: the answer is about registration 999.
  const absl::Status s = p->Send(1);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.code(), absl::StatusCode::kUnauthenticated) << s;
  EXPECT_NE(s.code(), absl::StatusCode::kInternal) << s;
  ASSERT_TRUE(p->Finish().ok());
}

// A scheduler that spins between steps counts its steps, not its spinning:
// 300 ms of spinning before each of two counted steps would be >= 300000 us
// per step.
TEST_P(StepSchedulerTest, ABusySchedulerCountsItsStepsNotItsSpinning) {
  if (!absl::StrContains(GetParam(), "--busy_between_steps")) {
    GTEST_SKIP() << "only with --busy_between_steps";
  }
  std::unique_ptr<SchedulerProcess> p = Start(std::string(32, 'a'));
  ASSERT_NE(p, nullptr);
  for (uint64_t step = 1; step <= 3; ++step) {
    if (step > 1) absl::SleepFor(absl::Milliseconds(300));
    EXPECT_EQ(p->Send(step).code(), absl::StatusCode::kUnauthenticated);
  }
  absl::StatusOr<double> cpu = p->Finish();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_GT(*cpu, 0.0);
  EXPECT_LT(*cpu, 100000.0);
}

// --api=ring: the ring opens on the scheduler's own companion connection
// and its steps reach the Step service as the ring's session (the CPU
// daemon has no registration 999, so nothing can be granted: the answer
// is the registry's about that registration).
TEST(StepSchedulerRingTest, StepsReachTheStepServiceThroughARing) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
      DaemonProcess::Start({"--backend=cpu", "--log_level=warn"});
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string request = ::testing::TempDir() + "/ring_request.bin";
  v1::StepRequest r;
  r.set_session_id(std::string(32, 'a'));  // cleared: the ring's session
  r.set_registration_id(999);
  r.set_num_tokens(2);
  r.set_slot_mapping(std::string(8, '\0'));
  std::ofstream(request, std::ios::binary) << r.SerializeAsString();
  absl::StatusOr<std::unique_ptr<SchedulerProcess>> p = SchedulerProcess::Start(
      {"tests/gpu/step_scheduler", "--socket=" + (*d)->socket_path(),
       "--request=" + request, "--api=ring", "--ring_grant=false"});
  ASSERT_TRUE(p.ok()) << p.status();
  for (uint64_t step = 1; step <= 3; ++step) {
    const absl::Status s = (*p)->Send(step);
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "999")) << s;
  }
  absl::StatusOr<double> cpu = (*p)->Finish();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_GT(*cpu, 0.0);
}

INSTANTIATE_TEST_SUITE_P(
    Apis, StepSchedulerTest,
    ::testing::Values("--api=sync", "--api=callback", "--api=stream",
                      "--api=stream_spin",
                      "--api=stream --busy_between_steps"));

// Answers the first `refusals` calls with the daemon's "two steps in flight"
// refusal (or `code`), every later one OK; records the step ids it saw.
class FakeStepService final : public v1::Step::Service {
 public:
  FakeStepService(int refusals, grpc::StatusCode code)
      : refusals_(refusals), code_(code) {}
  grpc::Status Step(grpc::ServerContext*, const v1::StepRequest* request,
                    v1::StepResponse* reply) override {
    absl::MutexLock lock(&mu_);
    seen_.push_back(request->step_id());
    if (refusals_ < 0 || static_cast<int>(seen_.size()) <= refusals_) {
      return grpc::Status(
          code_, "step_id " + std::to_string(request->step_id()) +
                     ": 2 steps of registration 999 are in flight already; "
                     "send it again when one finished");
    }
    reply->set_step_id(request->step_id());
    reply->set_queued(2);
    return grpc::Status::OK;
  }
  // The same answers as a stream: each refusal is its message's reply.
  grpc::Status StepStream(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream)
      override {
    v1::StepRequest request;
    while (stream->Read(&request)) {
      v1::StepResponse reply;
      const grpc::Status s = Step(ctx, &request, &reply);
      if (!s.ok()) {
        reply.set_error_code(s.error_code());
        reply.set_error_message(s.error_message());
      }
      if (!stream->Write(reply)) break;
    }
    return grpc::Status::OK;
  }
  std::vector<uint64_t> seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

 private:
  const int refusals_;  // -1: every call
  const grpc::StatusCode code_;
  absl::Mutex mu_;
  std::vector<uint64_t> seen_ ABSL_GUARDED_BY(mu_);
};

class StepSchedulerRetryTest : public ::testing::TestWithParam<const char*> {
 protected:
  void Serve(int refusals, grpc::StatusCode code) {
    service_ = std::make_unique<FakeStepService>(refusals, code);
    socket_ = FreshSocketPath();
    grpc::ServerBuilder b;
    b.AddListeningPort("unix:" + socket_, grpc::InsecureServerCredentials());
    b.RegisterService(service_.get());
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
    unlink(socket_.c_str());
    rmdir(socket_.substr(0, socket_.rfind('/')).c_str());
  }
  std::unique_ptr<SchedulerProcess> Start(int retry_ms) {
    const std::string request = ::testing::TempDir() + "/retry_request.bin";
    v1::StepRequest r;
    r.set_session_id(std::string(32, 'a'));
    r.set_registration_id(999);
    r.set_num_tokens(2);
    r.set_slot_mapping(std::string(8, '\0'));
    std::ofstream(request, std::ios::binary) << r.SerializeAsString();
    absl::StatusOr<std::unique_ptr<SchedulerProcess>> p =
        SchedulerProcess::Start(
            {"tests/gpu/step_scheduler", "--socket=" + socket_,
             "--request=" + request, GetParam(),
             "--in_flight_retry_ms=" + std::to_string(retry_ms)});
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *std::move(p) : nullptr;
  }
  std::unique_ptr<FakeStepService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string socket_;
};

TEST_P(StepSchedulerRetryTest, ARefusedStepIsSentAgainUntilAccepted) {
  Serve(3, grpc::StatusCode::RESOURCE_EXHAUSTED);
  std::unique_ptr<SchedulerProcess> p = Start(10000);
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(p->Send(7).ok());
  EXPECT_TRUE(p->Send(8).ok());  // accepted at once
  ASSERT_TRUE(p->Finish().ok());
  EXPECT_EQ(p->retries(), 3);
  // The same step id again (a refusal consumes none), then the next.
  EXPECT_EQ(service_->seen(), (std::vector<uint64_t>{7, 7, 7, 7, 8}));
}

TEST_P(StepSchedulerRetryTest, ARefusalThatLastsEndsAfterTheBudget) {
  Serve(-1, grpc::StatusCode::RESOURCE_EXHAUSTED);
  std::unique_ptr<SchedulerProcess> p = Start(50);
  ASSERT_NE(p, nullptr);
  const absl::Status s = p->Send(1);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "in flight already")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "still refused after")) << s;
  ASSERT_TRUE(p->Finish().ok());
  EXPECT_GE(p->retries(), 1);
  EXPECT_EQ(service_->seen().size(), p->retries() + 1u);
}

TEST_P(StepSchedulerRetryTest, OtherCodesAreNotSentAgain) {
  Serve(-1, grpc::StatusCode::INVALID_ARGUMENT);
  std::unique_ptr<SchedulerProcess> p = Start(10000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->Send(1).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(p->Finish().ok());
  EXPECT_EQ(p->retries(), 0);
  EXPECT_EQ(service_->seen().size(), 1u);
}

INSTANTIATE_TEST_SUITE_P(Apis, StepSchedulerRetryTest,
                         ::testing::Values("--api=sync", "--api=callback",
                                           "--api=stream",
                                           "--api=stream_spin"));

}  // namespace
}  // namespace kvdepot::testing
