#include "server/descriptors.h"

#include <sys/resource.h>

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "server/limits.h"

namespace kvdepot {
namespace {

TEST(DescriptorBudgetTest, AdmitsUpToTheLimitAndTakesBackOnRelease) {
  std::shared_ptr<DescriptorBudget> budget = DescriptorBudget::Create(3);
  std::vector<DescriptorLease> leases;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<DescriptorLease> l = budget->Acquire("allocate_buffer.size");
    ASSERT_TRUE(l.ok()) << l.status();
    leases.push_back(*std::move(l));
  }
  EXPECT_EQ(budget->held(), 3);
  absl::StatusOr<DescriptorLease> over =
      budget->Acquire("allocate_buffer.size");
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(LimitOf(over.status()), Limit::kDescriptors);
  EXPECT_NE(over.status().message().find("allocate_buffer.size: the daemon "
                                         "already holds 3 descriptors"),
            absl::string_view::npos)
      << over.status();
  EXPECT_NE(over.status().message().find("--max_descriptors = 3"),
            absl::string_view::npos);
  EXPECT_EQ(budget->held(), 3);  // a refusal holds nothing

  leases.pop_back();
  EXPECT_EQ(budget->held(), 2);
  EXPECT_TRUE(budget->Acquire("import_buffer.fd").ok());  // and dropped again
  EXPECT_EQ(budget->held(), 2);
}

TEST(DescriptorBudgetTest, MovedLeasesReleaseOnce) {
  std::shared_ptr<DescriptorBudget> budget = DescriptorBudget::Create(2);
  {
    absl::StatusOr<DescriptorLease> a = budget->Acquire("f");
    ASSERT_TRUE(a.ok());
    DescriptorLease moved = *std::move(a);
    DescriptorLease assigned;
    assigned = std::move(moved);
    EXPECT_EQ(budget->held(), 1);
    absl::StatusOr<DescriptorLease> b = budget->Acquire("f");
    ASSERT_TRUE(b.ok());
    assigned = *std::move(b);  // gives the first back
    EXPECT_EQ(budget->held(), 1);
  }
  EXPECT_EQ(budget->held(), 0);
}

TEST(DescriptorBudgetTest, ALeaseOutlivesTheBudgetsOtherOwners) {
  std::optional<DescriptorLease> lease;
  {
    std::shared_ptr<DescriptorBudget> budget = DescriptorBudget::Create(1);
    absl::StatusOr<DescriptorLease> l = budget->Acquire("f");
    ASSERT_TRUE(l.ok());
    lease.emplace(*std::move(l));
  }
  lease.reset();  // releases into a budget only the lease kept alive
}

TEST(DescriptorBudgetTest, ZeroAndNegativeLimitsAdmitNothing) {
  EXPECT_EQ(DescriptorBudget::Create(0)->Acquire("f").status().code(),
            absl::StatusCode::kResourceExhausted);
  std::shared_ptr<DescriptorBudget> negative = DescriptorBudget::Create(-5);
  EXPECT_EQ(negative->limit(), 0);
  EXPECT_FALSE(negative->Acquire("f").ok());
}

TEST(DescriptorBudgetTest, DefaultKeepsAQuarterBetween512And8192) {
  EXPECT_EQ(DefaultDescriptorBudget(1024), 512);     // reserve 512 (floor)
  EXPECT_EQ(DefaultDescriptorBudget(4096), 3072);    // a quarter
  EXPECT_EQ(DefaultDescriptorBudget(65536), 57344);  // 8192 (ceiling)
  EXPECT_EQ(DefaultDescriptorBudget(1 << 20), (1 << 20) - 8192);
  EXPECT_EQ(DefaultDescriptorBudget(256), 0);  // nothing left
}

TEST(DescriptorLimitTest, RaisesTheSoftLimitToTheHardOne) {
  rlimit before{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &before), 0);
  // Lower the soft limit (allowed without privileges) and raise it back.
  rlimit lowered = before;
  lowered.rlim_cur = std::min<rlim_t>(before.rlim_max, 256);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);
  absl::StatusOr<DescriptorLimit> l = RaiseDescriptorLimit();
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->soft_before, static_cast<int64_t>(lowered.rlim_cur));
  rlimit now{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &now), 0);
  EXPECT_EQ(static_cast<int64_t>(now.rlim_cur), l->soft);
  EXPECT_EQ(l->soft, l->hard);
  if (before.rlim_max != RLIM_INFINITY) {
    EXPECT_EQ(l->hard, static_cast<int64_t>(before.rlim_max));
  }
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &before), 0);
}

}  // namespace
}  // namespace kvdepot
