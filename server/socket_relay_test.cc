// The TLS listener's relay: bytes pass unchanged both ways, an end is passed
// on, the upstream's close ends the connection even if the client never
// speaks again, a client that does not read stalls nobody else.
#include "server/socket_relay.h"

#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/unique_fd.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

// A Unix socket the test accepts on, standing in for gRPC's TLS listener.
class Upstream {
 public:
  Upstream() {
    char dir[] = "/tmp/kvdepot-relay-XXXXXX";
    EXPECT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    path_ = absl::StrCat(dir_, "/u.sock");
    fd_ = UniqueFd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path, path_.data(), path_.size());
    EXPECT_EQ(bind(fd_.get(), reinterpret_cast<const sockaddr*>(&a), sizeof(a)),
              0);
    EXPECT_EQ(listen(fd_.get(), 64), 0);
  }
  ~Upstream() {
    fd_.reset();
    unlink(path_.c_str());
    rmdir(dir_.c_str());
  }
  const std::string& path() const { return path_; }
  // The next connection the relay made (blocking, 10 s at most).
  UniqueFd Accept() {
    pollfd p{fd_.get(), POLLIN, 0};
    if (poll(&p, 1, 10'000) != 1) return UniqueFd();
    return UniqueFd(accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
  }

 private:
  std::string dir_, path_;
  UniqueFd fd_;
};

// A client socket for the relay and the test's end of it.
struct Client {
  int relay_end = -1;
  UniqueFd mine;
};

Client NewClient() {
  int sv[2];
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  Client c;
  c.relay_end = sv[0];
  c.mine = UniqueFd(sv[1]);
  return c;
}

std::string Random(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(g());
  return s;
}

bool WriteAll(int fd, const std::string& s) {
  for (size_t at = 0; at < s.size();) {
    const ssize_t w = send(fd, s.data() + at, s.size() - at, MSG_NOSIGNAL);
    if (w <= 0) return false;
    at += w;
  }
  return true;
}

// Reads until end-of-file (or 10 s without a byte).
std::string ReadToEnd(int fd) {
  std::string out;
  char buf[65536];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 10'000) != 1) break;
    const ssize_t r = read(fd, buf, sizeof(buf));
    if (r <= 0) break;
    out.append(buf, r);
  }
  return out;
}

// Whether the relay has let go of the client's socket: a write then fails.
bool PeerClosed(int fd) {
  for (int i = 0; i < 1000; ++i) {
    const char b = 'x';
    if (send(fd, &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT) < 0 && errno == EPIPE) {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

bool WaitActive(const SocketRelay& r, int64_t want) {
  for (int i = 0; i < 2000 && r.active() != want; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  return r.active() == want;
}

// Gives the client's socket to the relay and returns the upstream's side
// of the connection the relay made (invalid if none came).
UniqueFd Relay(SocketRelay& r, Upstream& up, Client& c) {
  if (!r.Add(c.relay_end)) return UniqueFd();
  return up.Accept();
}

class SocketRelayTest : public ::testing::Test {
 protected:
  void StartRelay(SocketRelayOptions o = {}) {
    absl::StatusOr<std::unique_ptr<SocketRelay>> r =
        SocketRelay::Start(up_.path(), o);
    ASSERT_TRUE(r.ok()) << r.status();
    relay_ = *std::move(r);
  }

  Upstream up_;
  std::unique_ptr<SocketRelay> relay_;
};

TEST_F(SocketRelayTest, BytesPassBothWaysUnchangedOnManyConnections) {
  ASSERT_NO_FATAL_FAILURE(StartRelay({.buffer_bytes = 7001}));
  constexpr int kConns = 6;
  std::vector<Client> clients;
  std::vector<UniqueFd> ups;
  for (int i = 0; i < kConns; ++i) {
    clients.push_back(NewClient());
    ASSERT_TRUE(relay_->Add(clients.back().relay_end));
    ups.push_back(up_.Accept());
    ASSERT_TRUE(ups.back().valid());
  }
  EXPECT_TRUE(WaitActive(*relay_, kConns));
  // Each connection: 3 MB from the client, 2 MB back, all at once.
  std::vector<std::thread> writers;
  std::vector<std::string> to_up(kConns), to_client(kConns), got_up(kConns),
      got_client(kConns);
  for (int i = 0; i < kConns; ++i) {
    to_up[i] = Random((3 << 20) + i, 100 + i);
    to_client[i] = Random((2 << 20) + 7 * i, 200 + i);
    writers.emplace_back([&, i] {
      EXPECT_TRUE(WriteAll(clients[i].mine.get(), to_up[i]));
      shutdown(clients[i].mine.get(), SHUT_WR);
    });
    writers.emplace_back([&, i] {
      EXPECT_TRUE(WriteAll(ups[i].get(), to_client[i]));
      got_up[i] = ReadToEnd(ups[i].get());  // the client's end arrives
      ups[i].reset();                       // then the upstream closes
    });
    writers.emplace_back(
        [&, i] { got_client[i] = ReadToEnd(clients[i].mine.get()); });
  }
  for (std::thread& t : writers) t.join();
  for (int i = 0; i < kConns; ++i) {
    EXPECT_TRUE(got_up[i] == to_up[i])
        << "connection " << i << ": " << got_up[i].size() << " bytes";
    EXPECT_TRUE(got_client[i] == to_client[i])
        << "connection " << i << ": " << got_client[i].size() << " bytes";
  }
  EXPECT_TRUE(WaitActive(*relay_, 0));
}

TEST_F(SocketRelayTest, TheUpstreamsCloseEndsAClientThatNeverSpeaks) {
  // gRPC's handshake timeout closes its side; the relay must then let go
  // of the client too, or a silent client would hold a descriptor forever.
  ASSERT_NO_FATAL_FAILURE(StartRelay());
  Client c = NewClient();
  UniqueFd u = Relay(*relay_, up_, c);
  ASSERT_TRUE(u.valid());
  EXPECT_TRUE(WaitActive(*relay_, 1));
  u.reset();
  // Without a byte from the client: the relay's end is closed (a hang-up,
  // not only an end-of-file), and the connection is gone.
  EXPECT_TRUE(WaitActive(*relay_, 0));
  pollfd p{c.mine.get(), POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 10'000), 1);
  EXPECT_NE(p.revents & POLLHUP, 0) << "revents " << p.revents;
}

TEST_F(SocketRelayTest, AClientsResetClosesTheUpstream) {
  ASSERT_NO_FATAL_FAILURE(StartRelay());
  Client c = NewClient();
  UniqueFd u = Relay(*relay_, up_, c);
  ASSERT_TRUE(u.valid());
  ASSERT_TRUE(WriteAll(c.mine.get(), "hello"));
  c.mine.reset();
  EXPECT_EQ(ReadToEnd(u.get()), "hello");
  // The upstream (gRPC) closes on end-of-file; so does the relay then.
  u.reset();
  EXPECT_TRUE(WaitActive(*relay_, 0));
}

TEST_F(SocketRelayTest, AClientThatDoesNotReadStallsNobodyElse) {
  ASSERT_NO_FATAL_FAILURE(StartRelay());
  Client stuck = NewClient();
  UniqueFd stuck_up = Relay(*relay_, up_, stuck);
  ASSERT_TRUE(stuck_up.valid());
  // The upstream writes to the stuck client until every buffer between
  // them is full.
  const std::string chunk(1 << 16, 'z');
  int64_t sent = 0;
  for (int i = 0; i < 4096; ++i) {
    const ssize_t w = send(stuck_up.get(), chunk.data(), chunk.size(),
                           MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      sent += w;
      continue;
    }
    ASSERT_TRUE(errno == EAGAIN || errno == EWOULDBLOCK) << strerror(errno);
    // The relay may still be moving bytes: full means full twice.
    absl::SleepFor(absl::Milliseconds(20));
    if (send(stuck_up.get(), chunk.data(), chunk.size(),
             MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
      break;
    }
  }
  ASSERT_GT(sent, 0);
  // Another connection still gets its bytes through, both ways.
  Client other = NewClient();
  UniqueFd other_up = Relay(*relay_, up_, other);
  ASSERT_TRUE(other_up.valid());
  const std::string msg = Random(1 << 20, 7);
  std::thread t([&] {
    EXPECT_TRUE(WriteAll(other.mine.get(), msg));
    shutdown(other.mine.get(), SHUT_WR);
  });
  EXPECT_TRUE(ReadToEnd(other_up.get()) == msg);
  t.join();
  ASSERT_TRUE(WriteAll(other_up.get(), "reply"));
  other_up.reset();
  EXPECT_EQ(ReadToEnd(other.mine.get()), "reply");
}

TEST_F(SocketRelayTest, AConnectionThatYieldedIsPumpedAgainWithoutAnEvent) {
  // More than a pump's few buffers arrive at once, and then nothing: no
  // read, write or close that would announce the rest. All of it must
  // still cross.
  ASSERT_NO_FATAL_FAILURE(StartRelay({.buffer_bytes = 1000}));
  Client c = NewClient();
  UniqueFd u = Relay(*relay_, up_, c);
  ASSERT_TRUE(u.valid());
  const std::string msg = Random(50'000, 11);
  ASSERT_TRUE(WriteAll(u.get(), msg));
  int queued = 0;
  for (int i = 0; i < 400 && queued < static_cast<int>(msg.size()); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
    ASSERT_EQ(ioctl(c.mine.get(), FIONREAD, &queued), 0);
  }
  EXPECT_EQ(queued, static_cast<int>(msg.size()));
}

TEST_F(SocketRelayTest, AnUnreachableUpstreamClosesTheClient) {
  auto relay = SocketRelay::Start("/nonexistent/kvdepot-relay.sock");
  ASSERT_TRUE(relay.ok()) << relay.status();
  Client c = NewClient();
  EXPECT_FALSE((*relay)->Add(c.relay_end));
  EXPECT_TRUE(PeerClosed(c.mine.get()));
  EXPECT_EQ((*relay)->active(), 0);
}

TEST_F(SocketRelayTest, StopClosesEveryConnectionAndRefusesMore) {
  ASSERT_NO_FATAL_FAILURE(StartRelay());
  Client a = NewClient();
  UniqueFd ua = Relay(*relay_, up_, a);
  ASSERT_TRUE(ua.valid());
  EXPECT_TRUE(WaitActive(*relay_, 1));
  relay_->Stop();
  EXPECT_EQ(relay_->active(), 0);
  EXPECT_TRUE(PeerClosed(a.mine.get()));
  EXPECT_EQ(ReadToEnd(ua.get()), "");
  Client b = NewClient();
  EXPECT_FALSE(relay_->Add(b.relay_end));
  EXPECT_TRUE(PeerClosed(b.mine.get()));
}

TEST_F(SocketRelayTest, RejectsBadOptions) {
  EXPECT_FALSE(SocketRelay::Start("").ok());
  EXPECT_FALSE(SocketRelay::Start(std::string(200, 'a')).ok());
  EXPECT_FALSE(SocketRelay::Start("/tmp/x.sock", {.buffer_bytes = 0}).ok());
}

}  // namespace
}  // namespace kvdepot
