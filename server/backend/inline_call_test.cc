#include "server/backend/inline_call.h"

#include <atomic>
#include <memory>
#include <thread>

#include "absl/synchronization/notification.h"
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

TEST(InlineCallTest, ReleasesRunHereOrOffTheInlineThread) {
  std::thread::id ran_on;
  RunOffInline([&] { ran_on = std::this_thread::get_id(); });
  EXPECT_EQ(ran_on, std::this_thread::get_id()) << "outside: at once, here";

  absl::Notification may_finish;
  std::atomic<int> order{0};
  int first = 0, second = 0;
  {
    InlineCall call;
    // Inline: posted, in order, and this thread does not wait for them.
    RunOffInline([&] {
      may_finish.WaitForNotification();
      first = ++order;
      ran_on = std::this_thread::get_id();
    });
    RunOffInline([&] { second = ++order; });
    EXPECT_EQ(order.load(), 0);
  }
  may_finish.Notify();
  WaitForReleases();
  EXPECT_EQ(first, 1);
  EXPECT_EQ(second, 2);
  EXPECT_NE(ran_on, std::this_thread::get_id());
}

// The last reference dropped in an inline call: the object is deleted off
// the thread (a CUDA allocation's destructor waits for its work).
TEST(InlineCallTest, LastReferenceDroppedInlineIsDeletedElsewhere) {
  struct Probe {
    std::thread::id* deleted_on;
    ~Probe() { *deleted_on = std::this_thread::get_id(); }
  };
  auto deleter = [](bool may_wait) {
    return [may_wait](Probe* p) { DeleteOffInline(p, may_wait); };
  };
  std::thread::id deleted_on;
  {
    std::shared_ptr<Probe> p(new Probe{&deleted_on}, deleter(true));
    InlineCall call;
    p.reset();
  }
  WaitForReleases();
  EXPECT_NE(deleted_on, std::thread::id());
  EXPECT_NE(deleted_on, std::this_thread::get_id());
  // Outside an inline call, or a release that cannot wait: here, at once.
  std::shared_ptr<Probe> q(new Probe{&deleted_on}, deleter(true));
  q.reset();
  EXPECT_EQ(deleted_on, std::this_thread::get_id());
  deleted_on = std::thread::id();
  {
    std::shared_ptr<Probe> r(new Probe{&deleted_on}, deleter(false));
    InlineCall call;
    r.reset();
  }
  EXPECT_EQ(deleted_on, std::this_thread::get_id());
}

}  // namespace
}  // namespace kvdepot
