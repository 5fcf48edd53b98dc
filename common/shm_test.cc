#include "common/shm.h"

#include <sys/stat.h>

#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

bool Exists(const std::string& name) {
  struct stat st;
  return stat(absl::StrCat("/dev/shm", name).c_str(), &st) == 0;
}

TEST(ShmTest, NamesAreRandomAndWellFormed) {
  std::set<std::string> names;
  for (int i = 0; i < 64; ++i) {
    absl::StatusOr<std::string> n = RandomShmName();
    ASSERT_TRUE(n.ok());
    EXPECT_EQ(n->size(), std::string("/kvdepot-").size() + 32);
    EXPECT_TRUE(ValidateShmName("n", *n).ok());
    names.insert(*n);
  }
  EXPECT_EQ(names.size(), 64u);
}

TEST(ShmTest, CreateMapsZeroedMemoryWithTheModeAndUnlinksOnDestruction) {
  std::string name;
  {
    absl::StatusOr<ShmRegion> r = ShmRegion::Create(4099, 0600);
    ASSERT_TRUE(r.ok()) << r.status();
    name = r->name();
    EXPECT_TRUE(r->owner());
    struct stat st;
    ASSERT_EQ(stat(absl::StrCat("/dev/shm", name).c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600);
    EXPECT_EQ(st.st_size, 4099);
    for (int64_t i = 0; i < r->size(); ++i) ASSERT_EQ(r->data()[i], 0);
    // A second mapping sees the first one's writes.
    absl::StatusOr<ShmRegion> other = ShmRegion::Open(name, 4099);
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_FALSE(other->owner());
    std::memset(r->data(), 0x5A, 4099);
    EXPECT_EQ(other->data()[4098], 0x5A);
    // Moving keeps one owner.
    ShmRegion moved = *std::move(r);
    EXPECT_TRUE(Exists(name));
  }
  EXPECT_FALSE(Exists(name));
}

TEST(ShmTest, OpenRejectsBadNamesSizesAndMissingObjects) {
  absl::StatusOr<ShmRegion> r = ShmRegion::Open("/../etc/passwd", 10);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("character 1"));
  r = ShmRegion::Open("/..", 10);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("character 1"));
  r = ShmRegion::Open("/a/b", 10);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("character 2"));
  r = ShmRegion::Open("noslash", 10);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  r = ShmRegion::Open("/kvdepot-none-such", 10);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<ShmRegion> small = ShmRegion::Create(100, 0600);
  ASSERT_TRUE(small.ok());
  r = ShmRegion::Open(small->name(), 101);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("holds 100 bytes, fewer than the 101 requested"));
  EXPECT_EQ(ShmRegion::Create(0, 0600).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvdepot
