// The daemon's Unix-socket acceptor: connections reach the gRPC server, and
// when the process has no descriptor left the loop takes a waiting
// connection with its spare descriptor, closes it and keeps the socket.
#include "server/grpc_listener.h"

#include <fcntl.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"

namespace kvdepot {
namespace {

std::string SocketPath() {
  char dir[] = "/tmp/kvdepot-listener-XXXXXX";
  EXPECT_NE(mkdtemp(dir), nullptr);
  return absl::StrCat(dir, "/l.sock");
}

int ConnectTo(const std::string& path) {
  const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return -1;
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path, path.data(), path.size());
  if (connect(s, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) != 0) {
    close(s);
    return -1;
  }
  return s;
}

// A server with no ports (the listener brings its connections) and a
// callback generic service that answers every method UNIMPLEMENTED.
class Unimplemented final : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* /*ctx*/) override {
    class Reactor final : public grpc::ServerGenericBidiReactor {
     public:
      Reactor() { Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "")); }
      void OnDone() override { delete this; }
    };
    return new Reactor;
  }
};

// The service must outlive its server, and serves one server only.
class GrpcListenerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.RegisterCallbackGenericService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
    server_.reset();
  }

  Unimplemented service_;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(GrpcListenerTest, ConnectionsReachTheServer) {
  const std::string path = SocketPath();
  absl::StatusOr<std::unique_ptr<GrpcListener>> l =
      GrpcListener::Start(path, server_.get(), {});
  ASSERT_TRUE(l.ok()) << l.status();
  // READY needs the server's HTTP/2 settings: only a server that took the
  // connection sends them.
  std::shared_ptr<grpc::Channel> ch =
      grpc::CreateChannel("unix:" + path, grpc::InsecureChannelCredentials());
  EXPECT_TRUE(ch->WaitForConnected(std::chrono::system_clock::now() +
                                   std::chrono::seconds(10)));
  EXPECT_EQ((*l)->refused(), 0);
  (*l)->Stop();
}

TEST_F(GrpcListenerTest, OutOfDescriptorsRefusesAndKeepsListening) {
  const std::string path = SocketPath();
  GrpcListenerOptions o;
  o.headroom = 0;  // only EMFILE refuses here
  int counted = 0;
  o.on_refused = [&counted] { ++counted; };
  absl::StatusOr<std::unique_ptr<GrpcListener>> l =
      GrpcListener::Start(path, server_.get(), o);
  ASSERT_TRUE(l.ok()) << l.status();

  rlimit own{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &own), 0);
  // Fill the table below a small soft limit, leaving one descriptor: the
  // client's socket takes it, and the listener's accept finds none.
  std::vector<int> filler;
  {
    const int probe = open("/dev/null", O_RDONLY | O_CLOEXEC);
    ASSERT_GE(probe, 0);
    close(probe);
    rlimit low = own;
    low.rlim_cur = static_cast<rlim_t>(probe) + 64;
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  }
  for (;;) {
    const int f = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (f < 0) break;
    filler.push_back(f);
  }
  ASSERT_FALSE(filler.empty());
  close(filler.back());  // one free
  filler.pop_back();
  const int client = ConnectTo(path);
  ASSERT_GE(client, 0) << std::strerror(errno);
  // The listener closes it: the client reads end-of-file.
  char byte = 0;
  timeval tv{5, 0};
  setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  EXPECT_EQ(read(client, &byte, 1), 0) << std::strerror(errno);
  close(client);
  for (int f : filler) close(f);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &own), 0);
  EXPECT_GE((*l)->refused(), 1);
  EXPECT_EQ(counted, (*l)->refused());

  // And the socket still serves.
  std::shared_ptr<grpc::Channel> ch =
      grpc::CreateChannel("unix:" + path, grpc::InsecureChannelCredentials());
  EXPECT_TRUE(ch->WaitForConnected(std::chrono::system_clock::now() +
                                   std::chrono::seconds(10)));
  (*l)->Stop();
}

// True when the listener closed `fd` (the client reads end-of-file), false
// when the server took it (it sends its HTTP/2 settings at once).
bool ClosedByListener(int fd) {
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[256];
  const ssize_t n = read(fd, buf, sizeof(buf));
  EXPECT_GE(n, 0) << "neither closed nor served within 10 s";
  return n == 0;
}

// One uid holds at most max_connections_per_uid connections at once; one
// that gRPC has closed no longer counts.
TEST_F(GrpcListenerTest, OneUidHoldsAtMostItsConnections) {
  const std::string path = SocketPath();
  GrpcListenerOptions o;
  o.max_connections_per_uid = 3;
  int counted = 0, other = 0;
  o.on_refused_per_uid = [&counted] { ++counted; };
  o.on_refused = [&other] { ++other; };
  absl::StatusOr<std::unique_ptr<GrpcListener>> l =
      GrpcListener::Start(path, server_.get(), o);
  ASSERT_TRUE(l.ok()) << l.status();
  std::vector<int> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(ConnectTo(path));
    ASSERT_GE(held.back(), 0);
    EXPECT_FALSE(ClosedByListener(held.back())) << i;
  }
  for (int i = 0; i < 2; ++i) {
    const int extra = ConnectTo(path);
    ASSERT_GE(extra, 0);
    EXPECT_TRUE(ClosedByListener(extra)) << i;
    close(extra);
  }
  EXPECT_EQ(counted, 2);
  EXPECT_EQ(other, 0);
  EXPECT_EQ((*l)->refused(), 2);

  // The client closes one: once gRPC has closed its end, a new one fits.
  close(held.back());
  held.pop_back();
  bool admitted = false;
  for (int attempt = 0; attempt < 50 && !admitted; ++attempt) {
    const int again = ConnectTo(path);
    ASSERT_GE(again, 0);
    if (ClosedByListener(again)) {
      close(again);
      absl::SleepFor(absl::Milliseconds(100));
      continue;
    }
    admitted = true;
    held.push_back(again);
  }
  EXPECT_TRUE(admitted);
  // Still three at most.
  const int extra = ConnectTo(path);
  ASSERT_GE(extra, 0);
  EXPECT_TRUE(ClosedByListener(extra));
  close(extra);
  for (int fd : held) close(fd);
  (*l)->Stop();
}

// The refusal line is written at most once a second; each refusal it
// leaves out is reported to on_log_line_dropped (the daemon counts it as a
// dropped client log line), so lines written plus lines reported is every
// refusal.
TEST_F(GrpcListenerTest, RefusalLinesLeftOutAreCountedAsDropped) {
  std::ostringstream log;
  const std::shared_ptr<spdlog::logger> saved = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>(
      "test", std::make_shared<spdlog::sinks::ostream_sink_mt>(log)));
  const std::string path = SocketPath();
  GrpcListenerOptions o;
  o.max_connections_per_uid = 1;
  int64_t dropped = 0;  // the accept thread's, read after Stop
  o.on_log_line_dropped = [&dropped] { ++dropped; };
  absl::StatusOr<std::unique_ptr<GrpcListener>> l =
      GrpcListener::Start(path, server_.get(), o);
  ASSERT_TRUE(l.ok()) << l.status();
  const int held = ConnectTo(path);
  ASSERT_GE(held, 0);
  EXPECT_FALSE(ClosedByListener(held));
  for (int i = 0; i < 5; ++i) {
    const int extra = ConnectTo(path);
    ASSERT_GE(extra, 0);
    EXPECT_TRUE(ClosedByListener(extra)) << i;
    close(extra);
  }
  close(held);
  (*l)->Stop();
  spdlog::set_default_logger(saved);
  const std::string text = log.str();
  int64_t lines = 0;
  for (size_t at = text.find("rpc=connect"); at != std::string::npos;
       at = text.find("rpc=connect", at + 1)) {
    ++lines;
  }
  EXPECT_EQ((*l)->refused(), 5);
  EXPECT_GE(lines, 1);
  EXPECT_EQ(lines + dropped, (*l)->refused());
}

int ConnectTcp(int port) {
  const int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(s, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) != 0) {
    close(s);
    return -1;
  }
  return s;
}

// Plain TCP: the daemon's own listener too; its clients are anonymous, so
// all of them together hold at most max_connections_per_uid.
TEST_F(GrpcListenerTest, PlainTcpIsServedAndItsClientsTogetherAreBounded) {
  GrpcListenerOptions o;
  o.max_connections_per_uid = 2;
  int counted = 0;
  o.on_refused_per_uid = [&counted] { ++counted; };
  absl::StatusOr<std::unique_ptr<GrpcListener>> l =
      GrpcListener::StartTcp("127.0.0.1", 0, server_.get(), o);
  ASSERT_TRUE(l.ok()) << l.status();
  const int port = (*l)->port();
  ASSERT_GT(port, 0);
  std::shared_ptr<grpc::Channel> ch = grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  EXPECT_TRUE(ch->WaitForConnected(std::chrono::system_clock::now() +
                                   std::chrono::seconds(10)));
  const int second = ConnectTcp(port);
  ASSERT_GE(second, 0);
  EXPECT_FALSE(ClosedByListener(second));
  const int third = ConnectTcp(port);  // the channel and `second` hold two
  ASSERT_GE(third, 0);
  EXPECT_TRUE(ClosedByListener(third));
  EXPECT_EQ(counted, 1);
  // The port is taken while the listener runs: a second one fails.
  absl::StatusOr<std::unique_ptr<GrpcListener>> again =
      GrpcListener::StartTcp("127.0.0.1", port, server_.get(), {});
  ASSERT_FALSE(again.ok());
  EXPECT_THAT(std::string(again.status().message()),
              ::testing::HasSubstr("(another daemon?)"));
  EXPECT_FALSE(
      GrpcListener::StartTcp("127.0.0.1", 70000, server_.get(), {}).ok());
  EXPECT_FALSE(
      GrpcListener::StartTcp("no-such-host.invalid", 0, server_.get(), {})
          .ok());
  close(second);
  close(third);
  (*l)->Stop();
}

// The mutual-TLS port: admitted connections go to `hand_off` (the relay),
// not to the server; the listener's bounds apply to them as to any.
TEST_F(GrpcListenerTest, HandOffTakesAdmittedConnections) {
  GrpcListenerOptions o;
  o.max_connections_per_uid = 1;
  std::atomic<int> handed{0};
  std::vector<int> held;
  absl::Mutex mu;
  o.hand_off = [&](int fd) {
    absl::MutexLock lock(&mu);
    held.push_back(fd);
    handed.fetch_add(1);
  };
  absl::StatusOr<std::unique_ptr<GrpcListener>> l =
      GrpcListener::StartTcp("127.0.0.1", 0, nullptr, o);
  ASSERT_TRUE(l.ok()) << l.status();
  const int first = ConnectTcp((*l)->port());
  ASSERT_GE(first, 0);
  for (int i = 0; i < 1000 && handed.load() == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(handed.load(), 1);
  const int second = ConnectTcp((*l)->port());  // over the bound of one
  ASSERT_GE(second, 0);
  EXPECT_TRUE(ClosedByListener(second));
  EXPECT_EQ(handed.load(), 1);
  (*l)->Stop();
  close(first);
  close(second);
  absl::MutexLock lock(&mu);
  for (int fd : held) close(fd);
}

// Whether a gRPC client reaches `l` at 127.0.0.1 within 10 s.
bool ReachedOverIpv4(GrpcListener& l) {
  std::shared_ptr<grpc::Channel> ch = grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", l.port()), grpc::InsecureChannelCredentials());
  return ch->WaitForConnected(std::chrono::system_clock::now() +
                              std::chrono::seconds(10));
}

// No host (":port") listens on every address, as gRPC's own listener did.
TEST_F(GrpcListenerTest, NoHostListensEverywhere) {
  absl::StatusOr<std::unique_ptr<GrpcListener>> l =
      GrpcListener::StartTcp("", 0, server_.get(), {});
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_TRUE(ReachedOverIpv4(**l));
  (*l)->Stop();
}

// "::" takes IPv4 clients too, as gRPC's own listener did.
TEST_F(GrpcListenerTest, TheIpv6WildcardServesIpv4Too) {
  absl::StatusOr<std::unique_ptr<GrpcListener>> l =
      GrpcListener::StartTcp("::", 0, server_.get(), {});
  if (!l.ok()) GTEST_SKIP() << "no IPv6 here: " << l.status();
  EXPECT_TRUE(ReachedOverIpv4(**l));
  (*l)->Stop();
}

// The names in `dir`.
std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    names.push_back(e.path().filename().string());
  }
  return names;
}

std::string DirOf(const std::string& path) {
  return path.substr(0, path.rfind('/'));
}

// A client that sees the socket's path can connect to it and finds its
// mode: a thread that watches for the path from before Start sees it
// appear listening, with the mode Start was given (bound at the path
// itself, the socket was there before listen() and had the umask's mode
// until a chmod). Nothing else is left in the directory.
void ExpectAppearsReady(grpc::Server* server, const std::string& path,
                        int round) {
  std::atomic<int> seen_mode{-1};
  std::atomic<int> connected{-1};
  std::atomic<bool> give_up{false};  // Start failed: no path will appear
  std::thread watcher([&] {
    struct stat st;
    while (stat(path.c_str(), &st) != 0) {
      if (give_up.load()) return;
    }
    seen_mode = static_cast<int>(st.st_mode & 07777);
    const int s = ConnectTo(path);
    connected = s >= 0 ? 1 : 0;
    if (s >= 0) close(s);
  });
  GrpcListenerOptions o;
  o.unix_mode = 0660;
  o.unix_group = getgid();
  absl::StatusOr<std::unique_ptr<GrpcListener>> l =
      GrpcListener::Start(path, server, o);
  give_up = !l.ok();
  watcher.join();
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(seen_mode.load(), 0660) << "round " << round;
  EXPECT_EQ(connected.load(), 1) << "round " << round;
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_gid, getgid());
  EXPECT_THAT(Entries(DirOf(path)),
              testing::ElementsAre(path.substr(path.rfind('/') + 1)));
  (*l)->Stop();
}

TEST_F(GrpcListenerTest, TheSocketAppearsOnlyWhenItAccepts) {
  for (int round = 0; round < 100; ++round) {
    ExpectAppearsReady(server_.get(), SocketPath(), round);
  }
}

// Where the temporary name beside the path would not fit a sockaddr_un
// (a path of 107 bytes with a one-letter name), the socket is bound at the
// path itself, and still has its mode and group when Start returns.
TEST_F(GrpcListenerTest, APathTooLongForATemporaryNameStillWorks) {
  char base[] = "/tmp/kvdepot-listener-XXXXXX";
  ASSERT_NE(mkdtemp(base), nullptr);
  constexpr size_t kLongest = sizeof(sockaddr_un{}.sun_path) - 1;
  const std::string dir =
      absl::StrCat(base, "/", std::string(kLongest - 2 - sizeof(base), 'd'));
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0) << dir;
  const std::string path = dir + "/s";
  ASSERT_EQ(path.size(), kLongest);
  GrpcListenerOptions o;
  o.unix_mode = 0660;
  absl::StatusOr<std::unique_ptr<GrpcListener>> l =
      GrpcListener::Start(path, server_.get(), o);
  ASSERT_TRUE(l.ok()) << l.status();
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0660);
  const int s = ConnectTo(path);
  EXPECT_GE(s, 0);
  if (s >= 0) close(s);
  EXPECT_THAT(Entries(dir), testing::ElementsAre("s"));
  (*l)->Stop();
}

TEST_F(GrpcListenerTest, APathThatIsTooLongOrTakenIsRefused) {
  EXPECT_EQ(GrpcListener::Start(std::string(200, 'x'), server_.get(), {})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  const std::string path = SocketPath();
  absl::StatusOr<std::unique_ptr<GrpcListener>> first =
      GrpcListener::Start(path, server_.get(), {});
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(GrpcListener::Start(path, server_.get(), {}).status().code(),
            absl::StatusCode::kUnavailable);
  // The refused one left no temporary name behind, and the first still
  // holds the path.
  EXPECT_THAT(Entries(DirOf(path)),
              testing::ElementsAre(path.substr(path.rfind('/') + 1)));
  const int s = ConnectTo(path);
  EXPECT_GE(s, 0);
  if (s >= 0) close(s);
  (*first)->Stop();
}

}  // namespace
}  // namespace kvdepot
