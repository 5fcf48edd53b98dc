// The daemon library in-process: listen addresses, the config file,
// backend selection and socket ownership.
#include "server/daemon.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/kvdepot_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

// A socket in a fresh private directory (clients refuse sockets in
// directories others can write; TEST_TMPDIR is too long for sun_path).
std::string TempSocket(const char* tag) {
  std::string tmpl = absl::StrCat("/tmp/kvdepot-dt-", tag, "-XXXXXX");
  if (mkdtemp(tmpl.data()) == nullptr) return "";
  return tmpl + "/kv.sock";
}

std::string WriteConfig(const std::string& text) {
  const std::string path =
      absl::StrCat(std::getenv("TEST_TMPDIR"), "/kvdepotd.textproto");
  std::ofstream(path) << text;
  return path;
}

TEST(DaemonTest, ConfigCreatesPoolsAndTcpListens) {
  DaemonOptions o;
  o.listen = "127.0.0.1:0";
  o.backend = "auto";
  o.config_path = WriteConfig(
      "pools { name: \"main\" format: \"V41\" block_size: 133 num_blocks: 3 "
      "num_layers: 2 }\n"
      "pools { name: \"idx\" format: \"BF16\" elements: 64 block_size: 7 "
      "num_blocks: 5 num_layers: 1 }\n");
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_THAT((*d)->target(), ::testing::StartsWith("127.0.0.1:"));
  EXPECT_NE((*d)->target(), "127.0.0.1:0");
  ClientOptions co;
  co.address = (*d)->target();
  absl::StatusOr<std::unique_ptr<KVCacheClient>> c = KVCacheClient::Connect(co);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<v1::ListPoolsResponse> pools = (*c)->ListPools();
  ASSERT_TRUE(pools.ok());
  ASSERT_EQ(pools->pools_size(), 2);
  EXPECT_EQ(pools->pools(0).name(), "idx");
  EXPECT_EQ(pools->pools(0).layout().format(), "BF16(64)");
  const v1::PoolLayout& l = pools->pools(1).layout();
  EXPECT_EQ(l.bytes_per_token(), 528);
  EXPECT_EQ(l.block_stride(), 133 * 528 + (1056 - 133 * 528 % 1056) % 1056);
  EXPECT_EQ(l.layer_stride() % 256, 0);
  EXPECT_EQ(l.total_bytes(), 2 * l.layer_stride());
  absl::StatusOr<v1::StatsResponse> stats = (*c)->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->backend(), "cpu");
  EXPECT_EQ(stats->pools(), 2);
  c->reset();
  (*d)->Shutdown();
}

// The default socket lives in a directory the daemon creates with mode
// 0700; one that others can enter or write is refused, not used.
TEST(DaemonTest, DefaultSocketDirectoryIsPrivate) {
  // Under /tmp: TEST_TMPDIR is too long for a socket path (108 bytes).
  char tmpl[] = "/tmp/kvdepot-dt-xdg-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string runtime = tmpl;
  setenv("XDG_RUNTIME_DIR", runtime.c_str(), 1);
  DaemonOptions o;
  {
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ((*d)->target(),
              absl::StrCat("unix:", runtime, "/kvdepot/kvdepotd.sock"));
    struct stat st;
    ASSERT_EQ(lstat((runtime + "/kvdepot").c_str(), &st), 0);
    EXPECT_TRUE(S_ISDIR(st.st_mode));
    EXPECT_EQ(st.st_mode & 07777, 0700);
    (*d)->Shutdown();
  }
  ASSERT_EQ(chmod((runtime + "/kvdepot").c_str(), 0777), 0);
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("mode 0777"));
  unsetenv("XDG_RUNTIME_DIR");
  rmdir((runtime + "/kvdepot").c_str());
  rmdir(runtime.c_str());
}

// On shutdown the daemon's own grace period refuses new calls with the
// service's UNAVAILABLE (naming the drain) while the listener still answers;
// only then does the listener close. A daemon that kept accepting work
// during the grace period, or skipped it, fails here.
TEST(DaemonTest, DrainGraceRefusesNewCallsBeforeTheListenerCloses) {
  DaemonOptions o;
  o.listen = TempSocket("drain");
  o.backend = "cpu";
  o.drain_grace = absl::Seconds(2);
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_TRUE(d.ok()) << d.status();
  ClientOptions co;
  co.address = (*d)->target();
  absl::StatusOr<std::unique_ptr<KVCacheClient>> c = KVCacheClient::Connect(co);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->Ping().ok());
  const absl::Time shutdown_start = absl::Now();
  std::thread stopper([&] { (*d)->Shutdown(); });
  absl::Status s;
  const absl::Time deadline = absl::Now() + absl::Seconds(1);
  do {
    s = (*c)->Ping();
  } while (s.ok() && absl::Now() < deadline);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("draining"));
  // Well inside the grace period: still the service's answer, for new work
  // too, not a closed transport.
  absl::StatusOr<v1::PoolInfo> p = (*c)->CreatePool([] {
    v1::CreatePoolRequest r;
    r.set_name("late");
    r.set_format("V41");
    r.set_block_size(4);
    r.set_num_blocks(2);
    r.set_num_layers(1);
    return r;
  }());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("draining"));
  stopper.join();
  EXPECT_GE(absl::Now() - shutdown_start, absl::Milliseconds(1900))
      << "the drain grace period was cut short";
  EXPECT_FALSE((*c)->Ping().ok()) << "the listener is still open";
}

// A --listen socket in a directory that does not exist yet (a subdirectory
// of a world-writable shared volume) gets a private directory made for it;
// clients then accept it.
TEST(DaemonTest, MissingSocketDirectoryIsCreatedPrivate) {
  char tmpl[] = "/tmp/kvdepot-dt-vol-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  ASSERT_EQ(chmod(tmpl, 01777), 0);  // like an emptyDir volume
  const std::string dir = std::string(tmpl) + "/daemon";
  DaemonOptions o;
  o.listen = dir + "/kvdepotd.sock";
  o.backend = "cpu";
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_TRUE(d.ok()) << d.status();
  struct stat st;
  ASSERT_EQ(lstat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700);
  ClientOptions co;
  co.address = (*d)->target();
  absl::StatusOr<std::unique_ptr<KVCacheClient>> c = KVCacheClient::Connect(co);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->Ping().ok());
  c->reset();
  (*d)->Shutdown();
}

TEST(DaemonTest, BadConfigNamesThePool) {
  DaemonOptions o;
  o.listen = TempSocket("badcfg");
  o.config_path = WriteConfig(
      "pools { name: \"ok\" format: \"V41\" block_size: 4 num_blocks: 3 "
      "num_layers: 1 }\n"
      "pools { name: \"bad\" format: \"V41\" block_size: 0 num_blocks: 3 "
      "num_layers: 1 }\n");
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()),
              HasSubstr("--config pools[1]: block_size = 0"));
  o.config_path = WriteConfig("pools { nonsense: 1 }");
  d = Daemon::Start(o);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("textproto"));
}

// One client at its Verify limit must not hold every scan thread.
TEST(DaemonTest, ScanThreadsMustExceedOneClientsVerifyStreams) {
  DaemonOptions o;
  o.listen = TempSocket("scans");
  o.serving.ops_threads = 2;
  o.service.max_verify_streams_per_client = 2;
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()),
              HasSubstr("--ops_threads = 2 must exceed "
                        "--max_verify_streams_per_client = 2"));
  o.serving.ops_threads = 3;
  d = Daemon::Start(o);
  EXPECT_TRUE(d.ok()) << d.status();
}

TEST(DaemonTest, BackendSelection) {
  DaemonOptions o;
  o.listen = TempSocket("backend");
  o.backend = "cuda";
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  EXPECT_FALSE(d.ok());
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("cuda"));
  o.backend = "tpu";
  d = Daemon::Start(o);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("\"tpu\""));
}

TEST(DaemonTest, OwnsItsSocket) {
  const std::string path = TempSocket("own");
  DaemonOptions o;
  o.listen = path;
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->target(), absl::StrCat("unix:", path));
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660);
  // A second daemon on the same live socket is refused.
  absl::StatusOr<std::unique_ptr<Daemon>> second = Daemon::Start(o);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr("another daemon is serving"));
  (*d)->Shutdown();
  EXPECT_NE(stat(path.c_str(), &st), 0);
  // A regular file in the way is not deleted.
  std::ofstream(path) << "x";
  second = Daemon::Start(o);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(stat(path.c_str(), &st), 0);
  unlink(path.c_str());
}

}  // namespace
}  // namespace kvdepot
