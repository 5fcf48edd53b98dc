// kvd_worker_open refuses to run in an environment where a stream parked
// on a doorbell would hang the worker (GPU_HOST.md, SPEC §10): before any
// CUDA call, so this needs no GPU, only the CUDA-built library. Each
// refusal is KVD_ERR_ENVIRONMENT naming the variable, with *out NULL; a
// right environment gets past the check to the argument checks.
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/kvdepot_worker.h"

namespace {

using ::testing::HasSubstr;

// kvd_worker_open with arguments that would fail the later checks
// (num_layers 0): an environment refusal comes first.
int Open(kvd_worker** out) {
  return kvd_worker_open(/*fd=*/-1, /*fd_size=*/1 << 20, /*device=*/0,
                         /*num_layers=*/0, /*watchdog_ms=*/1000, out);
}

TEST(WorkerEnvironmentTest, RefusesLazyOrMissingModuleLoading) {
  for (const char* value :
       std::initializer_list<const char*>{"LAZY", "eager", "", nullptr}) {
    SCOPED_TRACE(value == nullptr ? "unset" : value);
    if (value == nullptr) {
      unsetenv("CUDA_MODULE_LOADING");
    } else {
      setenv("CUDA_MODULE_LOADING", value, 1);
    }
    unsetenv("CUDA_DEVICE_MAX_CONNECTIONS");
    kvd_worker* w = reinterpret_cast<kvd_worker*>(0x1);
    EXPECT_EQ(Open(&w), KVD_ERR_ENVIRONMENT);
    EXPECT_EQ(w, nullptr);
    EXPECT_THAT(kvd_last_error(), HasSubstr("CUDA_MODULE_LOADING"));
  }
}

TEST(WorkerEnvironmentTest, RefusesFewerThanEightConnections) {
  setenv("CUDA_MODULE_LOADING", "EAGER", 1);
  for (const char* value : {"7", "1", "0", "-8", "8x", ""}) {
    SCOPED_TRACE(value);
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", value, 1);
    kvd_worker* w = nullptr;
    EXPECT_EQ(Open(&w), KVD_ERR_ENVIRONMENT);
    EXPECT_EQ(w, nullptr);
    EXPECT_THAT(kvd_last_error(), HasSubstr("CUDA_DEVICE_MAX_CONNECTIONS"));
  }
}

TEST(WorkerEnvironmentTest, TheRightEnvironmentGetsToTheArgumentChecks) {
  setenv("CUDA_MODULE_LOADING", "EAGER", 1);
  for (const char* value :
       std::initializer_list<const char*>{"8", "32", nullptr}) {
    SCOPED_TRACE(value == nullptr ? "unset" : value);
    if (value == nullptr) {
      unsetenv("CUDA_DEVICE_MAX_CONNECTIONS");
    } else {
      setenv("CUDA_DEVICE_MAX_CONNECTIONS", value, 1);
    }
    kvd_worker* w = nullptr;
    EXPECT_EQ(Open(&w), KVD_ERR_INVALID);
    EXPECT_THAT(kvd_last_error(), HasSubstr("num_layers = 0"));
  }
}

}  // namespace
