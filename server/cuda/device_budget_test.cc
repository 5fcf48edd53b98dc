#include "server/cuda/device_budget.h"

#include <memory>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

TEST(DeviceBudgetTest, AdmitsUpToFreeMinusReserveAndGivesBack) {
  auto budget = std::make_shared<DeviceBudget>();
  budget->SetDevice(0, /*free_at_start=*/1000, /*reserve=*/200);
  EXPECT_EQ(budget->total(0), 800);
  absl::StatusOr<std::shared_ptr<void>> a = budget->Reserve(0, 500);
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<std::shared_ptr<void>> b = budget->Reserve(0, 301);
  ASSERT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(b.status().message()),
              HasSubstr("cuda:0 has 300 bytes available"));
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("needs 301"));
  EXPECT_EQ(budget->used(0), 500) << "a refused request takes nothing";
  absl::StatusOr<std::shared_ptr<void>> c = budget->Reserve(0, 300);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(budget->used(0), 800);
  a->reset();
  EXPECT_EQ(budget->used(0), 300);
  c->reset();
  EXPECT_EQ(budget->used(0), 0);
}

TEST(DeviceBudgetTest, ReserveLargerThanFreeLeavesNothing) {
  auto budget = std::make_shared<DeviceBudget>();
  budget->SetDevice(1, 100, 1000);
  EXPECT_EQ(budget->total(1), 0);
  EXPECT_EQ(budget->Reserve(1, 1).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(DeviceBudgetTest, RejectsNonPositiveSizesAndSkipsUnknownDevices) {
  auto budget = std::make_shared<DeviceBudget>();
  budget->SetDevice(0, 100, 0);
  EXPECT_EQ(budget->Reserve(0, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(budget->Reserve(0, -5).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::shared_ptr<void>> t = budget->Reserve(3, 1 << 20);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*t, nullptr);
  EXPECT_EQ(budget->used(0), 0);
}

TEST(DeviceBudgetTest, TokensOutliveTheBudgetSafely) {
  std::shared_ptr<void> token;
  {
    auto budget = std::make_shared<DeviceBudget>();
    budget->SetDevice(0, 100, 0);
    absl::StatusOr<std::shared_ptr<void>> t = budget->Reserve(0, 10);
    ASSERT_TRUE(t.ok());
    token = *t;
  }
  token.reset();  // must not touch the destroyed budget
  SUCCEED();
}

}  // namespace
}  // namespace kvdepot
