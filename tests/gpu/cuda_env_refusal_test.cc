// kvdepotd --backend=cuda refuses to start in an environment where a
// stalled stream would hang or deadlock the daemon (GPU_HOST.md):
// CUDA_MODULE_LOADING other than EAGER, CUDA_DEVICE_MAX_CONNECTIONS < 8.
// The check comes before the first CUDA call, so this runs on any machine
// (no GPU needed); an unset CUDA_MODULE_LOADING is set to EAGER by the
// daemon itself (the other GPU tests start it that way).
#include <unistd.h>

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/daemon_process.h"
#include "tests/gpu/gpu_test_util.h"

namespace kvdepot::testing {
namespace {

using ::testing::HasSubstr;

// Runs the daemon under `env` (NAME=VALUE entries); its exit code and
// everything it printed.
std::pair<int, std::string> RunDaemon(const std::vector<std::string>& env) {
  std::vector<std::string> argv = {"/usr/bin/env"};
  argv.insert(argv.end(), env.begin(), env.end());
  argv.insert(argv.end(), {DaemonBinary(), "--backend=cuda",
                           "--listen=" + FreshSocketPath()});
  int out = -1;
  absl::StatusOr<pid_t> pid = Spawn(argv, &out, /*with_stderr=*/true);
  if (!pid.ok()) return {-1, pid.status().ToString()};
  std::string text;
  char buf[4096];
  ssize_t n;
  while ((n = read(out, buf, sizeof(buf))) > 0) text.append(buf, n);
  close(out);
  absl::StatusOr<int> code = WaitForExit(*pid, absl::Seconds(60));
  return {code.ok() ? *code : -1, text};
}

TEST(CudaEnvRefusalTest, LazyModuleLoadingIsRefused) {
  auto [code, text] = RunDaemon({"CUDA_MODULE_LOADING=LAZY"});
  EXPECT_NE(code, 0) << text;
  EXPECT_THAT(text, HasSubstr("CUDA_MODULE_LOADING = \"LAZY\""));
  EXPECT_THAT(text, HasSubstr("EAGER"));
}

TEST(CudaEnvRefusalTest, FewerThanEightConnectionsAreRefused) {
  for (const char* n : {"1", "2", "7"}) {
    auto [code, text] =
        RunDaemon({"CUDA_MODULE_LOADING=EAGER",
                   std::string("CUDA_DEVICE_MAX_CONNECTIONS=") + n});
    EXPECT_NE(code, 0) << n << ": " << text;
    EXPECT_THAT(text, HasSubstr("CUDA_DEVICE_MAX_CONNECTIONS"));
    EXPECT_THAT(text, HasSubstr("at least 8"));
  }
}

}  // namespace
}  // namespace kvdepot::testing
