// The CUDA backend's ordering primitives on a real device (GPU host only):
// one CallEvent per call shared by the staging and the UseFences, recycled
// when dropped, and each holder's wait exactly the end of the call it
// noted: not earlier (a gated stream holds it back), not later (work queued
// on the same stream after the call does not hold it back). The staging
// pool hands out only Stagings whose call finished, below its bound a new
// one, and never makes an inline call wait.
#include "server/cuda/call_events.h"

#include <cuda_runtime_api.h>

#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/backend/inline_call.h"
#include "server/cuda/cuda_memory.h"
#include "server/cuda/staging.h"
#include "server/cuda/test_gate.h"

namespace kvdepot {
namespace {

class CallEventsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess)
        << "no CUDA device: this test runs on the GPU host";
    ASSERT_GT(count, 0);
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    for (cudaStream_t* s : {&a_, &b_}) {
      ASSERT_EQ(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking),
                cudaSuccess);
    }
  }
  void TearDown() override {
    for (cudaStream_t s : {a_, b_}) {
      if (s != nullptr) {
        (void)cudaStreamSynchronize(s);
        (void)cudaStreamDestroy(s);
      }
    }
  }
  static bool Done(const CallEvent& e) {
    return cudaEventQuery(e.get()) == cudaSuccess;
  }

  cudaStream_t a_ = nullptr, b_ = nullptr;
};

TEST_F(CallEventsTest, DroppedEventsAreRecycled) {
  CallEvents events;
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<CallEvent> e = events.Record(0, a_);
    ASSERT_TRUE(e.ok()) << e.status();
  }
  EXPECT_EQ(events.created(), 1);
  std::vector<CallEvent> held;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<CallEvent> e = events.Record(0, a_);
    ASSERT_TRUE(e.ok()) << e.status();
    held.push_back(*e);
  }
  EXPECT_EQ(events.created(), 3);
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  for (const CallEvent& e : held) EXPECT_TRUE(Done(e));
}

TEST_F(CallEventsTest, EventsOutliveTheirPool) {
  CallEvent kept;
  {
    CallEvents events;
    absl::StatusOr<CallEvent> e = events.Record(0, a_);
    ASSERT_TRUE(e.ok()) << e.status();
    kept = *e;
  }
  ASSERT_EQ(cudaEventSynchronize(kept.get()), cudaSuccess);
  kept.reset();  // back to a free list nobody else holds: destroyed
}

TEST_F(CallEventsTest, FenceWaitsForTheNotedCallOnly) {
  CallEvents events;
  UseFence fence;
  Gate call, later;
  call.Park(a_);
  absl::StatusOr<CallEvent> done = events.Record(0, a_);
  ASSERT_TRUE(done.ok()) << done.status();
  fence.Note(a_, *done);
  // Work queued after the call on the same stream (another call that did
  // not touch this memory): the fence must not wait for it.
  later.Park(a_);
  absl::StatusOr<CallEvent> unrelated = events.Record(0, a_);
  ASSERT_TRUE(unrelated.ok()) << unrelated.status();

  // Another stream ordered after the fence waits for the gated call.
  ASSERT_TRUE(fence.OrderAfter(b_).ok());
  absl::StatusOr<CallEvent> on_b = events.Record(0, b_);
  ASSERT_TRUE(on_b.ok()) << on_b.status();
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(Done(*done));
  EXPECT_FALSE(Done(*on_b)) << "stream b ran before the noted call finished";

  call.Release();
  // Wait() returns while `later` still holds the stream.
  ASSERT_TRUE(fence.Wait().ok());
  EXPECT_TRUE(Done(*done));
  ASSERT_EQ(cudaStreamSynchronize(b_), cudaSuccess);
  EXPECT_TRUE(Done(*on_b));
  EXPECT_FALSE(Done(*unrelated));
  later.Release();
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
}

TEST_F(CallEventsTest, FenceOnTheSameStreamAddsNoWait) {
  CallEvents events;
  UseFence fence;
  Gate gate;
  gate.Park(a_);
  absl::StatusOr<CallEvent> done = events.Record(0, a_);
  ASSERT_TRUE(done.ok()) << done.status();
  fence.Note(a_, *done);
  // A stream runs in order: ordering a_ after its own point queues nothing
  // (a cross-stream wait would be the only way to deadlock here).
  ASSERT_TRUE(fence.OrderAfter(a_).ok());
  gate.Release();
  ASSERT_TRUE(fence.Wait().ok());
}

TEST_F(CallEventsTest, StagingWaitsForItsPreviousUserAtTheBound) {
  CallEvents events;
  StagingPool pool(/*max_per_device=*/1);
  Gate gate;
  {
    absl::StatusOr<StagingPool::Lease> lease = pool.Acquire(0, 1024);
    ASSERT_TRUE(lease.ok()) << lease.status();
    gate.Park(a_);
    absl::StatusOr<CallEvent> done = events.Record(0, a_);
    ASSERT_TRUE(done.ok()) << done.status();
    (*lease)->MarkUsed(*done);
  }  // back in the pool, its user's work still gated
  absl::Notification acquired;
  std::thread user([&] {
    absl::StatusOr<StagingPool::Lease> lease = pool.Acquire(0, 1024);
    EXPECT_TRUE(lease.ok()) << lease.status();
    acquired.Notify();
  });
  EXPECT_FALSE(acquired.WaitForNotificationWithTimeout(absl::Milliseconds(50)))
      << "the staging was handed out before its previous user's work ended";
  gate.Release();
  user.join();
  EXPECT_TRUE(acquired.HasBeenNotified());
}

// Returns a Staging of `pool` to it marked with an event behind `gate`
// (its call still running), and its host pointer.
uint8_t* ReturnBusy(StagingPool& pool, CallEvents& events, Gate& gate,
                    cudaStream_t stream, int64_t bytes) {
  absl::StatusOr<StagingPool::Lease> lease = pool.Acquire(0, bytes);
  EXPECT_TRUE(lease.ok()) << lease.status();
  if (!lease.ok()) return nullptr;
  gate.Park(stream);
  absl::StatusOr<CallEvent> done = events.Record(0, stream);
  EXPECT_TRUE(done.ok()) << done.status();
  if (done.ok()) (*lease)->MarkUsed(*done);
  return (*lease)->host();
}

TEST_F(CallEventsTest, BusyStagingIsNotHandedOutBelowTheBound) {
  CallEvents events;
  StagingPool pool(/*max_per_device=*/2);
  Gate gate;
  uint8_t* busy = ReturnBusy(pool, events, gate, a_, 1024);
  ASSERT_NE(busy, nullptr);
  {
    // A worker thread and an inline call alike get a new one at once.
    InlineCall inline_call;
    absl::StatusOr<StagingPool::Lease> lease = pool.Acquire(0, 1024);
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_NE((*lease)->host(), busy);
    EXPECT_FALSE(inline_call.deferred());
  }
  gate.Release();
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  // Its call finished: the longest-returned one is reused.
  absl::StatusOr<StagingPool::Lease> again = pool.Acquire(0, 1024);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->host(), busy);
}

TEST_F(CallEventsTest, InlineCallIsDeferredInsteadOfWaitingAtTheBound) {
  CallEvents events;
  StagingPool pool(/*max_per_device=*/1);
  Gate gate;
  uint8_t* busy = ReturnBusy(pool, events, gate, a_, 1024);
  ASSERT_NE(busy, nullptr);
  {
    InlineCall inline_call;
    const absl::Time start = absl::Now();
    absl::StatusOr<StagingPool::Lease> lease = pool.Acquire(0, 1024);
    EXPECT_EQ(lease.status().code(), absl::StatusCode::kUnavailable)
        << lease.status();
    EXPECT_TRUE(inline_call.deferred());
    EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  }
  gate.Release();
  absl::StatusOr<StagingPool::Lease> lease = pool.Acquire(0, 1024);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ((*lease)->host(), busy);
}

// The byte bound: with 1 MiB in Stagings no new one is made, whatever the
// count; the call takes the longest-returned one (an inline call: deferred
// while that one's call runs).
TEST_F(CallEventsTest, NoNewStagingPastTheByteBound) {
  CallEvents events;
  StagingPool pool(/*max_per_device=*/256, /*max_bytes_per_device=*/1 << 20);
  Gate gate;
  uint8_t* busy = ReturnBusy(pool, events, gate, a_, 1 << 20);
  ASSERT_NE(busy, nullptr);
  {
    InlineCall inline_call;
    absl::StatusOr<StagingPool::Lease> lease = pool.Acquire(0, 1024);
    EXPECT_EQ(lease.status().code(), absl::StatusCode::kUnavailable)
        << lease.status();
    EXPECT_TRUE(inline_call.deferred());
    EXPECT_NE(lease.status().message().find("1048576 bytes"),
              absl::string_view::npos)
        << lease.status();
  }
  gate.Release();
  absl::StatusOr<StagingPool::Lease> lease = pool.Acquire(0, 1024);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ((*lease)->host(), busy);
}

TEST_F(CallEventsTest, InlineCallDoesNotGrowAStaging) {
  StagingPool pool(/*max_per_device=*/1);
  uint8_t* small = nullptr;
  {
    absl::StatusOr<StagingPool::Lease> lease = pool.Acquire(0, 1024);
    ASSERT_TRUE(lease.ok()) << lease.status();
    small = (*lease)->host();
  }
  {
    // Growing frees the old buffers, and cudaFree waits for the device.
    InlineCall inline_call;
    absl::StatusOr<StagingPool::Lease> lease = pool.Acquire(0, 1 << 20);
    EXPECT_EQ(lease.status().code(), absl::StatusCode::kUnavailable)
        << lease.status();
    EXPECT_TRUE(inline_call.deferred());
  }
  // Unchanged by the deferred attempt; a worker grows it.
  absl::StatusOr<StagingPool::Lease> lease = pool.Acquire(0, 1 << 20);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_GE((*lease)->capacity(), 1 << 20);
  EXPECT_NE(small, nullptr);
}

TEST_F(CallEventsTest, WaitUsedBeforeAnyMarkIsAnError) {
  StagingPool pool;
  absl::StatusOr<StagingPool::Lease> lease = pool.Acquire(0, 64);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ((*lease)->WaitUsed().code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace kvdepot
