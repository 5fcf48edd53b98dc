#include "server/cuda/devices.h"

#include <cstdint>
#include <limits>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

TEST(ParseCudaDeviceTest, AcceptsDefaultAndOrdinals) {
  EXPECT_EQ(*ParseCudaDevice("device", "", 1), 0);
  EXPECT_EQ(*ParseCudaDevice("device", "cuda", 3), 0);
  EXPECT_EQ(*ParseCudaDevice("device", "cuda:0", 1), 0);
  EXPECT_EQ(*ParseCudaDevice("device", "cuda:7", 8), 7);
  EXPECT_EQ(*ParseCudaDevice("device", "cuda:12", 13), 12);
}

TEST(ParseCudaDeviceTest, RejectsOrdinalOutsideTheVisibleDevices) {
  absl::StatusOr<int> r = ParseCudaDevice("device", "cuda:2", 2);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("device = \"cuda:2\""));
  EXPECT_THAT(r.status().message(), HasSubstr("outside [0, 2)"));
}

TEST(ParseCudaDeviceTest, RejectsMalformedStrings) {
  for (const char* bad :
       {"cpu", "cuda:", "cuda:-1", "cuda:+1", "cuda:1x", "CUDA:0", " cuda:0",
        "cuda:0 ", "gpu:0", "cuda:9999999999", "cuda0"}) {
    absl::StatusOr<int> r = ParseCudaDevice("pools[3].device", bad, 4);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(r.status().message(),
                HasSubstr("pools[3].device = \"" + std::string(bad) + "\""));
    EXPECT_THAT(r.status().message(), HasSubstr("is not \"cuda:N\""));
  }
}

TEST(ParseCudaDeviceTest, NoDeviceIsAPreconditionFailure) {
  absl::StatusOr<int> r = ParseCudaDevice("device", "", 0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("no CUDA device"));
}

TEST(CudaDeviceNameTest, Formats) {
  EXPECT_EQ(CudaDeviceName(0), "cuda:0");
  EXPECT_EQ(CudaDeviceName(13), "cuda:13");
}

TEST(RoundUpAllocationTest, RoundsToTwoMiB) {
  constexpr int64_t g = int64_t{2} << 20;
  EXPECT_EQ(kCudaAllocationGranularity, g);
  EXPECT_EQ(*RoundUpAllocation(1), g);
  EXPECT_EQ(*RoundUpAllocation(133), g);
  EXPECT_EQ(*RoundUpAllocation(g - 1), g);
  EXPECT_EQ(*RoundUpAllocation(g), g);
  EXPECT_EQ(*RoundUpAllocation(g + 1), 2 * g);
  // Beyond 4 GiB: 64-bit all the way.
  EXPECT_EQ(*RoundUpAllocation((int64_t{5} << 30) + 7), (int64_t{5} << 30) + g);
}

TEST(RoundUpAllocationTest, RejectsNonPositiveAndOverflowingSizes) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  for (int64_t bad : {int64_t{0}, int64_t{-1}, kMax, kMax - 1000}) {
    absl::StatusOr<int64_t> r = RoundUpAllocation(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(
        r.status().message(),
        HasSubstr("size = " + std::to_string(bad) + " is outside [1, "));
  }
  // The largest size that still rounds without overflow.
  const int64_t largest = kMax - (kCudaAllocationGranularity - 1);
  EXPECT_TRUE(RoundUpAllocation(largest).ok());
  EXPECT_FALSE(RoundUpAllocation(largest + 1).ok());
}

}  // namespace
}  // namespace kvdepot
