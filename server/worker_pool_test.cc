#include "server/worker_pool.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

TEST(WorkerPoolTest, RunsEveryTaskSubmitted) {
  std::atomic<int> sum{0};
  {
    WorkerPool pool("test", 3, 100);
    for (int i = 1; i <= 100; ++i) {
      ASSERT_TRUE(pool.TrySubmit([&sum, i] { sum.fetch_add(i); }));
    }
  }  // the destructor runs what is queued
  EXPECT_EQ(sum.load(), 5050);
}

TEST(WorkerPoolTest, RefusesBeyondTheQueueBound) {
  WorkerPool pool("test", 1, 2);
  absl::Notification started, release;
  ASSERT_TRUE(pool.TrySubmit([&] {
    started.Notify();
    release.WaitForNotification();
  }));
  ASSERT_TRUE(started.WaitForNotificationWithTimeout(absl::Seconds(30)));
  std::atomic<int> ran{0};
  EXPECT_TRUE(pool.TrySubmit([&] { ran.fetch_add(1); }));
  EXPECT_TRUE(pool.TrySubmit([&] { ran.fetch_add(1); }));
  EXPECT_EQ(pool.queued(), 2);
  EXPECT_FALSE(pool.TrySubmit([&] { ran.fetch_add(100); }))
      << "a third waiting task must be refused";
  release.Notify();
  pool.Shutdown();
  EXPECT_EQ(ran.load(), 2);
}

TEST(WorkerPoolTest, RefusesAfterShutdown) {
  WorkerPool pool("test", 2, 10);
  pool.Shutdown();
  EXPECT_FALSE(pool.TrySubmit([] {}));
  pool.Shutdown();  // idempotent
}

}  // namespace
}  // namespace kvdepot
