// The fixture of the GPU end-to-end tests: one kvdepotd --backend=cuda
// child process for the whole test binary (started by a gtest environment,
// stopped with SIGTERM at the end, its exit code checked), a client
// connected to it and a stream of this process.
#ifndef KVDEPOT_TESTS_GPU_GPU_FIXTURE_H_
#define KVDEPOT_TESTS_GPU_GPU_FIXTURE_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "client/kvdepot_client.h"
#include "gtest/gtest.h"
#include "tests/gpu/gpu_test_util.h"

namespace kvdepot::testing {

#define ASSERT_OK(expr)                          \
  do {                                           \
    const absl::Status s_ = (expr);              \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (false)

// The daemon's socket; empty when it did not start (the failure is
// reported by the environment).
const std::string& DaemonSocket();

class GpuTest : public ::testing::Test {
 protected:
  // Fails (never skips) without a CUDA device: the test is tagged "gpu"
  // and runs only where one must be.
  void SetUp() override;

  int device_count_ = 0;
  std::unique_ptr<KVCacheClient> client_;
  std::optional<Stream> stream_;
};

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_GPU_GPU_FIXTURE_H_
