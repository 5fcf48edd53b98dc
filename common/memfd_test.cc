// Attacks on memfd acceptance (SPEC §11): every descriptor that is not a
// sealed, fully allocated memfd of the declared size is refused with
// INVALID_ARGUMENT, nothing leaks; accepted memory survives a peer's
// truncation attempts and hole punching.
#include "common/memfd.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kSize = 3 * 4096 + 17;

int OpenFdCount() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n;
}

// A memfd with `seals`, `size` bytes, allocated in full when `allocate`.
UniqueFd RawMemfd(int64_t size, int seals, bool allocate) {
  UniqueFd fd(memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  EXPECT_TRUE(fd.valid());
  EXPECT_EQ(ftruncate(fd.get(), size), 0);
  if (allocate) {
    EXPECT_EQ(fallocate(fd.get(), 0, 0, size), 0);
  }
  if (seals != 0) {
    EXPECT_EQ(fcntl(fd.get(), F_ADD_SEALS, seals), 0);
  }
  return fd;
}

void ExpectRefused(UniqueFd fd, int64_t size, const std::string& why) {
  absl::StatusOr<MemfdRegion> r =
      MemfdRegion::Import("import.fd", std::move(fd), size);
  ASSERT_FALSE(r.ok()) << why;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << why;
  EXPECT_THAT(r.status().message(), HasSubstr("import.fd")) << why;
  EXPECT_THAT(r.status().message(), HasSubstr(why));
}

TEST(MemfdTest, CreatedRegionIsSealedZeroedAndAccepted) {
  absl::StatusOr<MemfdRegion> r = MemfdRegion::Create("pool", kSize);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->size(), kSize);
  for (int64_t i = 0; i < kSize; ++i) ASSERT_EQ(r->data()[i], 0) << i;
  EXPECT_TRUE(ValidateMemfd("x", r->fd(), kSize).ok());
  const int seals = fcntl(r->fd(), F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
            F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  // A holder of the descriptor can neither truncate nor add a write seal.
  absl::StatusOr<UniqueFd> peer = r->Dup();
  ASSERT_TRUE(peer.ok());
  EXPECT_NE(ftruncate(peer->get(), 0), 0);
  EXPECT_NE(ftruncate(peer->get(), kSize + 4096), 0);
  EXPECT_NE(fcntl(peer->get(), F_ADD_SEALS, F_SEAL_FUTURE_WRITE), 0);
  r->data()[kSize - 1] = 7;
}

TEST(MemfdTest, RefusesEverythingThatIsNotASealedMemfd) {
  const int before = OpenFdCount();
  {
    // A regular file (in the test's temporary directory).
    const std::string path =
        absl::StrCat(std::getenv("TEST_TMPDIR"), "/regular");
    UniqueFd f(open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    ASSERT_TRUE(f.valid());
    ASSERT_EQ(ftruncate(f.get(), kSize), 0);
    ExpectRefused(std::move(f), kSize, "the descriptor");
    // A shm object: tmpfs, but not sealed.
    UniqueFd shm(open("/dev/shm", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600));
    if (shm.valid()) {
      ASSERT_EQ(ftruncate(shm.get(), kSize), 0);
      ExpectRefused(std::move(shm), kSize, "sealed against shrinking");
    }
  }
  {
    int p[2];
    ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
    UniqueFd w(p[1]);
    ExpectRefused(UniqueFd(p[0]), kSize, "not a regular file");
  }
  {
    int sv[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    UniqueFd other(sv[1]);
    ExpectRefused(UniqueFd(sv[0]), kSize, "not a regular file");
  }
  ExpectRefused(RawMemfd(kSize, 0, true), kSize, "sealed against shrinking");
  ExpectRefused(RawMemfd(kSize, F_SEAL_GROW, true), kSize,
                "sealed against shrinking");
  ExpectRefused(RawMemfd(kSize, F_SEAL_SHRINK, true), kSize,
                "sealed against shrinking");
  ExpectRefused(RawMemfd(kSize, F_SEAL_SHRINK | F_SEAL_GROW, true), kSize + 1,
                "not the declared size = 12306");
  ExpectRefused(RawMemfd(kSize, F_SEAL_SHRINK | F_SEAL_GROW, true), kSize - 1,
                "not the declared size");
  ExpectRefused(RawMemfd(kSize, F_SEAL_SHRINK | F_SEAL_GROW, false), kSize,
                "has holes");
  ExpectRefused(
      RawMemfd(kSize, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE, true), kSize,
      "sealed against writing");
  {
    UniqueFd rw = RawMemfd(kSize, F_SEAL_SHRINK | F_SEAL_GROW, true);
    UniqueFd ro(open(absl::StrCat("/proc/self/fd/", rw.get()).c_str(),
                     O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(ro.valid());
    ExpectRefused(std::move(ro), kSize, "not open read-write");
  }
  ExpectRefused(UniqueFd(), kSize, "not an open file");
  EXPECT_EQ(OpenFdCount(), before) << "a refused descriptor was leaked";
}

TEST(MemfdTest, HolePunchingAfterAcceptanceRefillsWithZeros) {
  UniqueFd fd = RawMemfd(kSize, F_SEAL_SHRINK | F_SEAL_GROW, true);
  UniqueFd peer(fcntl(fd.get(), F_DUPFD_CLOEXEC, 0));
  absl::StatusOr<MemfdRegion> r =
      MemfdRegion::Import("buf", std::move(fd), kSize);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->fd(), -1);  // not kept unless asked
  for (int64_t i = 0; i < kSize; ++i) r->data()[i] = 0x5a;
  // The peer punches out every page and tries to truncate.
  ASSERT_EQ(fallocate(peer.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                      kSize),
            0);
  EXPECT_NE(ftruncate(peer.get(), 0), 0);
  // Reading and writing the whole mapping still works (no SIGBUS).
  int64_t zeros = 0;
  for (int64_t i = 0; i < kSize; ++i) zeros += r->data()[i] == 0 ? 1 : 0;
  EXPECT_EQ(zeros, kSize);
  for (int64_t i = 0; i < kSize; ++i) r->data()[i] = 1;
  EXPECT_EQ(r->data()[kSize - 1], 1);
}

}  // namespace
}  // namespace kvdepot
