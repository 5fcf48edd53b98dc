// End to end, process lifecycle: health and reflection are served; a client
// killed with SIGKILL has its buffers released once its lease runs out (the
// its companion connection closes, its buffers are released and their
// memfds closed); SIGTERM drains (in-flight calls
// finish, later ones get UNAVAILABLE, exit code 0, socket and companion
// removed).
#include <dirent.h>
#include <grpcpp/generic/generic_stub.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"

namespace kvdepot::testing {
namespace {

// Descriptors `pid` holds open.
int OpenFds(pid_t pid) {
  int n = 0;
  DIR* d = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (d == nullptr) return -1;
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n;
}

// Waits until `done()` holds or the deadline passes; returns done().
template <typename F>
bool WaitFor(F done, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() > deadline) return done();
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

// Reads lines from `fd` until one equals "ready" (or the deadline passes).
std::vector<std::string> ReadUntilReady(int fd, absl::Duration timeout) {
  std::string text;
  const absl::Time deadline = absl::Now() + timeout;
  while (text.find("ready\n") == std::string::npos && absl::Now() < deadline) {
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    char buf[256];
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

// grpc.health.v1.Health/Check with an empty request (service ""): the reply
// is HealthCheckResponse, field 1 = status (1 = SERVING, 2 = NOT_SERVING).
absl::StatusOr<std::string> HealthCheck(const std::string& socket) {
  auto channel = grpc::CreateChannel(absl::StrCat("unix:", socket),
                                     grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::ByteBuffer request, response;
  grpc::Slice empty("");
  request = grpc::ByteBuffer(&empty, 1);
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(),
                 &request, &response, [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        status.error_message());
  }
  std::vector<grpc::Slice> slices;
  (void)response.Dump(&slices);
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return bytes;
}

// grpc.reflection.v1alpha list_services over a generic bidi stream; returns
// the raw ServerReflectionResponse bytes.
absl::StatusOr<std::string> ListServicesByReflection(
    const std::string& socket) {
  auto channel = grpc::CreateChannel(absl::StrCat("unix:", socket),
                                     grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::CompletionQueue cq;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call = stub.PrepareCall(
      &ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      &cq);
  void* tag = nullptr;
  bool ok = false;
  // Each step waits for its own completion (tags 1..5, in order).
  auto step = [&](intptr_t want) {
    return cq.Next(&tag, &ok) && ok && reinterpret_cast<intptr_t>(tag) == want;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  if (!step(1)) return absl::UnavailableError("StartCall failed");
  // ServerReflectionRequest { list_services: "" } = field 7, empty string.
  grpc::Slice req_slice(std::string("\x3a\x00", 2));
  grpc::ByteBuffer request(&req_slice, 1);
  call->Write(request, reinterpret_cast<void*>(2));
  if (!step(2)) return absl::UnavailableError("Write failed");
  call->WritesDone(reinterpret_cast<void*>(3));
  if (!step(3)) return absl::UnavailableError("WritesDone failed");
  grpc::ByteBuffer response;
  call->Read(&response, reinterpret_cast<void*>(4));
  if (!step(4)) return absl::UnavailableError("Read failed");
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  cq.Next(&tag, &ok);
  std::vector<grpc::Slice> slices;
  (void)response.Dump(&slices);
  std::string bytes;
  for (const grpc::Slice& sl : slices) {
    bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  return bytes;
}

TEST(LifecycleTest, ReflectionListsTheService) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start();
  ASSERT_TRUE(d.ok()) << d.status();
  absl::StatusOr<std::string> services =
      ListServicesByReflection((*d)->socket_path());
  ASSERT_TRUE(services.ok()) << services.status();
  EXPECT_NE(services->find("kvdepot.v1.KVCache"), std::string::npos);
  EXPECT_NE(services->find("grpc.health.v1.Health"), std::string::npos);
}

// --nogrpc_reflection: no reflection service, health still answers.
TEST(LifecycleTest, ReflectionCanBeTurnedOff) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
      DaemonProcess::Start({"--nogrpc_reflection"});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(ListServicesByReflection((*d)->socket_path()).ok());
  absl::StatusOr<std::string> health = HealthCheck((*d)->socket_path());
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, std::string("\x08\x01", 2));  // status: SERVING
}

TEST(LifecycleTest, HealthIsServing) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start();
  ASSERT_TRUE(d.ok()) << d.status();
  absl::StatusOr<std::string> health = HealthCheck((*d)->socket_path());
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, std::string("\x08\x01", 2));  // status: SERVING
  // The socket is group-accessible, not world-accessible.
  struct stat st;
  ASSERT_EQ(stat((*d)->socket_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660);
}

TEST(LifecycleTest, KilledClientLeavesNothingBehind) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
      DaemonProcess::Start({"--reap_interval_ms=50"});
  ASSERT_TRUE(d.ok()) << d.status();
  int out_fd = -1;
  absl::StatusOr<pid_t> child =
      Spawn({"tests/lease_client", (*d)->socket_path(), "600"}, &out_fd);
  ASSERT_TRUE(child.ok()) << child.status();
  const std::vector<std::string> lines =
      ReadUntilReady(out_fd, absl::Seconds(60));
  close(out_fd);
  ASSERT_EQ(lines.size(), 3u);
  ASSERT_EQ(lines[2], "ready");
  std::unique_ptr<KVCacheClient> observer = ConnectOrDie((*d)->socket_path());
  ASSERT_NE(observer, nullptr);
  // The child's session holds its two buffers for as long as its companion
  // connection lives (no lease to renew).
  absl::StatusOr<v1::StatsResponse> before = observer->Stats();
  ASSERT_TRUE(before.ok());
  EXPECT_EQ(before->buffers(), 2);
  EXPECT_EQ(before->sessions(), 2);
  const int daemon_fds = OpenFds((*d)->pid());

  kill(*child, SIGKILL);
  absl::StatusOr<int> code = WaitForExit(*child, absl::Seconds(10));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 128 + SIGKILL);
  // The connection closed: the session and its buffers are released and
  // the daemon closed their memfds (its connection and two buffers).
  EXPECT_TRUE(WaitFor(
      [&] {
        absl::StatusOr<v1::StatsResponse> s = observer->Stats();
        return s.ok() && s->buffers() == 0;
      },
      absl::Seconds(30)));
  EXPECT_TRUE(WaitFor([&] { return OpenFds((*d)->pid()) <= daemon_fds - 3; },
                      absl::Seconds(30)));
  absl::StatusOr<v1::StatsResponse> stats = observer->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->buffers(), 0);
  EXPECT_EQ(stats->sessions(), 1);  // the observer's
}

TEST(LifecycleTest, SigtermDrainsAndExitsZero) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start();
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string socket = (*d)->socket_path();
  std::unique_ptr<KVCacheClient> admin = ConnectOrDie(socket);
  ASSERT_NE(admin, nullptr);
  absl::StatusOr<v1::PoolInfo> pool =
      admin->CreatePool(PoolRequest("big", "V41", 0, 64, 256, 1));
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_FALSE(pool->has_handle());  // never named (SPEC §11)
  const int32_t rows = 64 * 256;
  std::vector<int32_t> segs;
  for (int32_t b = 0; b < 256; ++b) segs.insert(segs.end(), {b, 0, 64, b * 64});

  constexpr int kThreads = 3;
  std::atomic<int> completed{0};
  std::atomic<int> unexpected{0};
  std::vector<std::thread> threads;
  std::vector<std::unique_ptr<KVCacheClient>> clients;
  for (int i = 0; i < kThreads; ++i) {
    clients.push_back(ConnectOrDie(socket));
    ASSERT_NE(clients.back(), nullptr);
  }
  std::vector<std::unique_ptr<BufferMapping>> outs;
  for (int i = 0; i < kThreads; ++i) {
    absl::StatusOr<BufferMapping> b =
        clients[i]->AllocateBuffer(int64_t{rows} * 1024);
    ASSERT_TRUE(b.ok()) << b.status();
    outs.push_back(std::make_unique<BufferMapping>(*std::move(b)));
  }
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      while (true) {
        v1::LoadRequest r;
        r.set_pool("big");
        *r.mutable_segments() = SegmentsProto(segs, rows);
        *r.mutable_data() = outs[i]->Slice(0, int64_t{rows} * 1024);
        absl::StatusOr<v1::LoadResponse> s = clients[i]->Load(r);
        if (s.ok()) {
          completed.fetch_add(1);
          continue;
        }
        if (s.status().code() != absl::StatusCode::kUnavailable) {
          ADD_FAILURE() << s.status();
          unexpected.fetch_add(1);
        }
        return;
      }
    });
  }
  ASSERT_TRUE(WaitFor([&] { return completed.load() >= 2 * kThreads; },
                      absl::Seconds(60)));
  absl::StatusOr<int> code = (*d)->Signal(SIGTERM, absl::Seconds(60));
  for (std::thread& t : threads) t.join();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_EQ(unexpected.load(), 0);
  struct stat st;
  EXPECT_NE(stat(socket.c_str(), &st), 0) << "socket file left behind";
  const std::string companion =
      absl::StrCat(socket.substr(0, socket.size() - 5), ".ctl");
  EXPECT_NE(stat(companion.c_str(), &st), 0) << "companion socket left behind";
  EXPECT_EQ(admin->Ping().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvdepot::testing
