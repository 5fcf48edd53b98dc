#include "tests/gpu/step_daemon_env.h"

#include <cuda_runtime_api.h>
#include <signal.h>

#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
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

absl::Status PrepareStepTest(const StepDaemonEnv* env,
                             std::optional<Stream>* stream) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this test needs a CUDA device (", cudaGetErrorString(e), ")"));
  }
  if (env->daemon() == nullptr) {
    return absl::FailedPreconditionError("the daemon did not start");
  }
  RETURN_IF_ERROR(Cuda(cudaSetDevice(0), "cudaSetDevice(0)"));
  ASSIGN_OR_RETURN(Stream s, Stream::Create());
  stream->emplace(std::move(s));
  return absl::OkStatus();
}

StepDaemonEnv* AddStepDaemonEnv() {
  return static_cast<StepDaemonEnv*>(
      ::testing::AddGlobalTestEnvironment(new StepDaemonEnv));
}

}  // namespace kvdepot::testing
