#include "server/client_slots.h"

#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace kvdepot {
namespace {

TEST(ClientSlotsTest, BoundsEachClientSeparatelyAndGivesBackOnDestruction) {
  ClientSlots slots(2, Limit::kVerifyStreamsPerClient);
  std::vector<ClientSlots::Slot> held;
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<ClientSlots::Slot> s = slots.Acquire("uid 1", "Verify");
    ASSERT_TRUE(s.ok()) << s.status();
    held.push_back(*std::move(s));
  }
  absl::StatusOr<ClientSlots::Slot> third = slots.Acquire("uid 1", "Verify");
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(LimitOf(third.status()), Limit::kVerifyStreamsPerClient);
  EXPECT_NE(third.status().message().find("verify_streams_per_client = 2"),
            absl::string_view::npos)
      << third.status();
  // Another client is not affected.
  absl::StatusOr<ClientSlots::Slot> other = slots.Acquire("uid 2", "Verify");
  EXPECT_TRUE(other.ok());
  EXPECT_EQ(slots.InUse("uid 1"), 2);
  // A moved slot is held once; destroying it gives it back.
  ClientSlots::Slot moved = std::move(held[0]);
  held.clear();
  EXPECT_EQ(slots.InUse("uid 1"), 1);
  moved = ClientSlots::Slot();
  EXPECT_EQ(slots.InUse("uid 1"), 0);
  EXPECT_TRUE(slots.Acquire("uid 1", "Verify").ok());
}

TEST(ClientSlotsTest, ZeroMeansNoLimit) {
  ClientSlots slots(0, Limit::kVerifyStreamsPerClient);
  std::vector<ClientSlots::Slot> held;
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<ClientSlots::Slot> s = slots.Acquire("c", "Verify");
    ASSERT_TRUE(s.ok());
    held.push_back(*std::move(s));
  }
  EXPECT_EQ(slots.InUse("c"), 100);
}

}  // namespace
}  // namespace kvdepot
