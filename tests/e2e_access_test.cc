// Attacks on identity, ownership and the descriptor path (SPEC §11), each
// against a real kvdepotd child process: another session's buffers, a
// second uid against pools and admin calls, session ids in messages and
// logs, descriptors that are not what they claim, truncated control
// messages, truncation and hole punching after handover, and a closed
// companion connection.
#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/falloc.h>
#include <pwd.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/fd_passing.h"
#include "common/memfd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"

namespace kvdepot::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

int OpenFds(pid_t pid) {
  int n = 0;
  DIR* d = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (d == nullptr) return -1;
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n;
}

// Waits until `pid` holds `want` descriptors (the daemon closes refused
// ones before it replies, but give the scheduler a deadline, not a sleep).
bool FdsSettleAt(pid_t pid, int want) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    if (OpenFds(pid) == want) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

std::string CompanionOf(const std::string& socket) {
  return absl::StrCat(socket.substr(0, socket.size() - 5), ".ctl");
}

// A kvdepotd whose log (stderr) is collected by a reader thread.
class LoggedDaemon {
 public:
  explicit LoggedDaemon(std::vector<std::string> extra = {},
                        std::string socket = FreshSocketPath())
      : socket_(std::move(socket)) {
    std::vector<std::string> argv = {kDaemonBinary,
                                     absl::StrCat("--listen=", socket_)};
    for (std::string& a : extra) argv.push_back(std::move(a));
    int fd = -1;
    absl::StatusOr<pid_t> pid = Spawn(argv, &fd, /*with_stderr=*/true);
    EXPECT_TRUE(pid.ok()) << pid.status();
    pid_ = pid.ok() ? *pid : -1;
    reader_ = std::thread([this, fd] {
      char buf[4096];
      ssize_t n;
      while ((n = read(fd, buf, sizeof(buf))) > 0) {
        absl::MutexLock lock(&mu_);
        log_.append(buf, static_cast<size_t>(n));
      }
      close(fd);
    });
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    struct stat st;
    while (stat(socket_.c_str(), &st) != 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  ~LoggedDaemon() { Stop(); }

  // SIGTERM, wait, and the whole log.
  std::string Stop() {
    if (pid_ > 0) {
      (void)Signal(pid_, SIGTERM);
      pid_ = -1;
    }
    if (reader_.joinable()) reader_.join();
    absl::MutexLock lock(&mu_);
    return log_;
  }
  const std::string& socket() const { return socket_; }
  pid_t pid() const { return pid_; }

 private:
  static absl::StatusOr<int> Signal(pid_t pid, int sig) {
    kill(pid, sig);
    return WaitForExit(pid, absl::Seconds(60));
  }

  std::string socket_;
  pid_t pid_ = -1;
  std::thread reader_;
  absl::Mutex mu_;
  std::string log_ ABSL_GUARDED_BY(mu_);
};

v1::StoreRequest KvStore(const std::string& pool, v1::DataRef kv,
                         int64_t tokens) {
  std::vector<int32_t> slots;
  for (int64_t i = 0; i < tokens; ++i) slots.push_back(static_cast<int32_t>(i));
  v1::StoreRequest r = StoreRequest(pool, 0, slots, v1::INPUT_DTYPE_FP32);
  *r.mutable_kv() = std::move(kv);
  return r;
}

TEST(AccessTest, SessionsCannotTouchEachOthersBuffers) {
  LoggedDaemon d;
  std::unique_ptr<KVCacheClient> a = ConnectOrDie(d.socket());
  std::unique_ptr<KVCacheClient> b = ConnectOrDie(d.socket());
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->CreatePool(PoolRequest("p", "V41", 0, 4, 4, 1)).ok());
  const int64_t bytes = 2 * 512 * 4;
  absl::StatusOr<BufferMapping> abuf = a->AllocateBuffer(bytes);
  ASSERT_TRUE(abuf.ok()) << abuf.status();
  std::mt19937 rng(301);
  const std::vector<float> kv = RandomKv(2, 512, rng);
  std::memcpy(abuf->data(), kv.data(), bytes);

  // B names A's buffer as input and as output, releases and grants it.
  absl::Status s = b->Store(KvStore("p", abuf->Slice(0, bytes), 2)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("kv.slice.buffer_id"));
  v1::LoadRequest lr;
  lr.set_pool("p");
  *lr.mutable_segments() = SegmentsProto({0, 0, 2, 0}, 2);
  *lr.mutable_data() = abuf->Slice(0, 2 * 1024);
  EXPECT_EQ(b->Load(lr).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(b->ReleaseBuffer(abuf->id()).code(), absl::StatusCode::kNotFound);
  v1::GrantRequest g;
  g.set_buffer_id(abuf->id());
  g.add_sessions(b->session_number());
  EXPECT_EQ(b->Grant(g).code(), absl::StatusCode::kPermissionDenied);
  // Nothing was written through the refused requests.
  EXPECT_EQ(0, std::memcmp(abuf->data(), kv.data(), bytes));
  // A request with no session at all.
  v1::StoreRequest nosession = KvStore("p", abuf->Slice(0, bytes), 2);
  grpc::ClientContext ctx;
  v1::StoreResponse out;
  ClientOptions raw;
  raw.address = d.socket();
  raw.open_session = false;
  absl::StatusOr<std::unique_ptr<KVCacheClient>> anon =
      KVCacheClient::Connect(raw);
  ASSERT_TRUE(anon.ok());
  EXPECT_EQ((*anon)->stub()->Store(&ctx, nosession, &out).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);

  // The owner grants B's session: now B may store from it, still not
  // release it.
  ASSERT_TRUE(a->Grant(g).ok());
  EXPECT_TRUE(b->Store(KvStore("p", abuf->Slice(0, bytes), 2)).ok());
  EXPECT_EQ(b->ReleaseBuffer(abuf->id()).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(a->ReleaseBuffer(abuf->id()).ok());

  // Session ids appear in no message and no log line.
  const std::string secret_a =
      a->session_id().substr(a->session_id().find('.') + 1);
  const std::string secret_b =
      b->session_id().substr(b->session_id().find('.') + 1);
  v1::StoreRequest wrong = KvStore("p", abuf->Slice(0, bytes), 2);
  wrong.set_session_id(a->session_id() + "x");
  absl::Status ws = b->Store(wrong).status();
  EXPECT_EQ(ws.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(std::string(ws.message()), Not(HasSubstr(secret_a)));
  a.reset();
  b.reset();
  const std::string log = d.Stop();
  ASSERT_THAT(log, HasSubstr("rpc=Hello"));  // the log was captured
  EXPECT_THAT(log, Not(HasSubstr(secret_a)));
  EXPECT_THAT(log, Not(HasSubstr(secret_b)));
}

// The owner of a pool or a buffer could otherwise grow the daemon without
// end by granting ever new uids or sessions (20 M uids: +300 MB).
TEST(AccessTest, GrantsCannotGrowAnAccessListWithoutBound) {
  LoggedDaemon d;
  std::unique_ptr<KVCacheClient> a = ConnectOrDie(d.socket());
  std::unique_ptr<KVCacheClient> b = ConnectOrDie(d.socket());
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->CreatePool(PoolRequest("p", "V41", 0, 4, 4, 1)).ok());
  v1::GrantRequest g;
  g.set_pool("p");
  for (uint32_t u = 0; u < 257; ++u) g.add_uids(10000 + u);
  absl::Status s = a->Grant(g);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("uids has 257 entries, more than 256"));
  g.mutable_uids()->RemoveLast();
  ASSERT_TRUE(a->Grant(g).ok());
  for (int round = 0; round < 3; ++round) {
    v1::GrantRequest fresh;
    fresh.set_pool("p");
    for (uint32_t u = 0; u < 256; ++u) fresh.add_uids(20000 + 256 * round + u);
    s = a->Grant(fresh);
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("pool \"p\": its access list would hold 512 uids, "
                          "more than 256"));
  }
  EXPECT_EQ(Rejections(*a, "limit_acl_entries"), 3);
  ASSERT_TRUE(a->Grant(g).ok());  // the same uids again: nothing new

  // A buffer: a refused grant lets nobody in, not even the session it
  // names next to too many others.
  absl::StatusOr<BufferMapping> buf = a->AllocateBuffer(2 * 512 * 4);
  ASSERT_TRUE(buf.ok()) << buf.status();
  v1::GrantRequest sessions;
  sessions.set_buffer_id(buf->id());
  for (uint64_t n = 0; n < 256; ++n) sessions.add_sessions(1000000 + n);
  ASSERT_TRUE(a->Grant(sessions).ok());
  v1::GrantRequest with_b;
  with_b.set_buffer_id(buf->id());
  with_b.add_sessions(b->session_number());
  s = a->Grant(with_b);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr(absl::StrCat("buffer_id = ", buf->id(),
                                     ": its access list would hold 257 "
                                     "sessions, more than 256")));
  EXPECT_EQ(
      b->Store(KvStore("p", buf->Slice(0, 2 * 512 * 4), 2)).status().code(),
      absl::StatusCode::kPermissionDenied);
}

TEST(AccessTest, DescriptorsThatAreNotSealedMemfdsAreRefusedWithoutLeaks) {
  LoggedDaemon d;
  std::unique_ptr<KVCacheClient> c = ConnectOrDie(d.socket());
  ASSERT_NE(c, nullptr);
  CompanionConnection* comp = c->companion();
  ASSERT_NE(comp, nullptr);
  const int64_t size = 64 << 10;
  auto import = [&](int fd, int64_t declared) {
    v1::CompanionRequest r;
    r.mutable_import_buffer()->set_size(declared);
    return comp->Call(r, fd, nullptr).status();
  };
  auto memfd = [&](int seals, bool allocate, int64_t sz) {
    UniqueFd fd(memfd_create("atk", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    EXPECT_EQ(ftruncate(fd.get(), sz), 0);
    if (allocate) {
      EXPECT_EQ(fallocate(fd.get(), 0, 0, sz), 0);
    }
    if (seals) {
      EXPECT_EQ(fcntl(fd.get(), F_ADD_SEALS, seals), 0);
    }
    return fd;
  };
  const int before = OpenFds(d.pid());
  struct Case {
    const char* what;
    UniqueFd fd;
    int64_t declared;
    const char* why;
  };
  std::vector<Case> cases;
  const std::string file = absl::StrCat(std::getenv("TEST_TMPDIR"), "/f");
  UniqueFd regular(open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  ASSERT_EQ(ftruncate(regular.get(), size), 0);
  cases.push_back({"regular file", std::move(regular), size, "memfd"});
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  UniqueFd pipe_w(p[1]);
  cases.push_back({"pipe", UniqueFd(p[0]), size, "not a regular file"});
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  UniqueFd sock_other(sv[1]);
  cases.push_back({"socket", UniqueFd(sv[0]), size, "not a regular file"});
  cases.push_back({"unsealed memfd", memfd(0, true, size), size,
                   "sealed against shrinking"});
  cases.push_back({"shrinkable memfd", memfd(F_SEAL_GROW, true, size), size,
                   "sealed against shrinking"});
  cases.push_back({"wrong size", memfd(F_SEAL_SHRINK | F_SEAL_GROW, true, size),
                   size * 2, "not the declared size"});
  cases.push_back({"holes", memfd(F_SEAL_SHRINK | F_SEAL_GROW, false, size),
                   size, "has holes"});
  for (Case& k : cases) {
    absl::Status s = import(k.fd.get(), k.declared);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k.what << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(k.why)) << k.what;
    EXPECT_THAT(std::string(s.message()), HasSubstr("import_buffer.fd"));
  }
  // A pool handed back as one's "own" buffer is refused too.
  ASSERT_TRUE(c->CreatePool(PoolRequest("p", "V41", 0, 4, 4, 1)).ok());
  v1::CompanionRequest map;
  map.mutable_map_pool()->set_name("p");
  UniqueFd pool_fd;
  absl::StatusOr<v1::CompanionReply> mapped = comp->Call(map, -1, &pool_fd);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  EXPECT_EQ(import(pool_fd.get(), mapped->pool().layout().total_bytes()).code(),
            absl::StatusCode::kInvalidArgument);
  pool_fd.reset();
  // Nothing stayed open in the daemon, nothing was added to the session.
  EXPECT_TRUE(FdsSettleAt(d.pid(), before + 1))  // + the pool's own memfd
      << OpenFds(d.pid()) << " vs " << before;
  absl::StatusOr<v1::StatsResponse> st = c->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->buffers(), 0);
}

// The daemon's own memory handed back as a client's (a pool's or an
// allocated buffer's memfd) and one client memfd imported twice (by the
// same session or another) are refused; nothing is added, and a memfd
// whose buffer was released may be imported again.
TEST(AccessTest, DaemonMemoryAndDoubleImportsAreRefused) {
  LoggedDaemon d;
  std::unique_ptr<KVCacheClient> a = ConnectOrDie(d.socket());
  std::unique_ptr<KVCacheClient> b = ConnectOrDie(d.socket());
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const int64_t size = 64 << 10;
  auto import = [](KVCacheClient& c, int fd, int64_t declared) {
    v1::CompanionRequest r;
    r.mutable_import_buffer()->set_size(declared);
    return c.companion()->Call(r, fd, nullptr);
  };
  auto buffers = [&]() {
    absl::StatusOr<v1::StatsResponse> st = a->Stats();
    EXPECT_TRUE(st.ok());
    return st.ok() ? st->buffers() : -1;
  };
  // A buffer the daemon allocated, handed back by its session and another.
  v1::CompanionRequest alloc;
  alloc.mutable_allocate_buffer()->set_size(size);
  UniqueFd daemon_fd;
  ASSERT_TRUE(a->companion()->Call(alloc, -1, &daemon_fd).ok());
  ASSERT_EQ(buffers(), 1);
  for (KVCacheClient* c : {a.get(), b.get()}) {
    absl::StatusOr<v1::CompanionReply> r = import(*c, daemon_fd.get(), size);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()),
                HasSubstr("memory this daemon allocated"));
  }
  // A pool's memfd, likewise.
  ASSERT_TRUE(a->CreatePool(PoolRequest("p", "V41", 0, 4, 4, 1)).ok());
  v1::CompanionRequest map;
  map.mutable_map_pool()->set_name("p");
  UniqueFd pool_fd;
  absl::StatusOr<v1::CompanionReply> mapped =
      a->companion()->Call(map, -1, &pool_fd);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  EXPECT_THAT(std::string(import(*a, pool_fd.get(),
                                 mapped->pool().layout().total_bytes())
                              .status()
                              .message()),
              HasSubstr("memory this daemon allocated"));
  EXPECT_EQ(buffers(), 1);
  // A client's memfd: the first import is accepted, a second one (same
  // session, another session, another descriptor of it) is not.
  absl::StatusOr<MemfdRegion> own = MemfdRegion::Create("own", size);
  ASSERT_TRUE(own.ok());
  absl::StatusOr<v1::CompanionReply> first = import(*a, own->fd(), size);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<UniqueFd> dup = own->Dup();
  ASSERT_TRUE(dup.ok());
  for (KVCacheClient* c : {a.get(), b.get()}) {
    for (int fd : {own->fd(), dup->get()}) {
      absl::StatusOr<v1::CompanionReply> r = import(*c, fd, size);
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(r.status().message()),
                  HasSubstr("already imported"));
    }
  }
  EXPECT_EQ(buffers(), 2);
  // Released, the memfd is the client's alone again: importable once more.
  ASSERT_TRUE(a->ReleaseBuffer(first->buffer().buffer_id()).ok());
  EXPECT_TRUE(import(*b, own->fd(), size).ok());
  EXPECT_EQ(buffers(), 2);
}

// A raw companion connection to the daemon of `daemon_socket`, waiting at most
// 10 s in each receive (a test never hangs on a daemon that keeps it).
UniqueFd RawCompanion(const std::string& daemon_socket) {
  UniqueFd s(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  struct sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  const std::string path = CompanionOf(daemon_socket);
  std::memcpy(addr.sun_path, path.data(), path.size());
  EXPECT_EQ(connect(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)),
            0);
  timeval tv{10, 0};
  setsockopt(s.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return s;
}

// One uid could take all 256 companion connections with connections that
// never say Hello, locking every other worker out. Now each uid holds at
// most --max_companion_connections_per_uid, and a connection without a
// Hello is closed after --companion_hello_timeout_ms.
TEST(AccessTest, OneUidCannotHoldEveryCompanionConnection) {
  LoggedDaemon d({"--max_companion_connections_per_uid=4",
                  "--companion_hello_timeout_ms=1500"});
  std::vector<UniqueFd> idle;
  for (int i = 0; i < 4; ++i) idle.push_back(RawCompanion(d.socket()));
  // The fifth is closed at once (the daemon accepts in order).
  UniqueFd fifth = RawCompanion(d.socket());
  absl::StatusOr<ReceivedMessage> m = ReceiveMessage(fifth.get(), 1 << 16, 1);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kOutOfRange) << m.status();
  // The idle four are closed after the Hello deadline, not before.
  const absl::Time start = absl::Now();
  for (UniqueFd& c : idle) {
    m = ReceiveMessage(c.get(), 1 << 16, 1);
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), absl::StatusCode::kOutOfRange) << m.status();
  }
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(1000));
  // Their slots are free again: a client with its session connects, and
  // the refusal was counted.
  std::unique_ptr<KVCacheClient> c = ConnectOrDie(d.socket());
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(Rejections(*c, "limit_companion_connections_per_uid"), 1);
  // A connection that did say Hello stays past the deadline.
  absl::SleepFor(absl::Milliseconds(1700));
  EXPECT_TRUE(c->Ping().ok());
  EXPECT_TRUE(c->AllocateBuffer(4096).ok());  // needs the companion
  c.reset();
  const std::string log = d.Stop();
  EXPECT_THAT(log, HasSubstr("reason=limit_companion_connections_per_uid"));
  EXPECT_THAT(log, HasSubstr("reason=no Hello within 1500 ms"));
}

TEST(AccessTest, TooManyDescriptorsInOneMessageAreAllClosed) {
  LoggedDaemon d;
  std::unique_ptr<KVCacheClient> c = ConnectOrDie(d.socket());
  ASSERT_NE(c, nullptr);
  // A raw companion connection of our own.
  UniqueFd s = RawCompanion(d.socket());
  v1::CompanionRequest hello;
  hello.mutable_hello()->set_client_name("raw\nforged log line");
  ASSERT_TRUE(SendMessage(s.get(), hello.SerializeAsString(), {}).ok());
  ASSERT_TRUE(ReceiveMessage(s.get(), 1 << 16, 1).ok());
  const int before = OpenFds(d.pid());
  std::vector<UniqueFd> mine;
  std::vector<int> raw;
  for (int i = 0; i < 12; ++i) {
    absl::StatusOr<MemfdRegion> m = MemfdRegion::Create("x", 4096);
    ASSERT_TRUE(m.ok());
    absl::StatusOr<UniqueFd> fd = m->Dup();
    mine.push_back(*std::move(fd));
    raw.push_back(mine.back().get());
  }
  v1::CompanionRequest imp;
  imp.mutable_import_buffer()->set_size(4096);
  ASSERT_TRUE(SendMessage(s.get(), imp.SerializeAsString(), raw).ok());
  absl::StatusOr<ReceivedMessage> reply = ReceiveMessage(s.get(), 1 << 16, 1);
  ASSERT_TRUE(reply.ok()) << reply.status();
  v1::CompanionReply r;
  ASSERT_TRUE(r.ParseFromString(reply->bytes));
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.message(), HasSubstr("descriptors"));
  EXPECT_TRUE(FdsSettleAt(d.pid(), before)) << OpenFds(d.pid());
  // Garbage is refused too, and the connection still answers.
  ASSERT_TRUE(SendMessage(s.get(), "\xff\xff\xff", {}).ok());
  reply = ReceiveMessage(s.get(), 1 << 16, 1);
  ASSERT_TRUE(reply.ok());
  ASSERT_TRUE(r.ParseFromString(reply->bytes));
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  const std::string log = d.Stop();
  EXPECT_THAT(log, Not(HasSubstr("\nforged log line")));
}

TEST(AccessTest, TruncationImpossibleHolePunchingHarmless) {
  LoggedDaemon d;
  std::unique_ptr<KVCacheClient> c = ConnectOrDie(d.socket());
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->CreatePool(PoolRequest("p", "V41", 0, 4, 4, 1)).ok());
  const int64_t bytes = 2 * 512 * 4;
  // A buffer the daemon allocated: its memfd cannot be shrunk or grown.
  v1::CompanionRequest alloc;
  alloc.mutable_allocate_buffer()->set_size(bytes);
  UniqueFd fd;
  absl::StatusOr<v1::CompanionReply> got = c->companion()->Call(alloc, -1, &fd);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_NE(ftruncate(fd.get(), 0), 0);
  EXPECT_NE(ftruncate(fd.get(), bytes * 2), 0);
  EXPECT_NE(fcntl(fd.get(), F_ADD_SEALS, F_SEAL_WRITE), 0);
  // Punch every page out, then make the daemon read and write it.
  ASSERT_EQ(
      fallocate(fd.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, bytes),
      0);
  const uint64_t id = got->buffer().buffer_id();
  EXPECT_TRUE(c->Store(KvStore("p", SliceRef(id, 0, bytes), 2)).ok());
  v1::LoadRequest lr;
  lr.set_pool("p");
  *lr.mutable_segments() = SegmentsProto({0, 0, 2, 0}, 2);
  *lr.mutable_data() = SliceRef(id, 0, 2 * 1024);
  EXPECT_TRUE(c->Load(lr).ok());
  // A client's own memfd, accepted, then punched out: the same.
  absl::StatusOr<MemfdRegion> own = MemfdRegion::Create("own", bytes);
  ASSERT_TRUE(own.ok());
  absl::StatusOr<v1::BufferInfo> imported = c->ImportBuffer(*own);
  ASSERT_TRUE(imported.ok()) << imported.status();
  ASSERT_EQ(fallocate(own->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                      bytes),
            0);
  EXPECT_TRUE(
      c->Store(KvStore("p", SliceRef(imported->buffer_id(), 0, bytes), 2))
          .ok());
  EXPECT_TRUE(c->Ping().ok());  // alive
}

TEST(AccessTest, ClosedCompanionConnectionReleasesTheSession) {
  LoggedDaemon d;
  std::unique_ptr<KVCacheClient> observer = ConnectOrDie(d.socket());
  std::unique_ptr<KVCacheClient> c = ConnectOrDie(d.socket());
  ASSERT_TRUE(observer && c);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(c->AllocateBuffer(4096).ok());
  const std::string id = c->session_id();
  absl::StatusOr<v1::StatsResponse> st = observer->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->buffers(), 3);
  c.reset();  // closes the companion connection
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    st = observer->Stats();
    if (st.ok() && st->buffers() == 0 && st->sessions() == 1) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(st->buffers(), 0);
  EXPECT_EQ(st->sessions(), 1);
  // The old id is dead.
  v1::StoreRequest r = StoreRequest("p", 0, {}, v1::INPUT_DTYPE_FP32);
  r.set_session_id(id);
  EXPECT_EQ(observer->Store(r).status().code(),
            absl::StatusCode::kUnauthenticated);
}

// A second uid (created with useradd; needs root, as CI runs) against the
// pools of another uid and the admin calls.
// A second local user for the tests that need one: created when missing
// (root only). Empty when that cannot be done; `why` says why.
std::optional<std::pair<uid_t, gid_t>> SecondUser(std::string* why) {
  if (geteuid() != 0) {
    *why =
        "needs root to create a second user (useradd) and run a process as "
        "it; CI runs as root";
    return std::nullopt;
  }
  const char* kUser = "kvdepot-attack";
  if (getpwnam(kUser) == nullptr) {
    const int rc = std::system(
        "/usr/sbin/useradd --system --user-group --no-create-home --shell "
        "/bin/false "
        "kvdepot-attack >/dev/null 2>&1");
    if (rc != 0 || getpwnam(kUser) == nullptr) {
      *why = absl::StrCat("useradd kvdepot-attack failed (rc ", rc, ")");
      return std::nullopt;
    }
  }
  const struct passwd* pw = getpwnam(kUser);
  return std::make_pair(pw->pw_uid, pw->pw_gid);
}

TEST(AccessTest, SecondUidCannotUseOrDeleteOthersPoolsNorDrain) {
  std::string why;
  const std::optional<std::pair<uid_t, gid_t>> user = SecondUser(&why);
  if (!user.has_value()) GTEST_SKIP() << why;
  const uid_t uid = user->first;
  const gid_t gid = user->second;
  // The socket directory: 0750 with the attacker's group, so it can reach
  // the sockets (chowned to that group by --socket_group).
  const std::string socket = FreshSocketPath();
  const std::string dir = socket.substr(0, socket.rfind('/'));
  ASSERT_EQ(chown(dir.c_str(), 0, gid), 0);
  ASSERT_EQ(chmod(dir.c_str(), 0750), 0);
  const std::string config = absl::StrCat(std::getenv("TEST_TMPDIR"), "/a.txt");
  std::ofstream(config) << "pools { name: \"owned\" format: \"V41\" "
                           "block_size: 4 num_blocks: 2 num_layers: 1 }\n"
                           "pools { name: \"granted\" format: \"V41\" "
                           "block_size: 4 num_blocks: 2 num_layers: 1 }\n"
                        << "grants { pool: \"granted\" uids: " << uid << " }\n";
  LoggedDaemon d(
      {absl::StrCat("--config=", config), absl::StrCat("--socket_group=", gid)},
      socket);
  // The probe binary, copied where the second uid can execute it.
  char bindir[] = "/tmp/kvdepot-probe-XXXXXX";
  ASSERT_NE(mkdtemp(bindir), nullptr);
  ASSERT_EQ(chmod(bindir, 0755), 0);
  const std::string probe = absl::StrCat(bindir, "/access_probe");
  {
    std::ifstream src("tests/access_probe", std::ios::binary);
    std::ofstream dst(probe, std::ios::binary);
    dst << src.rdbuf();
  }
  ASSERT_EQ(chmod(probe.c_str(), 0755), 0);
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  const pid_t child = fork();
  if (child == 0) {
    dup2(out[1], STDOUT_FILENO);
    if (setgroups(0, nullptr) != 0 || setgid(gid) != 0 || setuid(uid) != 0) {
      _exit(97);
    }
    char* args[] = {const_cast<char*>(probe.c_str()),
                    const_cast<char*>(socket.c_str()), nullptr};
    char* env[] = {nullptr};
    execve(args[0], args, env);
    _exit(98);
  }
  close(out[1]);
  std::string text;
  char buf[1024];
  ssize_t n;
  while ((n = read(out[0], buf, sizeof(buf))) > 0) text.append(buf, n);
  close(out[0]);
  absl::StatusOr<int> code = WaitForExit(child, absl::Seconds(60));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0) << text;
  std::map<std::string, std::string> got;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::vector<std::string> kv = absl::StrSplit(line, ' ');
    if (kv.size() == 2) got[kv[0]] = kv[1];
  }
  EXPECT_EQ(got["connect"], "OK") << text;
  EXPECT_EQ(got["map_owned"], "PERMISSION_DENIED");
  EXPECT_EQ(got["store_owned"], "PERMISSION_DENIED");
  EXPECT_EQ(got["delete_owned"], "PERMISSION_DENIED");
  EXPECT_EQ(got["drain"], "PERMISSION_DENIED");
  EXPECT_EQ(got["grant_owned"], "PERMISSION_DENIED");
  EXPECT_EQ(got["map_granted"], "OK");
  EXPECT_EQ(got["store_granted"], "OK");
  EXPECT_EQ(got["delete_granted"], "PERMISSION_DENIED");  // use, not own
  EXPECT_EQ(got["create_mine"], "OK");
  EXPECT_EQ(got["store_mine"], "OK");
  // The owner's pools are intact and the daemon still serves.
  std::unique_ptr<KVCacheClient> root = ConnectOrDie(socket);
  ASSERT_NE(root, nullptr);
  absl::StatusOr<v1::ListPoolsResponse> pools = root->ListPools();
  ASSERT_TRUE(pools.ok());
  EXPECT_EQ(pools->pools_size(), 3);
  absl::StatusOr<v1::StatsResponse> st = root->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_FALSE(st->draining());
  unlink(probe.c_str());
  rmdir(bindir);
}

// A raw connection to the gRPC socket that says what an HTTP/2 client says
// first (the preface and empty SETTINGS) and then nothing.
UniqueFd IdleGrpcConnection(const std::string& socket) {
  UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, socket.data(), socket.size());
  EXPECT_EQ(connect(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)),
            0);
  static constexpr char kPreface[] =
      "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";
  // A connection over the limit may be closed before the preface goes
  // out: no SIGPIPE, and EPIPE / ECONNRESET are the caller's FirstRead 0.
  const ssize_t sent =
      send(s.get(), kPreface, sizeof(kPreface) - 1, MSG_NOSIGNAL);
  EXPECT_TRUE(sent == static_cast<ssize_t>(sizeof(kPreface) - 1) ||
              (sent < 0 && (errno == EPIPE || errno == ECONNRESET)))
      << sent << " " << std::strerror(errno);
  timeval tv{10, 0};
  setsockopt(s.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return s;
}

// > 0: the daemon served the connection (its SETTINGS arrived); 0: it
// closed it (end-of-file, or a reset: the preface was never read); < 0:
// neither within 10 s.
ssize_t FirstRead(int fd) {
  char buf[256];
  const ssize_t n = read(fd, buf, sizeof(buf));
  return n < 0 && errno == ECONNRESET ? 0 : n;
}

// One uid could open idle HTTP/2 connections until the daemon's descriptor
// headroom refused everybody's (measured: ~19,700 of them, then no other
// client could connect). Now each uid holds at most
// --max_connections_per_uid; another uid still connects.
TEST(AccessTest, OneUidCannotHoldEveryGrpcConnection) {
  std::string why;
  const std::optional<std::pair<uid_t, gid_t>> user = SecondUser(&why);
  const std::string socket = FreshSocketPath();
  if (user.has_value()) {  // the second uid may reach the socket
    const std::string dir = socket.substr(0, socket.rfind('/'));
    ASSERT_EQ(chown(dir.c_str(), 0, user->second), 0);
    ASSERT_EQ(chmod(dir.c_str(), 0750), 0);
  }
  std::vector<std::string> flags = {"--max_connections_per_uid=4"};
  if (user.has_value()) {
    flags.push_back(absl::StrCat("--socket_group=", user->second));
  }
  LoggedDaemon d(flags, socket);
  std::vector<UniqueFd> idle;
  for (int i = 0; i < 4; ++i) {
    idle.push_back(IdleGrpcConnection(socket));
    EXPECT_GT(FirstRead(idle.back().get()), 0) << i;
  }
  UniqueFd fifth = IdleGrpcConnection(socket);
  EXPECT_EQ(FirstRead(fifth.get()), 0);  // closed at once
  // A burst of refusals gets one line a second; the lines left out are
  // counted as dropped refused_connection lines (reported at the latest
  // when the daemon stops).
  for (int i = 0; i < 5; ++i) {
    UniqueFd more = IdleGrpcConnection(socket);
    EXPECT_EQ(FirstRead(more.get()), 0) << i;
  }
  if (user.has_value()) {
    // Another uid is served while this one is at its limit.
    const pid_t child = fork();
    if (child == 0) {
      if (setgroups(0, nullptr) != 0 || setgid(user->second) != 0 ||
          setuid(user->first) != 0) {
        _exit(97);
      }
      const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      std::memcpy(addr.sun_path, socket.data(), socket.size());
      if (connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
        _exit(96);
      }
      timeval tv{10, 0};
      setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      _exit(FirstRead(s) > 0 ? 0 : 1);
    }
    absl::StatusOr<int> code = WaitForExit(child, absl::Seconds(30));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0) << "the second uid was not served";
  } else {
    std::cerr << "second uid not tried: " << why << "\n";
  }
  // Two closed by their client: two connections fit again (a client with
  // its session, and then one more idle).
  idle.pop_back();
  idle.pop_back();
  std::unique_ptr<KVCacheClient> c;
  for (int attempt = 0; attempt < 50 && c == nullptr; ++attempt) {
    absl::SleepFor(absl::Milliseconds(100));  // until the daemon has closed
    ClientOptions co;
    co.address = socket;
    absl::StatusOr<std::unique_ptr<KVCacheClient>> got =
        KVCacheClient::Connect(co);
    if (got.ok() && (*got)->Ping().ok()) c = *std::move(got);
  }
  ASSERT_NE(c, nullptr);
  EXPECT_GE(Rejections(*c, "limit_connections_per_uid"), 1);
  c.reset();
  idle.clear();  // else the daemon's shutdown waits for them
  const std::string log = d.Stop();
  EXPECT_THAT(log, HasSubstr("reason=limit_connections_per_uid"));
  EXPECT_THAT(log,
              HasSubstr("holds 4 connections (--max_connections_per_uid)"));
  EXPECT_THAT(log, HasSubstr(" refused_connection lines dropped since "));
}

// A client failing calls in a loop gets a few log lines a second, not one
// per call: the rest are dropped, counted in Stats (and /metrics) and
// reported as counts (at the latest when the daemon stops). Other kinds of
// lines (a session opened) are not crowded out.
TEST(AccessTest, AFloodOfFailedCallsCannotFloodTheLog) {
  constexpr int kRate = 6;
  constexpr int kShare = kRate / 2;  // one client's (server/log_limiter.h)
  constexpr int kCalls = 400;
  LoggedDaemon d(
      {"--backend=cpu", absl::StrCat("--client_log_lines_per_second=", kRate)});
  std::unique_ptr<KVCacheClient> c = ConnectOrDie(d.socket());
  ASSERT_TRUE(c);
  const absl::Time start = absl::Now();
  for (int i = 0; i < kCalls; ++i) {
    ASSERT_EQ(c->DeletePool(absl::StrCat("flood-", i)).code(),
              absl::StatusCode::kNotFound);
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  // Another client's session is still logged.
  std::unique_ptr<KVCacheClient> other = ConnectOrDie(d.socket());
  ASSERT_TRUE(other);
  // One more failure once the client's share has a token again: written.
  absl::SleepFor(absl::Milliseconds(1000 / kShare + 50));
  ASSERT_EQ(c->DeletePool("after-the-flood").code(),
            absl::StatusCode::kNotFound);
  absl::StatusOr<v1::StatsResponse> st = c->Stats();
  ASSERT_TRUE(st.ok()) << st.status();
  int64_t dropped = -1;
  for (const v1::LogLinesDropped& l : st->log_lines_dropped()) {
    if (l.kind() == "failed_call") dropped = l.lines();
  }
  const std::string log = d.Stop();
  const std::string head = log.substr(0, 3000);  // for failure messages

  int written = 0;
  int64_t reported = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    written += absl::StrContains(line, "rpc=DeletePool") &&
               absl::StrContains(line, "status=NOT_FOUND");
    // "... warning kvdepotd log: N failed_call lines dropped since ..."
    const size_t at = line.find(" log: ");
    if (at != absl::string_view::npos &&
        absl::StrContains(line, " failed_call lines dropped since ")) {
      const std::vector<absl::string_view> words =
          absl::StrSplit(line.substr(at + 6), ' ');
      int64_t n = 0;
      ASSERT_TRUE(absl::SimpleAtoi(words[0], &n)) << line;
      reported += n;
    }
  }
  // Every failure was either written or counted as dropped.
  EXPECT_EQ(written + dropped, kCalls + 1) << head;
  EXPECT_GE(written, kShare + 1);  // the first second's burst, and the last
  // At most a second's burst plus the share over the flood, plus the last.
  EXPECT_LE(written, kShare * (seconds + 1) + 2) << seconds << " s\n" << head;
  EXPECT_GT(dropped, 0);
  // Every drop was reported, as counts.
  EXPECT_EQ(reported, dropped) << head;
  EXPECT_THAT(log, HasSubstr("rpc=DeletePool pool=\"after-the-flood\""));
  EXPECT_THAT(log, HasSubstr(absl::StrCat("rpc=Hello session=",
                                          other->session_number())));
}

// A caller that never authenticates (no session, or a made-up one) flooding
// failed calls takes only the unidentified share of the failed-call lines:
// an identified client's failures right after the flood are all written.
// (With one bucket per kind the flood took every line, and the victim's
// were dropped.)
TEST(AccessTest, AnUnauthenticatedFloodCannotHideAClientsFailures) {
  constexpr int kRate = 6;  // a client's share: 3 lines a second
  constexpr int kVictimCalls = 3;
  LoggedDaemon d(
      {"--backend=cpu", absl::StrCat("--client_log_lines_per_second=", kRate)});
  std::unique_ptr<KVCacheClient> victim = ConnectOrDie(d.socket());
  ASSERT_TRUE(victim);
  ClientOptions o;
  o.address = d.socket();
  o.open_session = false;
  absl::StatusOr<std::unique_ptr<KVCacheClient>> flooder =
      KVCacheClient::Connect(o);
  ASSERT_TRUE(flooder.ok()) << flooder.status();
  const absl::Time start = absl::Now();
  for (int i = 0; i < 300; ++i) {
    ASSERT_FALSE((*flooder)->DeletePool(absl::StrCat("flood-", i)).ok());
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  for (int i = 0; i < kVictimCalls; ++i) {
    ASSERT_EQ(victim->DeletePool(absl::StrCat("victim-", i)).code(),
              absl::StatusCode::kNotFound);
  }
  const std::string log = d.Stop();
  int flood_lines = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    flood_lines += absl::StrContains(line, "pool=\"flood-");
  }
  for (int i = 0; i < kVictimCalls; ++i) {
    EXPECT_THAT(log, HasSubstr(absl::StrCat("rpc=DeletePool pool=\"victim-", i,
                                            "\" status=NOT_FOUND")))
        << log.substr(0, 3000);
  }
  // The unidentified share: a second's burst, then half the rate.
  EXPECT_GE(flood_lines, 1);
  EXPECT_LE(flood_lines, kRate / 2 * (seconds + 1) + 1) << seconds << " s";
  EXPECT_THAT(log, HasSubstr(" failed_call lines dropped since "));
}

}  // namespace
}  // namespace kvdepot::testing
