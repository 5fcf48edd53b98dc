#include "common/malloc_tuning.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace kvdepot {
namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitizerAllocator = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kSanitizerAllocator = true;
#else
constexpr bool kSanitizerAllocator = false;
#endif
#else
constexpr bool kSanitizerAllocator = false;
#endif

// Minor page faults of 50 rounds, in a thread of its own (so an arena of
// its own), of allocating three 200 KiB blocks, writing them and freeing
// them last first, after two rounds that let glibc settle.
long ChurnFaults() {
  long faults = -1;
  std::thread t([&faults] {
    constexpr size_t kBytes = 200 << 10;
    auto round = [] {
      void* p[3];
      for (void*& b : p) {
        b = std::malloc(kBytes);
        std::memset(b, 1, kBytes);
        asm volatile("" : : "r"(b) : "memory");  // the writes happen
      }
      for (int i = 2; i >= 0; --i) std::free(p[i]);
    };
    round();
    round();
    rusage a, b;
    getrusage(RUSAGE_THREAD, &a);
    for (int r = 0; r < 50; ++r) round();
    getrusage(RUSAGE_THREAD, &b);
    faults = b.ru_minflt - a.ru_minflt;
  });
  t.join();
  return faults;
}

TEST(KeepFreedMemoryTest, RejectsLimitsOutOfRange) {
  for (int64_t bad : {int64_t{-1}, int64_t{0}, int64_t{(1 << 20) - 1},
                      int64_t{1} << 31, int64_t{1} << 40}) {
    const absl::Status s = KeepFreedMemory(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("freed-memory limit"), std::string::npos) << s;
  }
}

// The same churn re-faults its memory every round with glibc's defaults
// (in a child forked before the tuning) and not at all once freed memory
// is kept.
TEST(KeepFreedMemoryTest, FreedMemoryIsReusedWithoutNewPageFaults) {
  if (kSanitizerAllocator) {
    GTEST_SKIP() << "ASan's allocator replaces glibc's (mallopt does nothing)";
  }
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(pipe_fds[0]);
    const long faults = ChurnFaults();
    const bool ok = write(pipe_fds[1], &faults, sizeof(faults)) ==
                    static_cast<ssize_t>(sizeof(faults));
    _exit(ok ? 0 : 1);
  }
  close(pipe_fds[1]);
  long untuned = -1;
  ASSERT_EQ(read(pipe_fds[0], &untuned, sizeof(untuned)),
            static_cast<ssize_t>(sizeof(untuned)));
  close(pipe_fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);

  ASSERT_TRUE(KeepFreedMemory(int64_t{64} << 20).ok());
  const long tuned = ChurnFaults();
  // 50 rounds of 600 KiB: up to 7500 faults when the memory goes back to
  // the kernel each round (5900 measured on the development VM).
  EXPECT_GT(untuned, 50 * 40) << "glibc's defaults no longer trim here";
  EXPECT_LT(tuned, 50) << "untuned " << untuned;
}

}  // namespace
}  // namespace kvdepot
