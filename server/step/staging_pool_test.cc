// The staging pool: areas rounded up to powers of two, reused by later
// requests of at most their size, never freed, and capped; a client that
// registers and unregisters with ever new sizes cannot grow it past that.
#include "server/step/staging_pool.h"

#include <cstdlib>
#include <random>
#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvdepot::step {
namespace {

using ::testing::HasSubstr;

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * kKiB;

// An allocator that counts, hands out fake addresses and can fail.
struct FakeAlloc {
  int64_t calls = 0;
  int64_t bytes = 0;
  bool fail = false;
  uintptr_t next = 0x10000;
  StagingPool::Alloc Fn() {
    return [this](size_t n) -> absl::StatusOr<void*> {
      if (fail) return absl::InternalError("cudaMalloc: out of memory");
      ++calls;
      bytes += static_cast<int64_t>(n);
      void* p = reinterpret_cast<void*>(next);
      next += n;
      return p;
    };
  }
};

TEST(StagingPoolTest, BucketsArePowersOfTwoFrom4KiB) {
  EXPECT_EQ(StagingPool::BucketBytes(1), 4 * kKiB);
  EXPECT_EQ(StagingPool::BucketBytes(4 * kKiB), 4 * kKiB);
  EXPECT_EQ(StagingPool::BucketBytes(4 * kKiB + 1), 8 * kKiB);
  EXPECT_EQ(StagingPool::BucketBytes(21 * kMiB), 32 * kMiB);
}

TEST(StagingPoolTest, FreeAreasServeLaterRequestsOfAtMostTheirSize) {
  FakeAlloc fake;
  StagingPool pool("test staging", 64 * kMiB, fake.Fn());
  absl::StatusOr<StagingPool::Area> a = pool.Take(3 * kMiB);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->bytes, 4 * kMiB);
  absl::StatusOr<StagingPool::Area> b = pool.Take(100);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->bytes, 4 * kKiB);
  pool.Give(*a);
  pool.Give(*b);
  EXPECT_EQ(pool.free_bytes(), static_cast<int64_t>(4 * kMiB + 4 * kKiB));
  // 5 KiB: the 4 KiB area is too small, the 4 MiB one serves it.
  absl::StatusOr<StagingPool::Area> c = pool.Take(5 * kKiB);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->ptr, a->ptr);
  EXPECT_EQ(c->bytes, 4 * kMiB);
  // 1 KiB: the smallest that fits, the 4 KiB one.
  absl::StatusOr<StagingPool::Area> d = pool.Take(kKiB);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->ptr, b->ptr);
  EXPECT_EQ(fake.calls, 2);
  EXPECT_EQ(pool.allocated(), static_cast<int64_t>(4 * kMiB + 4 * kKiB));
}

TEST(StagingPoolTest, NewSizesOverAndOverStayWithinTheCap) {
  // The attack: register and unregister with a new size each time (before
  // the pool, every size left an area behind).
  FakeAlloc fake;
  StagingPool pool("test staging", 256 * kMiB, fake.Fn());
  std::mt19937 rng(5);
  std::uniform_int_distribution<size_t> size(1, 21 * kMiB);
  for (int i = 0; i < 10000; ++i) {
    std::vector<StagingPool::Area> held;
    for (int k = 0; k < 4; ++k) {  // two slots, device and host
      absl::StatusOr<StagingPool::Area> a = pool.Take(size(rng));
      ASSERT_TRUE(a.ok()) << i << ": " << a.status();
      held.push_back(*a);
    }
    for (const StagingPool::Area& a : held) pool.Give(a);
  }
  // Four areas in use at once, each at most 32 MiB: what was allocated is
  // bounded by four of every bucket up to 32 MiB, far below 10000 x 4.
  EXPECT_LE(pool.allocated(), static_cast<int64_t>(4 * 64 * kMiB));
  EXPECT_LT(fake.calls, 4 * 14);
  EXPECT_EQ(pool.allocated(), fake.bytes);
}

TEST(StagingPoolTest, PastTheCapIsRefusedAndAllocatesNothing) {
  FakeAlloc fake;
  StagingPool pool("staging on cuda:0", 16 * kMiB, fake.Fn());
  absl::StatusOr<StagingPool::Area> a = pool.Take(8 * kMiB);
  ASSERT_TRUE(a.ok());
  absl::StatusOr<StagingPool::Area> b = pool.Take(6 * kMiB);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->bytes, 8 * kMiB);
  absl::StatusOr<StagingPool::Area> c = pool.Take(1);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("staging on cuda:0: 4096 more bytes would pass the "
                        "16777216 the step path may allocate"));
  EXPECT_EQ(pool.Take(17 * kMiB).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.Take(0).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(fake.calls, 2);
  // Once given back, an area serves again.
  pool.Give(*b);
  EXPECT_TRUE(pool.Take(1).ok());
  EXPECT_EQ(fake.calls, 2);
}

TEST(StagingPoolTest, AnAllocatorErrorIsPassedOnAndCountsNothing) {
  FakeAlloc fake;
  StagingPool pool("test staging", 16 * kMiB, fake.Fn());
  fake.fail = true;
  absl::StatusOr<StagingPool::Area> a = pool.Take(kMiB);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(pool.allocated(), 0);
  fake.fail = false;
  EXPECT_TRUE(pool.Take(kMiB).ok());
  EXPECT_EQ(pool.allocated(), static_cast<int64_t>(kMiB));
}

}  // namespace
}  // namespace kvdepot::step
