#include "server/reply_scope.h"

#include <vector>

#include "gtest/gtest.h"
#include "server/limits.h"

namespace kvdepot {
namespace {

TEST(ReplyScopeTest, WithoutAScopeEverythingIsAdmittedAndNothingHeld) {
  MemoryBudget budget(100, 0, "--max_reply_bytes", ReplyBudgetNames());
  EXPECT_TRUE(ReplyScope::Reserve("uid 1", 1000, "data").ok());
  EXPECT_EQ(budget.used(), 0);
  ReplyScope unbudgeted(nullptr);
  EXPECT_TRUE(ReplyScope::Reserve("uid 1", 1000, "data").ok());
}

TEST(ReplyScopeTest, ReservationsLiveUntilTakenOnesAreDropped) {
  MemoryBudget budget(100, 60, "--max_reply_bytes", ReplyBudgetNames());
  std::vector<MemoryReservation> taken;
  {
    ReplyScope scope(&budget);
    ASSERT_TRUE(ReplyScope::Reserve("uid 1", 50, "data").ok());
    EXPECT_EQ(budget.used_by("uid 1"), 50);
    const absl::Status per_client = ReplyScope::Reserve("uid 1", 20, "scales");
    EXPECT_EQ(LimitOf(per_client), Limit::kReplyBytesPerClient) << per_client;
    EXPECT_NE(per_client.message().find("scales"), std::string::npos);
    EXPECT_NE(per_client.message().find("budget for replies not yet sent"),
              std::string::npos)
        << per_client;
    ASSERT_TRUE(ReplyScope::Reserve("uid 2", 40, "data").ok());
    const absl::Status total = ReplyScope::Reserve("uid 3", 20, "index");
    EXPECT_EQ(LimitOf(total), Limit::kReplyBytes) << total;
    taken = scope.Take();
    ASSERT_TRUE(ReplyScope::Reserve("uid 3", 5, "slots").ok());
    EXPECT_EQ(budget.used(), 95);
  }
  // The scope gave back what was not taken; the taken ones still hold.
  EXPECT_EQ(budget.used(), 90);
  taken.clear();
  EXPECT_EQ(budget.used(), 0);
}

TEST(ReplyScopeTest, ScopesNestAndTheOuterOneComesBack) {
  MemoryBudget outer_budget(100, 0, "a", ReplyBudgetNames());
  MemoryBudget inner_budget(100, 0, "b", ReplyBudgetNames());
  ReplyScope outer(&outer_budget);
  {
    ReplyScope inner(&inner_budget);
    ASSERT_TRUE(ReplyScope::Reserve("c", 10, "x").ok());
    EXPECT_EQ(inner_budget.used(), 10);
    EXPECT_EQ(outer_budget.used(), 0);
  }
  EXPECT_EQ(inner_budget.used(), 0);
  ASSERT_TRUE(ReplyScope::Reserve("c", 7, "x").ok());
  EXPECT_EQ(outer_budget.used(), 7);
}

}  // namespace
}  // namespace kvdepot
