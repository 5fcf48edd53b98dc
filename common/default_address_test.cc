#include "common/default_address.h"

#include <unistd.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

TEST(DefaultAddressTest, XdgRuntimeDirWhenSetAndAbsolute) {
  setenv("XDG_RUNTIME_DIR", "/run/user/1234", 1);
  EXPECT_EQ(DefaultSocketPath(), "/run/user/1234/kvdepot/kvdepotd.sock");
  setenv("XDG_RUNTIME_DIR", "relative/dir", 1);
  EXPECT_EQ(DefaultSocketPath(),
            absl::StrCat("/tmp/kvdepot-", getuid(), "/kvdepotd.sock"));
  unsetenv("XDG_RUNTIME_DIR");
  EXPECT_EQ(DefaultSocketPath(),
            absl::StrCat("/tmp/kvdepot-", getuid(), "/kvdepotd.sock"));
  EXPECT_EQ(ResolveTarget(""),
            absl::StrCat("unix:/tmp/kvdepot-", getuid(), "/kvdepotd.sock"));
}

TEST(DefaultAddressTest, Targets) {
  EXPECT_EQ(ResolveTarget("/tmp/x.sock"), "unix:/tmp/x.sock");
  EXPECT_EQ(ResolveTarget("unix:/tmp/x.sock"), "unix:/tmp/x.sock");
  EXPECT_EQ(ResolveTarget("localhost:50051"), "localhost:50051");
  EXPECT_EQ(UnixSocketPathOf("unix:/tmp/x.sock"), "/tmp/x.sock");
  EXPECT_EQ(UnixSocketPathOf("unix:///tmp/x.sock"), "/tmp/x.sock");
  EXPECT_EQ(UnixSocketPathOf("localhost:50051"), "");
}

}  // namespace
}  // namespace kvdepot
