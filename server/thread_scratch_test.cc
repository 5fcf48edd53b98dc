#include "server/thread_scratch.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace kvdepot {
namespace {

// reserve() takes address space only: the pages are never touched.
struct Bytes {
  std::vector<char> v;
};
int64_t HeldBytes(const Bytes& b) { return CapacityBytes(b.v); }

// Another scratch type, with its own per-thread object.
struct Ints {
  std::vector<int32_t> a, b;
};
int64_t HeldBytes(const Ints& s) { return CapacityBytes(s.a, s.b); }

constexpr int64_t kMiB = int64_t{1} << 20;

// Runs `f` on a thread of its own (each test starts from threads that keep
// nothing) and waits for it; the thread's scratch is given back as it ends.
template <class F>
void OnThread(F f) {
  std::thread t(f);
  t.join();
}

TEST(ThreadScratchTest, CapacityBytesSumsEveryContainer) {
  std::vector<int32_t> a;
  a.reserve(10);
  std::vector<double> b;
  b.reserve(3);
  EXPECT_EQ(CapacityBytes(a, b),
            static_cast<int64_t>(a.capacity() * 4 + b.capacity() * 8));
  EXPECT_EQ(CapacityBytes(), 0);
}

TEST(ThreadScratchTest, SmallScratchIsKeptAndCounted) {
  ASSERT_EQ(ScratchKeptBytes(), 0);
  OnThread([] {
    const Bytes* first = nullptr;
    {
      ThreadScratch<Bytes> s;
      s->v.reserve(kMiB);
      first = &*s;
    }
    EXPECT_EQ(ScratchKeptBytes(), kMiB);
    {
      ThreadScratch<Bytes> s;
      EXPECT_EQ(&*s, first);  // the same object, capacity and all
      EXPECT_EQ(s->v.capacity(), static_cast<size_t>(kMiB));
      s->v.reserve(2 * kMiB);
    }
    EXPECT_EQ(ScratchKeptBytes(), 2 * kMiB);
  });
  EXPECT_EQ(ScratchKeptBytes(), 0);  // the thread ended
}

TEST(ThreadScratchTest, ScratchPastThePerThreadShareIsFreed) {
  OnThread([] {
    {
      ThreadScratch<Bytes> s;
      s->v.reserve(kMiB);
    }
    ASSERT_EQ(ScratchKeptBytes(), kMiB);
    {
      ThreadScratch<Bytes> s;
      s->v.reserve(kScratchKeptPerThreadBytes + 1);
    }
    EXPECT_EQ(ScratchKeptBytes(), 0);  // the 1 MiB kept before is back too
    ThreadScratch<Bytes> s;
    EXPECT_EQ(s->v.capacity(), 0u);  // a fresh object
  });
  // Exactly the share is kept.
  OnThread([] {
    {
      ThreadScratch<Bytes> s;
      s->v.reserve(kScratchKeptPerThreadBytes);
    }
    EXPECT_EQ(ScratchKeptBytes(), kScratchKeptPerThreadBytes);
  });
  EXPECT_EQ(ScratchKeptBytes(), 0);
}

TEST(ThreadScratchTest, AllThreadsTogetherKeepAtMostTheTotal) {
  // Twice as many threads as the total has room for, each keeping a full
  // share, all alive at once: half keep theirs, half find theirs freed.
  constexpr int kThreads =
      static_cast<int>(2 * kScratchKeptBytes / kScratchKeptPerThreadBytes);
  std::vector<int> kept(kThreads, -1);
  std::vector<std::thread> threads;
  std::atomic<int> done{0};
  std::atomic<bool> leave{false};
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      {
        ThreadScratch<Bytes> s;
        s->v.reserve(kScratchKeptPerThreadBytes);
      }
      {
        ThreadScratch<Bytes> s;
        kept[i] = s->v.capacity() > 0 ? 1 : 0;
        EXPECT_LE(ScratchKeptBytes(), kScratchKeptBytes);
      }
      done.fetch_add(1);
      while (!leave.load()) std::this_thread::yield();
    });
  }
  while (done.load() < kThreads) std::this_thread::yield();
  EXPECT_EQ(ScratchKeptBytes(), kScratchKeptBytes);
  leave.store(true);
  for (std::thread& t : threads) t.join();
  int keeping = 0;
  for (int k : kept) keeping += k;
  EXPECT_EQ(keeping, kThreads / 2);
  EXPECT_EQ(ScratchKeptBytes(), 0);
}

TEST(ThreadScratchTest, EachTypeHasItsOwnObjectAndNestedUseGetsAFreshOne) {
  OnThread([] {
    ThreadScratch<Bytes> outer;
    outer->v.reserve(kMiB);
    {
      ThreadScratch<Ints> ints;  // another type: the thread's own object
      ints->a.reserve(1000);
      ThreadScratch<Bytes> nested;  // same type, in use: a fresh one
      EXPECT_NE(&*nested, &*outer);
      EXPECT_EQ(nested->v.capacity(), 0u);
      nested->v.reserve(3 * kMiB);
    }
    // The nested object is gone and counted nothing; the Ints object is
    // kept.
    EXPECT_EQ(ScratchKeptBytes(), 4000);
    EXPECT_EQ(outer->v.capacity(), static_cast<size_t>(kMiB));
  });
  EXPECT_EQ(ScratchKeptBytes(), 0);
}

}  // namespace
}  // namespace kvdepot
