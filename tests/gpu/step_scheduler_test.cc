// step_scheduler (step_benchmark's scheduler process) against a CPU
// kvdepotd, no GPU: the pipe protocol, the session travelling in the
// request, the daemon's status codes coming back, the CPU report.
#include <unistd.h>

#include <fstream>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "client/kvdepot_client.h"
#include "gtest/gtest.h"
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
    absl::StatusOr<std::unique_ptr<SchedulerProcess>> p =
        SchedulerProcess::Start({"tests/gpu/step_scheduler",
                                 "--socket=" + daemon_->socket_path(),
                                 "--request=" + request_, GetParam()});
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

INSTANTIATE_TEST_SUITE_P(Apis, StepSchedulerTest,
                         ::testing::Values("--api=sync", "--api=callback"));

}  // namespace
}  // namespace kvdepot::testing
