#include "server/backend/inline_call.h"

#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

TEST(InlineCallTest, OnlyAnInlineCallMayNotWaitAndDefers) {
  EXPECT_TRUE(MayWait());
  EXPECT_FALSE(InlineCallDeferred());
  {
    InlineCall call;
    EXPECT_FALSE(MayWait());
    EXPECT_FALSE(call.deferred());
    EXPECT_FALSE(InlineCallDeferred());
    const absl::Status s = DeferInlineCall("the pool's lock is held");
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(s.message(), HasSubstr("the pool's lock is held"));
    EXPECT_TRUE(call.deferred());
    EXPECT_TRUE(InlineCallDeferred());
    // Another thread is not inline.
    bool other_may_wait = false;
    std::thread([&] { other_may_wait = MayWait(); }).join();
    EXPECT_TRUE(other_may_wait);
  }
  // The scope ended: this thread may wait again, and a new call starts
  // undeferred.
  EXPECT_TRUE(MayWait());
  EXPECT_FALSE(InlineCallDeferred());
  InlineCall next;
  EXPECT_FALSE(next.deferred());
}

TEST(InlineCallTest, DeferringOutsideAnInlineCallIsAnInternalError) {
  const absl::Status s = DeferInlineCall("staging");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("not inline"));
  EXPECT_FALSE(InlineCallDeferred());
}

}  // namespace
}  // namespace kvdepot
