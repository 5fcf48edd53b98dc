#include "tests/gpu/step_daemon_env.h"

#include <cuda_runtime_api.h>
#include <signal.h>

#include <utility>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tests/gpu/gpu_test_util.h"

namespace kvdepot::testing {

absl::StatusOr<std::unique_ptr<DaemonProcess>> StartStepDaemon() {
  return DaemonProcess::Start({"--backend=cuda", "--log_level=warn"},
                              DaemonBinary());
}

void StepDaemonEnv::SetUp() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return;
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = StartStepDaemon();
  if (!d.ok()) {
    ADD_FAILURE() << "starting kvdepotd --backend=cuda: " << d.status();
    return;
  }
  daemon_ = *std::move(d);
}

void StepDaemonEnv::TearDown() {
  if (daemon_ == nullptr) return;
  absl::StatusOr<int> code = daemon_->Signal(SIGTERM, absl::Seconds(60));
  EXPECT_TRUE(code.ok()) << "stopping the daemon: " << code.status();
  if (code.ok()) {
    EXPECT_EQ(*code, 0) << "the daemon's exit code";
  }
  daemon_.reset();
}

StepDaemonEnv* AddStepDaemonEnv() {
  return static_cast<StepDaemonEnv*>(
      ::testing::AddGlobalTestEnvironment(new StepDaemonEnv));
}

}  // namespace kvdepot::testing
