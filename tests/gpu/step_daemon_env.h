// The kvdepotd (CUDA backend) that a step-path test binary shares: started
// once before the tests when a GPU is present, stopped with SIGTERM after
// them (its exit code must be 0). StartStepDaemon starts one the same way
// for tests that need their own (step_fault_test kills daemons).
#ifndef KVDEPOT_TESTS_GPU_STEP_DAEMON_ENV_H_
#define KVDEPOT_TESTS_GPU_STEP_DAEMON_ENV_H_

#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "tests/daemon_process.h"
#include "tests/gpu/gpu_test_util.h"

// The step tests' assertion on an absl::Status expression.
#define ASSERT_OK(expr)                          \
  do {                                           \
    const absl::Status s_ = (expr);              \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (false)

namespace kvdepot::testing {

// kvdepotd --backend=cuda --log_level=warn (DaemonBinary()).
absl::StatusOr<std::unique_ptr<DaemonProcess>> StartStepDaemon();

class StepDaemonEnv : public ::testing::Environment {
 public:
  void SetUp() override;
  void TearDown() override;
  // Null when there is no GPU or the daemon did not start.
  DaemonProcess* daemon() const { return daemon_.get(); }

 private:
  std::unique_ptr<DaemonProcess> daemon_;
};

// Registers a StepDaemonEnv with gtest (owned by gtest) and returns it.
StepDaemonEnv* AddStepDaemonEnv();

// What a test on the shared daemon checks first: a CUDA device, `env`'s
// daemon up, device 0 current; then a fresh stream in *stream.
absl::Status PrepareStepTest(const StepDaemonEnv* env,
                             std::optional<Stream>* stream);

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_GPU_STEP_DAEMON_ENV_H_
