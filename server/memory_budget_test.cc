#include "server/memory_budget.h"

#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

// A fake /sys/fs/cgroup + /proc under the test's tmpdir.
class FakeSystem {
 public:
  explicit FakeSystem(const std::string& name)
      : dir_(absl::StrCat(std::getenv("TEST_TMPDIR"), "/", name)) {
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_ + "/proc");
    files_.cgroup_root = dir_ + "/cgroup";
    files_.self_cgroup = dir_ + "/proc/cgroup";
    files_.meminfo = dir_ + "/proc/meminfo";
  }
  void Write(const std::string& rel, const std::string& text) {
    const std::string path = rel[0] == '/' ? dir_ + rel : dir_ + "/" + rel;
    std::filesystem::create_directories(
        std::filesystem::path(path).parent_path());
    std::ofstream(path) << text;
  }
  const SystemMemoryFiles& files() const { return files_; }

 private:
  std::string dir_;
  SystemMemoryFiles files_;
};

TEST(ReadAvailableMemoryTest, CgroupV2TakesTheTightestLevel) {
  FakeSystem s("v2");
  s.Write("proc/cgroup", "0::/kubepods/pod1/c1\n");
  s.Write("cgroup/kubepods/pod1/c1/memory.max", "max\n");
  s.Write("cgroup/kubepods/pod1/c1/memory.current", "100\n");
  s.Write("cgroup/kubepods/pod1/memory.max", "1000\n");
  s.Write("cgroup/kubepods/pod1/memory.current", "400\n");
  s.Write("cgroup/kubepods/memory.max", "10000\n");
  s.Write("cgroup/kubepods/memory.current", "9700\n");
  s.Write("proc/meminfo", "MemAvailable:  999999 kB\n");
  absl::StatusOr<AvailableMemory> a = ReadAvailableMemory(s.files());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->bytes, 300);
  EXPECT_THAT(a->source, HasSubstr("cgroup v2"));
  EXPECT_THAT(a->source, HasSubstr("kubepods: memory.max"));
}

TEST(ReadAvailableMemoryTest, CgroupV2HybridAndUsageAboveLimit) {
  FakeSystem s("hybrid");
  s.Write("proc/cgroup", "4:memory:/\n0::/svc\n");
  s.Write("cgroup/unified/svc/memory.max", "500\n");
  s.Write("cgroup/unified/svc/memory.current", "800\n");
  absl::StatusOr<AvailableMemory> a = ReadAvailableMemory(s.files());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->bytes, 0);
}

TEST(ReadAvailableMemoryTest, CgroupV1PathAndContainerMount) {
  FakeSystem s("v1");
  s.Write("proc/cgroup", "9:pids:/\n4:memory:/process_api/abc\n0::/\n");
  s.Write("cgroup/memory/process_api/abc/memory.limit_in_bytes", "2000\n");
  s.Write("cgroup/memory/process_api/abc/memory.usage_in_bytes", "500\n");
  s.Write("cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  s.Write("cgroup/memory/memory.usage_in_bytes", "7466405888\n");
  absl::StatusOr<AvailableMemory> a = ReadAvailableMemory(s.files());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->bytes, 1500);
  EXPECT_THAT(a->source, HasSubstr("cgroup v1"));

  FakeSystem c("v1container");  // the mount is the container's cgroup
  c.Write("proc/cgroup", "4:memory:/docker/xyz\n");
  c.Write("cgroup/memory/memory.limit_in_bytes", "5000\n");
  c.Write("cgroup/memory/memory.usage_in_bytes", "1000\n");
  a = ReadAvailableMemory(c.files());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->bytes, 4000);
}

TEST(ReadAvailableMemoryTest, MeminfoWhenNoCgroupLimits) {
  FakeSystem s("meminfo");
  s.Write("proc/cgroup", "0::/\n");
  s.Write("cgroup/memory.max", "max\n");
  s.Write("cgroup/memory.current", "5\n");
  s.Write("proc/meminfo",
          "MemTotal:       24000000 kB\nMemAvailable:       1234 kB\n");
  absl::StatusOr<AvailableMemory> a = ReadAvailableMemory(s.files());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->bytes, 1234 * 1024);
  EXPECT_THAT(a->source, HasSubstr("MemAvailable"));
}

TEST(ReadAvailableMemoryTest, GarbageAndNothingAreErrorsNotGuesses) {
  FakeSystem s("garbage");
  s.Write("proc/cgroup", "0::/x\n");
  s.Write("cgroup/x/memory.max", "-5\n");
  s.Write("cgroup/x/memory.current", "zz\n");
  s.Write("proc/meminfo", "MemAvailable: lots\n");
  absl::StatusOr<AvailableMemory> a = ReadAvailableMemory(s.files());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(a.status().message()),
              HasSubstr("--memory_budget_bytes"));
}

TEST(ReadAvailableMemoryTest, ThisMachine) {
  absl::StatusOr<AvailableMemory> a = ReadAvailableMemory(SystemMemoryFiles());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_GT(a->bytes, 0) << a->source;
}

TEST(MemoryBudgetTest, AdmitsWhatFitsAndSaysWhatIsLeft) {
  MemoryBudget b(int64_t{10} << 30, int64_t{4} << 30, "test");
  EXPECT_TRUE(b.Reserve("", int64_t{7} << 30, "pool \"a\"").ok());
  absl::Status s = b.Reserve("s1", int64_t{4} << 30, "pool \"b\"");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("pool \"b\": 4.0 GiB (4294967296 bytes) does not fit "
                        "the memory budget: 3.0 GiB of 10.0 GiB available"));
  EXPECT_EQ(b.used(), int64_t{7} << 30);  // the refusal reserved nothing
  b.Release("", int64_t{7} << 30);
  EXPECT_TRUE(b.Reserve("s1", int64_t{3} << 30, "buffer").ok());
  s = b.Reserve("s1", int64_t{2} << 30, "buffer");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("this client's memory budget: 1.0 GiB of 4.0 GiB"));
  EXPECT_TRUE(b.Reserve("s2", int64_t{2} << 30, "buffer").ok());
  EXPECT_EQ(b.used_by("s1"), int64_t{3} << 30);
  EXPECT_EQ(b.Reserve("s2", -1, "buffer").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b.Reserve("s2", INT64_MAX, "buffer").code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(MemoryBudgetTest, ConcurrentReservationsNeverExceedTheTotal) {
  static constexpr int64_t kTotal = 1000;
  MemoryBudget b(kTotal, 0, "test");
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&b, t] {
      std::mt19937 rng(301 + t);
      std::vector<int64_t> held;
      for (int i = 0; i < 2000; ++i) {
        const int64_t n = rng() % 200;
        if (b.Reserve("c", n, "x").ok()) held.push_back(n);
        EXPECT_LE(b.used(), kTotal);
        if (!held.empty() && rng() % 2 == 0) {
          b.Release("c", held.back());
          held.pop_back();
        }
      }
      for (int64_t n : held) b.Release("c", n);
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(b.used(), 0);
}

TEST(MemoryReservationTest, GivesItsBytesBackWhenDestroyedOrMoved) {
  MemoryBudget b(100, 0, "test");
  {
    absl::StatusOr<MemoryReservation> r =
        MemoryReservation::Open(&b, "c", 60, "pool");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(b.used(), 60);
    EXPECT_EQ(MemoryReservation::Open(&b, "c", 41, "pool").status().code(),
              absl::StatusCode::kResourceExhausted);
    MemoryReservation moved = *std::move(r);
    EXPECT_EQ(b.used(), 60);  // a move hands over, it does not release
    moved = MemoryReservation();
    EXPECT_EQ(b.used(), 0);
    absl::StatusOr<MemoryReservation> again =
        MemoryReservation::Open(&b, "c", 100, "pool");
    ASSERT_TRUE(again.ok()) << again.status();
  }
  EXPECT_EQ(b.used(), 0);
  EXPECT_EQ(b.used_by("c"), 0);
  absl::StatusOr<MemoryReservation> none =
      MemoryReservation::Open(nullptr, "c", INT64_MAX, "device pool");
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->bytes(), 0);
}

}  // namespace
}  // namespace kvdepot
