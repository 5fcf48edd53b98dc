// SCM_RIGHTS over SOCK_SEQPACKET: descriptors arrive; a message with more
// descriptors than the cap, or longer than allowed, is refused and every
// descriptor it carried is closed.
#include "common/fd_passing.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

int OpenFdCount() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n;
}

struct Pair {
  UniqueFd a, b;
  Pair() {
    int sv[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    a.reset(sv[0]);
    b.reset(sv[1]);
  }
};

TEST(FdPassingTest, DescriptorsArriveCloseOnExec) {
  Pair p;
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  UniqueFd r(pipe_fds[0]), w(pipe_fds[1]);
  ASSERT_TRUE(SendMessage(p.a.get(), "hello", {r.get(), w.get()}).ok());
  absl::StatusOr<ReceivedMessage> m = ReceiveMessage(p.b.get(), 64, 2);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->bytes, "hello");
  ASSERT_EQ(m->fds.size(), 2u);
  for (const UniqueFd& fd : m->fds) {
    EXPECT_NE(fcntl(fd.get(), F_GETFD) & FD_CLOEXEC, 0);
  }
  ASSERT_EQ(write(m->fds[1].get(), "x", 1), 1);
  char c = 0;
  ASSERT_EQ(read(r.get(), &c, 1), 1);
  EXPECT_EQ(c, 'x');
}

TEST(FdPassingTest, TooManyDescriptorsAreAllClosed) {
  Pair p;
  std::vector<UniqueFd> sent;
  std::vector<int> raw;
  for (int i = 0; i < 6; ++i) {
    sent.emplace_back(open("/dev/null", O_RDONLY | O_CLOEXEC));
    raw.push_back(sent.back().get());
  }
  ASSERT_TRUE(SendMessage(p.a.get(), "m", raw).ok());
  sent.clear();
  const int before = OpenFdCount();
  absl::StatusOr<ReceivedMessage> m = ReceiveMessage(p.b.get(), 64, 2);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("more than 2 descriptors"));
  EXPECT_EQ(OpenFdCount(), before) << "a truncated message leaked descriptors";
  // With no descriptors allowed at all, one sent anyway is closed too.
  UniqueFd one(open("/dev/null", O_RDONLY | O_CLOEXEC));
  const int fd = one.get();
  ASSERT_TRUE(SendMessage(p.a.get(), "m", {&fd, 1}).ok());
  one.reset();
  m = ReceiveMessage(p.b.get(), 64, 0);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenFdCount(), before);
}

TEST(FdPassingTest, LongMessageRefusedAndItsDescriptorsClosed) {
  Pair p;
  UniqueFd one(open("/dev/null", O_RDONLY | O_CLOEXEC));
  const int fd = one.get();
  ASSERT_TRUE(SendMessage(p.a.get(), std::string(100, 'x'), {&fd, 1}).ok());
  one.reset();
  const int before = OpenFdCount();
  absl::StatusOr<ReceivedMessage> m = ReceiveMessage(p.b.get(), 10, 1);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("longer than 10 bytes"));
  EXPECT_EQ(OpenFdCount(), before);
}

TEST(FdPassingTest, ClosedPeerIsOutOfRange) {
  Pair p;
  p.a.reset();
  absl::StatusOr<ReceivedMessage> m = ReceiveMessage(p.b.get(), 10, 1);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(SendMessage(p.b.get(), "x", {}).code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvdepot
