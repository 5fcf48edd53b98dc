// Limits that hold whatever clients do: 100 clients each open a Verify
// stream and never read it (every stream pins a handler thread once its flow
// control window fills). The daemon's threads stay within --max_threads plus
// its fixed ones (the excess calls wait for a thread), and once the clients
// go away a new client is served. Then each per-client and global count
// limit attacked (pools, descriptors per companion connection and of all
// pools and buffers, concurrent Verify streams per client):
// RESOURCE_EXHAUSTED with a message naming the limit, counted under its
// reason, nothing else affected; the descriptor flags and a limit that
// leaves nothing; the reply budget's flags (its limits:
// e2e_reply_budget_test); and floods of the metrics port and of the gRPC
// socket against a daemon at RLIMIT_NOFILE 1024.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/kvdepot_client.h"
#include "common/memfd.h"
#include "gtest/gtest.h"
#include "kvdepot/v1/kvdepot.grpc.pb.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"

namespace kvdepot {
namespace {

int Threads(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line)) {
    int n = 0;
    if (line.rfind("Threads:", 0) == 0 &&
        absl::SimpleAtoi(line.substr(8), &n)) {
      return n;
    }
  }
  return -1;
}

TEST(LimitsTest, UnreadStreamsCannotTakeMoreThreadsThanTheQuota) {
  constexpr int kMaxThreads = 16;
  absl::StatusOr<std::unique_ptr<testing::DaemonProcess>> d =
      testing::DaemonProcess::Start(
          {"--backend=cpu", absl::StrCat("--max_threads=", kMaxThreads)});
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string target = "unix:" + (*d)->socket_path();
  const int idle_threads = Threads((*d)->pid());
  ASSERT_GT(idle_threads, 0);
  {
    ClientOptions co;
    co.address = target;
    absl::StatusOr<std::unique_ptr<KVCacheClient>> c =
        KVCacheClient::Connect(co);
    ASSERT_TRUE(c.ok()) << c.status();
    v1::CreatePoolRequest r;  // 1M blocks of 1 token: 1M progress messages
    r.set_name("wide");
    r.set_format("BF16");
    r.set_elements(2);
    r.set_block_size(1);
    r.set_num_blocks(1 << 20);
    r.set_num_layers(1);
    ASSERT_TRUE((*c)->CreatePool(r).ok());
  }

  struct Stream {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::KVCache::Stub> stub;
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::VerifyProgress>> reader;
  };
  std::vector<std::unique_ptr<Stream>> streams;
  int peak = 0;
  for (int i = 0; i < 100; ++i) {
    auto s = std::make_unique<Stream>();
    grpc::ChannelArguments args;
    args.SetInt("kvdepot.test.connection", i);  // one connection each
    s->channel = grpc::CreateCustomChannel(
        target, grpc::InsecureChannelCredentials(), args);
    s->stub = v1::KVCache::NewStub(s->channel);
    v1::VerifyRequest req;
    req.set_pool("wide");
    req.set_progress_every(1);
    s->reader = s->stub->Verify(&s->ctx, req);
    streams.push_back(std::move(s));
    peak = std::max(peak, Threads((*d)->pid()));
  }
  const absl::Time until = absl::Now() + absl::Seconds(3);
  while (absl::Now() < until) {
    peak = std::max(peak, Threads((*d)->pid()));
    absl::SleepFor(absl::Milliseconds(20));
  }
  // The quota counts the server's pollers and handlers; gRPC adds a few
  // executor threads of its own under load (seen: up to 5). Without the
  // quota the 100 streams took 100 handler threads.
  EXPECT_LE(peak, idle_threads + kMaxThreads + 8)
      << "100 unread streams took " << peak << " threads (idle " << idle_threads
      << ", quota " << kMaxThreads << ")";
  // The calls beyond the quota wait for a thread; cancelling them all
  // frees the daemon.
  for (auto& s : streams) {
    s->ctx.TryCancel();
    s->reader->Finish();
  }
  streams.clear();

  ClientOptions co;
  co.address = target;
  absl::StatusOr<std::unique_ptr<KVCacheClient>> c = KVCacheClient::Connect(co);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::Status ping;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  do {
    ping = (*c)->Ping();
  } while (!ping.ok() && absl::Now() < deadline);
  EXPECT_TRUE(ping.ok()) << "the daemon did not recover: " << ping;
}

std::unique_ptr<KVCacheClient> Connect(const testing::DaemonProcess& d) {
  ClientOptions co;
  co.address = "unix:" + d.socket_path();
  absl::StatusOr<std::unique_ptr<KVCacheClient>> c = KVCacheClient::Connect(co);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

v1::CreatePoolRequest SmallPool(const std::string& name, int64_t blocks = 2) {
  v1::CreatePoolRequest r;
  r.set_name(name);
  r.set_format("BF16");
  r.set_elements(2);
  r.set_block_size(1);
  r.set_num_blocks(blocks);
  r.set_num_layers(1);
  return r;
}

using testing::Rejections;

void ExpectLimit(const absl::Status& s, const std::string& names) {
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), names)) << s;
}

TEST(LimitsTest, PoolCountIsGlobal) {
  absl::StatusOr<std::unique_ptr<testing::DaemonProcess>> d =
      testing::DaemonProcess::Start({"--backend=cpu", "--max_pools=3"});
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<KVCacheClient> a = Connect(**d);
  std::unique_ptr<KVCacheClient> b = Connect(**d);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(a->CreatePool(SmallPool("p0")).ok());
  ASSERT_TRUE(a->CreatePool(SmallPool("p1")).ok());
  ASSERT_TRUE(b->CreatePool(SmallPool("p2")).ok());
  ExpectLimit(a->CreatePool(SmallPool("p3")).status(), "--max_pools = 3");
  ExpectLimit(b->CreatePool(SmallPool("p4")).status(), "--max_pools = 3");
  // Nothing was added, the existing pools still serve, a freed slot is
  // taken again.
  absl::StatusOr<v1::ListPoolsResponse> list = a->ListPools();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->pools_size(), 3);
  EXPECT_EQ(a->GetPool("p3").status().code(), absl::StatusCode::kNotFound);
  v1::InspectRequest inspect;
  inspect.set_pool("p2");
  inspect.set_slot(1);
  grpc::ClientContext ictx;
  ictx.AddMetadata("kvdepot-session-id", b->session_id());
  v1::InspectResponse inspected;
  EXPECT_TRUE(b->stub()->Inspect(&ictx, inspect, &inspected).ok());
  EXPECT_EQ(Rejections(*a, "limit_pools"), 2);
  ASSERT_TRUE(a->DeletePool("p0").ok());
  EXPECT_TRUE(b->CreatePool(SmallPool("p3")).ok());
}

TEST(LimitsTest, DescriptorsPerCompanionConnection) {
  absl::StatusOr<std::unique_ptr<testing::DaemonProcess>> d =
      testing::DaemonProcess::Start(
          {"--backend=cpu", "--max_descriptors_per_connection=2"});
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<KVCacheClient> a = Connect(**d);
  std::unique_ptr<KVCacheClient> b = Connect(**d);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  absl::StatusOr<BufferMapping> a0 = a->AllocateBuffer(4096);
  ASSERT_TRUE(a0.ok()) << a0.status();
  absl::StatusOr<MemfdRegion> own = MemfdRegion::Create("mine", 4096);
  ASSERT_TRUE(own.ok());
  ASSERT_TRUE(a->ImportBuffer(*own).ok());
  const std::string names = "--max_descriptors_per_connection = 2";
  ExpectLimit(a->AllocateBuffer(4096).status(), names);
  absl::StatusOr<MemfdRegion> more = MemfdRegion::Create("more", 4096);
  ASSERT_TRUE(more.ok());
  ExpectLimit(a->ImportBuffer(*more).status(), names);
  // Another connection has its own descriptors.
  EXPECT_TRUE(b->AllocateBuffer(4096).ok());
  EXPECT_TRUE(b->ImportBuffer(*more).ok());
  absl::StatusOr<v1::StatsResponse> st = a->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->buffers(), 4);
  EXPECT_EQ(Rejections(*a, "limit_descriptors_per_connection"), 2);
  // Released, a descriptor may be taken again.
  ASSERT_TRUE(a->ReleaseBuffer(a0->id()).ok());
  EXPECT_TRUE(a->AllocateBuffer(4096).ok());
}

// The descriptors the daemon's pools and buffers hold are budgeted
// (--max_descriptors), across connections and sessions: allocated and
// imported buffers and pools count, a refusal names the flag and is
// counted, Stats reports the figures, a release makes room again.
TEST(LimitsTest, DescriptorsOfPoolsAndBuffersAreBudgeted) {
  absl::StatusOr<std::unique_ptr<testing::DaemonProcess>> d =
      testing::DaemonProcess::Start({"--backend=cpu", "--max_descriptors=3"});
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<KVCacheClient> a = Connect(**d);
  std::unique_ptr<KVCacheClient> b = Connect(**d);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  absl::StatusOr<BufferMapping> a0 = a->AllocateBuffer(4096);
  ASSERT_TRUE(a0.ok()) << a0.status();
  absl::StatusOr<MemfdRegion> own = MemfdRegion::Create("mine", 4096);
  ASSERT_TRUE(own.ok());
  ASSERT_TRUE(b->ImportBuffer(*own).ok());
  ASSERT_TRUE(b->CreatePool(SmallPool("p0")).ok());
  const std::string names = "--max_descriptors = 3";
  ExpectLimit(a->AllocateBuffer(4096).status(), names);
  ExpectLimit(b->CreatePool(SmallPool("p1")).status(), names);
  absl::StatusOr<MemfdRegion> more = MemfdRegion::Create("more", 4096);
  ASSERT_TRUE(more.ok());
  const absl::Status imported = b->ImportBuffer(*more).status();
  ExpectLimit(imported, names);
  EXPECT_TRUE(absl::StrContains(imported.message(), "import_buffer.fd"))
      << imported;
  absl::StatusOr<v1::StatsResponse> st = a->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->descriptors_held(), 3);
  EXPECT_EQ(st->descriptors_limit(), 3);
  EXPECT_EQ(st->buffers(), 2);
  EXPECT_EQ(st->pools(), 1);
  EXPECT_EQ(Rejections(*a, "limit_descriptors"), 3);
  // Released, a descriptor may be taken again, by anyone.
  ASSERT_TRUE(a->ReleaseBuffer(a0->id()).ok());
  EXPECT_TRUE(b->AllocateBuffer(4096).ok());
  st = a->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->descriptors_held(), 3);
}

// kvdepotd run as a child with `args`, under RLIMIT_NOFILE `nofile` (soft
// and hard, set by util-linux's prlimit) when > 0: its exit code and what
// it printed. The daemon must exit by itself.
struct Exit {
  int code = -1;
  std::string output;
};
Exit RunDaemon(std::vector<std::string> args, int nofile = 0) {
  args.insert(args.begin(), std::string(testing::kDaemonBinary));
  args.push_back("--listen=" + testing::FreshSocketPath());
  if (nofile > 0) {
    args.insert(args.begin(), {"/usr/bin/prlimit",
                               absl::StrCat("--nofile=", nofile, ":", nofile)});
  }
  int out_fd = -1;
  absl::StatusOr<pid_t> child = testing::Spawn(args, &out_fd, true);
  Exit e;
  if (!child.ok()) return e;
  char buf[4096];
  ssize_t n;
  while ((n = read(out_fd, buf, sizeof(buf))) > 0) e.output.append(buf, n);
  close(out_fd);
  absl::StatusOr<int> code = testing::WaitForExit(*child, absl::Seconds(30));
  e.code = code.ok() ? *code : -1;
  return e;
}

TEST(LimitsTest, DescriptorFlagsAndLimitsThatLeaveNothingAreRefused) {
  const Exit negative = RunDaemon({"--backend=cpu", "--max_descriptors=-1"});
  EXPECT_EQ(negative.code, 2) << negative.output;
  EXPECT_TRUE(absl::StrContains(negative.output, "--max_descriptors must be"))
      << negative.output;
  // The default keeps at least 512 for connections: under 400 descriptors
  // (soft and hard) nothing is left for pools and buffers.
  const Exit tiny = RunDaemon({"--backend=cpu"}, 400);
  EXPECT_EQ(tiny.code, 1) << tiny.output;
  EXPECT_TRUE(absl::StrContains(tiny.output, "RLIMIT_NOFILE is 400"))
      << tiny.output;
}

TEST(LimitsTest, ReplyAndRequestMemoryFlagsAreChecked) {
  for (const char* flag : {"--max_reply_bytes=0", "--max_reply_bytes=-5",
                           "--max_reply_bytes_per_client=-1"}) {
    const Exit e = RunDaemon({"--backend=cpu", flag});
    EXPECT_EQ(e.code, 2) << flag << ": " << e.output;
    EXPECT_TRUE(absl::StrContains(e.output, "--max_reply_bytes must be > 0"))
        << flag << ": " << e.output;
  }
  const Exit small = RunDaemon({"--backend=cpu", "--grpc_memory_bytes=1000",
                                "--max_message_bytes=4096"});
  EXPECT_EQ(small.code, 2) << small.output;
  EXPECT_TRUE(
      absl::StrContains(small.output, "--grpc_memory_bytes must be at least"))
      << small.output;
}

TEST(LimitsTest, ConnectionAndCompanionFlagsAreChecked) {
  const Exit conns =
      RunDaemon({"--backend=cpu", "--max_connections_per_uid=-1"});
  EXPECT_EQ(conns.code, 2) << conns.output;
  EXPECT_TRUE(
      absl::StrContains(conns.output, "--max_connections_per_uid must be >= 0"))
      << conns.output;
  const Exit logs =
      RunDaemon({"--backend=cpu", "--client_log_lines_per_second=-1"});
  EXPECT_EQ(logs.code, 2) << logs.output;
  EXPECT_TRUE(absl::StrContains(logs.output,
                                "--client_log_lines_per_second must be >= 0"))
      << logs.output;
  for (const char* flag : {"--max_companion_connections_per_uid=-1",
                           "--companion_hello_timeout_ms=0"}) {
    const Exit e = RunDaemon({"--backend=cpu", flag});
    EXPECT_EQ(e.code, 2) << flag << ": " << e.output;
    EXPECT_TRUE(absl::StrContains(
        e.output, "--max_companion_connections_per_uid must be >= 0"))
        << flag << ": " << e.output;
  }
}

int OpenDescriptors(pid_t pid) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(
           absl::StrCat("/proc/", pid, "/fd"))) {
    (void)e;
    ++n;
  }
  return n;
}

// A free TCP port on the loopback (bound and closed; the daemon binds it
// right after).
int FreeLoopbackPort() {
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (s < 0 || bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (s >= 0) close(s);
    return -1;
  }
  close(s);
  return ntohs(a.sin_port);
}

// Raises this process's soft RLIMIT_NOFILE for `needed` descriptors for
// its own life and restores it after, also when an assertion ends the test
// early. ok() is false when the hard limit is too low (or the call fails).
class ScopedDescriptorLimit {
 public:
  explicit ScopedDescriptorLimit(rlim_t needed) {
    if (getrlimit(RLIMIT_NOFILE, &own_) != 0) return;
    if (own_.rlim_max != RLIM_INFINITY && own_.rlim_max < needed) return;
    rlimit raised = own_;
    raised.rlim_cur = own_.rlim_max == RLIM_INFINITY ? needed : own_.rlim_max;
    ok_ = setrlimit(RLIMIT_NOFILE, &raised) == 0;
  }
  ScopedDescriptorLimit(const ScopedDescriptorLimit&) = delete;
  ScopedDescriptorLimit& operator=(const ScopedDescriptorLimit&) = delete;
  ~ScopedDescriptorLimit() {
    if (ok_) setrlimit(RLIMIT_NOFILE, &own_);
  }
  bool ok() const { return ok_; }
  rlim_t hard() const { return own_.rlim_max; }

 private:
  rlimit own_{};
  bool ok_ = false;
};

// Anyone who reaches the metrics port opens connections and sends nothing,
// faster than the endpoint's threads time them out, against a daemon whose
// RLIMIT_NOFILE is 1024. Had the endpoint queued them all, the daemon would
// run out of descriptors and gRPC would stop accepting connections for
// good (tcp_server_posix drops a listener after accept4 fails with
// EMFILE). The daemon holds a bounded number of descriptors throughout,
// and clients connect during and after the flood.
TEST(LimitsTest, AMetricsPortFloodLeavesTheDaemonReachable) {
  constexpr int kFlood = 2000;
  const ScopedDescriptorLimit limit(kFlood + 256);
  if (!limit.ok()) {
    GTEST_SKIP() << "RLIMIT_NOFILE's hard limit " << limit.hard()
                 << " is too low for the flood";
  }
  const int port = FreeLoopbackPort();
  ASSERT_GT(port, 0);
  absl::StatusOr<std::unique_ptr<testing::DaemonProcess>> d =
      testing::DaemonProcess::Start(
          {"--backend=cpu",
           absl::StrCat("--metrics_address=127.0.0.1:", port)});
  ASSERT_TRUE(d.ok()) << d.status();
  const rlimit low = {1024, 1024};
  ASSERT_EQ(prlimit((*d)->pid(), RLIMIT_NOFILE, &low, nullptr), 0);
  const int idle = OpenDescriptors((*d)->pid());

  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  to.sin_port = htons(static_cast<uint16_t>(port));
  std::vector<int> flood;
  int peak = 0;
  for (int i = 0; i < kFlood; ++i) {
    const int s = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    ASSERT_GE(s, 0) << std::strerror(errno);
    (void)connect(s, reinterpret_cast<const sockaddr*>(&to), sizeof(to));
    flood.push_back(s);
    if (i % 100 == 99) {
      absl::SleepFor(absl::Milliseconds(20));  // let the acceptor run
      peak = std::max(peak, OpenDescriptors((*d)->pid()));
    }
  }
  for (int i = 0; i < 20; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    peak = std::max(peak, OpenDescriptors((*d)->pid()));
  }
  // Its 64 connection threads and 64 waiting connections at most.
  EXPECT_LT(peak, idle + 2 * 64 + 32) << "idle " << idle;
  {
    std::unique_ptr<KVCacheClient> during = Connect(**d);
    ASSERT_NE(during, nullptr);
    EXPECT_TRUE(during->Ping().ok());
  }
  for (int s : flood) close(s);
  std::unique_ptr<KVCacheClient> after = Connect(**d);
  ASSERT_NE(after, nullptr);
  EXPECT_TRUE(after->Ping().ok());
}

// A local client opens more connections to the gRPC socket than the
// daemon has descriptors (RLIMIT_NOFILE 1024). gRPC's own listener would
// drop the socket for good at the first EMFILE; the daemon's refuses the
// connections past its headroom (counted) and serves again once they go.
TEST(LimitsTest, AConnectionFloodLeavesTheDaemonReachable) {
  constexpr int kFlood = 1200;
  const ScopedDescriptorLimit limit(kFlood + 256);
  if (!limit.ok()) {
    GTEST_SKIP() << "RLIMIT_NOFILE's hard limit " << limit.hard()
                 << " is too low for the flood";
  }
  // One uid floods here: without its own cap (256 at the default,
  // e2e_access_test) the descriptor headroom is what refuses.
  absl::StatusOr<std::unique_ptr<testing::DaemonProcess>> d =
      testing::DaemonProcess::Start(
          {"--backend=cpu", "--max_connections_per_uid=0"});
  ASSERT_TRUE(d.ok()) << d.status();
  const rlimit low = {1024, 1024};
  ASSERT_EQ(prlimit((*d)->pid(), RLIMIT_NOFILE, &low, nullptr), 0);
  // The daemon reads the limit per connection: it refuses from descriptor
  // 1024 - 256 on, and a connection that finds none left at all (EMFILE)
  // is taken with a spare descriptor and closed.
  sockaddr_un to{};
  to.sun_family = AF_UNIX;
  const std::string& path = (*d)->socket_path();
  ASSERT_LT(path.size(), sizeof(to.sun_path));
  std::memcpy(to.sun_path, path.data(), path.size());
  std::vector<int> flood;
  for (int i = 0; i < kFlood; ++i) {
    const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(s, 0) << std::strerror(errno);
    if (connect(s, reinterpret_cast<const sockaddr*>(&to), sizeof(to)) != 0) {
      close(s);  // the backlog is full: refused connections make room
      absl::SleepFor(absl::Milliseconds(1));
      continue;
    }
    flood.push_back(s);
  }
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_LE(OpenDescriptors((*d)->pid()), 1024);
  for (int s : flood) close(s);
  absl::SleepFor(absl::Milliseconds(500));
  std::unique_ptr<KVCacheClient> after = Connect(**d);
  ASSERT_NE(after, nullptr);
  EXPECT_TRUE(after->Ping().ok());
  EXPECT_GT(Rejections(*after, "limit_connections"), 0);
}

// The same on plain loopback TCP, which gRPC's own listener served before
// the daemon accepted it itself: a flood past the daemon's descriptors
// made gRPC drop the port at the first EMFILE, and nobody could connect
// again once the flood was gone (seen with ~20,000 connections). Now the
// connections past the headroom are refused and the port keeps serving.
TEST(LimitsTest, APlainTcpFloodLeavesTheDaemonReachable) {
  constexpr int kFlood = 1200;
  const ScopedDescriptorLimit limit(kFlood + 256);
  if (!limit.ok()) {
    GTEST_SKIP() << "RLIMIT_NOFILE's hard limit " << limit.hard()
                 << " is too low for the flood";
  }
  const int port = FreeLoopbackPort();
  ASSERT_GT(port, 0);
  // Without the cap on plain TCP clients together (256 at the default) the
  // descriptor headroom is what refuses.
  absl::StatusOr<pid_t> pid =
      testing::Spawn({testing::kDaemonBinary, "--backend=cpu",
                      absl::StrCat("--listen=127.0.0.1:", port),
                      "--max_connections_per_uid=0"},
                     nullptr);
  ASSERT_TRUE(pid.ok()) << pid.status();
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  to.sin_port = htons(static_cast<uint16_t>(port));
  bool up = false;
  for (const absl::Time end = absl::Now() + absl::Seconds(60);
       !up && absl::Now() < end;) {
    const int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    up = connect(s, reinterpret_cast<const sockaddr*>(&to), sizeof(to)) == 0;
    close(s);
    if (!up) absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(up) << "the daemon did not listen on port " << port;
  const rlimit low = {1024, 1024};
  ASSERT_EQ(prlimit(*pid, RLIMIT_NOFILE, &low, nullptr), 0);
  std::vector<int> flood;
  for (int i = 0; i < kFlood; ++i) {
    const int s =
        socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    ASSERT_GE(s, 0) << std::strerror(errno);
    (void)connect(s, reinterpret_cast<const sockaddr*>(&to), sizeof(to));
    flood.push_back(s);
    if (i % 100 == 99) absl::SleepFor(absl::Milliseconds(20));
  }
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_LE(OpenDescriptors(*pid), 1024);
  for (int s : flood) close(s);
  ClientOptions co;
  co.address = absl::StrCat("127.0.0.1:", port);
  std::unique_ptr<KVCacheClient> after;
  for (const absl::Time end = absl::Now() + absl::Seconds(30);
       after == nullptr && absl::Now() < end;) {
    absl::StatusOr<std::unique_ptr<KVCacheClient>> c =
        KVCacheClient::Connect(co);
    if (c.ok() && (*c)->Ping().ok()) {
      after = *std::move(c);
    } else {
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
  ASSERT_NE(after, nullptr) << "the TCP port stopped serving";
  EXPECT_GT(Rejections(*after, "limit_connections"), 0);
  after.reset();
  kill(*pid, SIGTERM);
  absl::StatusOr<int> code = testing::WaitForExit(*pid, absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

// A Verify stream of `pool` with `session_id` in the metadata, read until
// its first progress message (so the daemon is running it).
struct VerifyStream {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::VerifyProgress>> reader;
  bool started = false;

  VerifyStream(v1::KVCache::Stub* stub, const std::string& session_id,
               const std::string& pool) {
    ctx.AddMetadata("kvdepot-session-id", session_id);
    v1::VerifyRequest r;
    r.set_pool(pool);
    r.set_progress_every(1);
    reader = stub->Verify(&ctx, r);
    v1::VerifyProgress p;
    started = reader->Read(&p);
  }
  grpc::Status Cancel() {
    ctx.TryCancel();
    v1::VerifyProgress p;
    while (reader->Read(&p)) {
    }
    return reader->Finish();
  }
};

TEST(LimitsTest, VerifyStreamsPerClient) {
  const std::string config =
      absl::StrCat(std::getenv("TEST_TMPDIR"), "/limits.textproto");
  std::ofstream(config) << "pools { name: \"v\" format: \"BF16\" elements: 2 "
                           "block_size: 1 num_blocks: 4096 num_layers: 1 }\n"
                           "grants { pool: \"v\" anonymous: true }\n";
  absl::StatusOr<std::unique_ptr<testing::DaemonProcess>> d =
      testing::DaemonProcess::Start({"--backend=cpu",
                                     "--max_verify_streams_per_client=2",
                                     "--testonly_verify_block_delay_ms=20",
                                     absl::StrCat("--config=", config)});
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<KVCacheClient> a = Connect(**d);
  std::unique_ptr<KVCacheClient> a2 = Connect(**d);  // same uid: same client
  ASSERT_NE(a, nullptr);
  ASSERT_NE(a2, nullptr);
  VerifyStream s1(a->stub(), a->session_id(), "v");
  VerifyStream s2(a2->stub(), a2->session_id(), "v");
  ASSERT_TRUE(s1.started);
  ASSERT_TRUE(s2.started);
  VerifyStream s3(a->stub(), a->session_id(), "v");
  EXPECT_FALSE(s3.started);
  grpc::Status refused = s3.reader->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(refused.error_message(),
                                "verify_streams_per_client = 2"))
      << refused.error_message();
  // Another client (an anonymous session) is not affected, nor are other
  // calls of this one.
  grpc::ClientContext open_ctx;
  v1::OpenSessionRequest open;
  v1::OpenSessionResponse anon;
  ASSERT_TRUE(a->stub()->OpenSession(&open_ctx, open, &anon).ok());
  VerifyStream other(a->stub(), anon.session_id(), "v");
  EXPECT_TRUE(other.started);
  EXPECT_TRUE(a->Ping().ok());
  EXPECT_TRUE(a->GetPool("v").ok());
  EXPECT_EQ(Rejections(*a, "limit_verify_streams_per_client"), 1);
  // Once a stream ends its slot is free again.
  s1.Cancel();
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  bool again = false;
  while (!again && absl::Now() < deadline) {
    VerifyStream s4(a->stub(), a->session_id(), "v");
    again = s4.started;
    s4.Cancel();
  }
  EXPECT_TRUE(again);
  s2.Cancel();
  other.Cancel();
}

}  // namespace
}  // namespace kvdepot
