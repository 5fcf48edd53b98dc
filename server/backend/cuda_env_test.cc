#include "server/backend/cuda_env.h"

#include <cstdlib>

#include "gtest/gtest.h"

namespace kvdepot {
namespace {

class CudaEnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv("CUDA_MODULE_LOADING");
    unsetenv("CUDA_DEVICE_MAX_CONNECTIONS");
  }
};

TEST_F(CudaEnvTest, PrepareSetsEagerWhenUnset) {
  EXPECT_FALSE(CheckCudaEnvironment().ok());
  ASSERT_TRUE(PrepareCudaEnvironment().ok());
  ASSERT_NE(std::getenv("CUDA_MODULE_LOADING"), nullptr);
  EXPECT_STREQ(std::getenv("CUDA_MODULE_LOADING"), "EAGER");
  EXPECT_TRUE(CheckCudaEnvironment().ok());
}

TEST_F(CudaEnvTest, LazyIsRefusedNotOverridden) {
  setenv("CUDA_MODULE_LOADING", "LAZY", 1);
  const absl::Status s = PrepareCudaEnvironment();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("CUDA_MODULE_LOADING = \"LAZY\""),
            absl::string_view::npos)
      << s;
  EXPECT_STREQ(std::getenv("CUDA_MODULE_LOADING"), "LAZY");
}

TEST_F(CudaEnvTest, TooFewConnectionsAreRefused) {
  setenv("CUDA_MODULE_LOADING", "EAGER", 1);
  for (const char* bad : {"1", "2", "7", "0", "-8", "eight", ""}) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", bad, 1);
    const absl::Status s = PrepareCudaEnvironment();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << bad;
    EXPECT_NE(s.message().find("CUDA_DEVICE_MAX_CONNECTIONS"),
              absl::string_view::npos)
        << s;
  }
  for (const char* good : {"8", "32"}) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", good, 1);
    EXPECT_TRUE(PrepareCudaEnvironment().ok()) << good;
  }
}

}  // namespace
}  // namespace kvdepot
