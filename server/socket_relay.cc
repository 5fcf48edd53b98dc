#include "server/socket_relay.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"

namespace kvdepot {

namespace relay_internal {

struct Pipe {
  std::unique_ptr<char[]> buf;  // while it holds bytes (or is being filled)
  int64_t begin = 0, end = 0;   // bytes read and not yet written
  bool eof = false;             // the source read end-of-file
  bool shut = false;            // and that was passed on
};

// fd[0] the client, fd[1] the upstream; pipe[i] carries fd[i]'s bytes to
// fd[1 - i].
struct Conn {
  UniqueFd fd[2];
  Pipe pipe[2];
};

}  // namespace relay_internal

namespace {

using relay_internal::Pipe;

// An epoll key: the connection's id and which end.
uint64_t Key(uint64_t id, int end) { return id << 1 | end; }

// Buffers a direction may move in one pump before it yields.
constexpr int kRounds = 4;

enum class Step { kBlocked, kDone, kYield, kError };

// Moves `p`'s bytes from `src` to `dst` until one would block, the source
// ended (and that was passed on), or `rounds` buffers were read.
Step Transfer(Pipe& p, int64_t cap, int src, int dst, int rounds) {
  for (int n = 0;;) {
    while (p.begin < p.end) {
      const ssize_t w = send(dst, p.buf.get() + p.begin, p.end - p.begin,
                             MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w > 0) {
        p.begin += w;
      } else if (w < 0 && errno == EINTR) {
        continue;
      } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        return Step::kBlocked;
      } else {
        return Step::kError;
      }
    }
    p.begin = p.end = 0;
    if (p.eof) {
      if (!p.shut) {
        shutdown(dst, SHUT_WR);
        p.shut = true;
      }
      return Step::kDone;
    }
    if (n == rounds) return Step::kYield;
    if (p.buf == nullptr) p.buf = std::make_unique<char[]>(cap);
    const ssize_t r = recv(src, p.buf.get(), cap, MSG_DONTWAIT);
    if (r > 0) {
      p.end = r;
      ++n;
    } else if (r == 0) {
      p.eof = true;
      p.buf.reset();
    } else if (errno == EINTR) {
      continue;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      p.buf.reset();  // an idle connection holds no buffer
      return Step::kBlocked;
    } else {
      return Step::kError;
    }
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<SocketRelay>> SocketRelay::Start(
    std::string upstream, SocketRelayOptions options) {
  if (upstream.empty() || upstream.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "relay: upstream socket path \"", upstream, "\" is empty or too long"));
  }
  if (options.buffer_bytes < 1) {
    return absl::InvalidArgumentError("relay: buffer_bytes must be >= 1");
  }
  UniqueFd ep(epoll_create1(EPOLL_CLOEXEC));
  UniqueFd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!ep.valid() || !wake.valid()) {
    return absl::InternalError(
        absl::StrCat("relay: epoll/eventfd: ", std::strerror(errno)));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;
  if (epoll_ctl(ep.get(), EPOLL_CTL_ADD, wake.get(), &ev) != 0) {
    return absl::InternalError(
        absl::StrCat("relay: epoll_ctl: ", std::strerror(errno)));
  }
  std::unique_ptr<SocketRelay> r(new SocketRelay(
      std::move(upstream), options, std::move(ep), std::move(wake)));
  SocketRelay* raw = r.get();
  r->thread_ = std::thread([raw] { raw->Loop(); });
  return r;
}

SocketRelay::SocketRelay(std::string upstream, SocketRelayOptions options,
                         UniqueFd epoll, UniqueFd wake)
    : upstream_(std::move(upstream)),
      options_(options),
      epoll_(std::move(epoll)),
      wake_(std::move(wake)) {}

SocketRelay::~SocketRelay() { Stop(); }

bool SocketRelay::Add(int client) {
  UniqueFd in(client);
  UniqueFd out(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!out.valid()) return false;  // no descriptor: the client is closed
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path, upstream_.data(), upstream_.size());
  // A Unix socket connects at once or not at all (EAGAIN: its backlog is
  // full), so non-blocking is enough.
  if (connect(out.get(), reinterpret_cast<const sockaddr*>(&a), sizeof(a)) !=
      0) {
    const int err = errno;
    const int64_t now = absl::GetCurrentTimeNanos();
    int64_t last = last_failure_log_ns_.load();
    if (now - last >= 1'000'000'000 &&
        last_failure_log_ns_.compare_exchange_strong(last, now)) {
      spdlog::warn("relay: cannot reach \"{}\": {}; connection closed",
                   upstream_, std::strerror(err));
    }
    return false;
  }
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return false;
    pending_.emplace_back(std::move(in), std::move(out));
  }
  const uint64_t one = 1;
  (void)!write(wake_.get(), &one, sizeof(one));
  return true;
}

void SocketRelay::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
  }
  if (!stopping_.exchange(true)) {
    const uint64_t one = 1;
    (void)!write(wake_.get(), &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
}

void SocketRelay::TakePending() {
  std::vector<std::pair<UniqueFd, UniqueFd>> taken;
  {
    absl::MutexLock lock(&mu_);
    taken.swap(pending_);
  }
  for (auto& [in, out] : taken) {
    auto c = std::make_unique<Conn>();
    c->fd[0] = std::move(in);
    c->fd[1] = std::move(out);
    const uint64_t id = next_id_++;
    bool ok = true;
    for (int end = 0; end < 2 && ok; ++end) {
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
      ev.data.u64 = Key(id, end);
      ok = epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, c->fd[end].get(), &ev) == 0;
    }
    if (!ok) {
      spdlog::warn("relay: epoll_ctl: {}", std::strerror(errno));
      continue;  // closes both
    }
    conns_.emplace(id, std::move(c));
    active_.fetch_add(1);
    // Bytes may be waiting already: edges from before the registration
    // were not seen.
    busy_.push_back(id);
  }
}

SocketRelay::Pumped SocketRelay::Pump(Conn& c, int rounds) {
  bool yielded = false;
  for (int i = 0; i < 2; ++i) {
    const Step s = Transfer(c.pipe[i], options_.buffer_bytes, c.fd[i].get(),
                            c.fd[1 - i].get(), rounds);
    if (s == Step::kError) return Pumped::kFinished;
    // gRPC never half-closes: once the upstream has ended, the connection
    // is over (a client that half-closed is answered by the upstream's
    // close; one that never reads or writes again must not keep it).
    if (i == 1 && s == Step::kDone) return Pumped::kFinished;
    yielded |= s == Step::kYield;
  }
  return yielded ? Pumped::kYielded : Pumped::kWaiting;
}

void SocketRelay::Close(uint64_t id) {
  if (conns_.erase(id) > 0) active_.fetch_sub(1);
}

void SocketRelay::Loop() {
  std::vector<epoll_event> events(64);
  while (!stopping_.load()) {
    const int timeout = busy_.empty() ? -1 : 0;
    const int n = epoll_wait(epoll_.get(), events.data(),
                             static_cast<int>(events.size()), timeout);
    if (n < 0) {
      if (errno != EINTR) {
        spdlog::error("relay: epoll_wait: {}", std::strerror(errno));
        absl::SleepFor(absl::Milliseconds(10));
      }
      continue;
    }
    std::vector<uint64_t> ready;
    for (int k = 0; k < n; ++k) {
      if (events[k].data.u64 == 0) {
        uint64_t v = 0;
        (void)!read(wake_.get(), &v, sizeof(v));
        TakePending();
        continue;
      }
      ready.push_back(events[k].data.u64 >> 1);
    }
    // Those with new events and those that yielded last time; a
    // connection closed earlier in this batch is no longer in conns_.
    // Each once (both ends may have events, and a yielded one may too).
    ready.insert(ready.end(), busy_.begin(), busy_.end());
    busy_.clear();
    std::sort(ready.begin(), ready.end());
    ready.erase(std::unique(ready.begin(), ready.end()), ready.end());
    for (uint64_t id : ready) {
      auto it = conns_.find(id);
      if (it == conns_.end()) continue;
      switch (Pump(*it->second, kRounds)) {
        case Pumped::kFinished:
          Close(id);
          break;
        case Pumped::kYielded:  // no edge will announce what is left
          busy_.push_back(id);
          break;
        case Pumped::kWaiting:
          break;
      }
    }
  }
  conns_.clear();
  active_.store(0);
  absl::MutexLock lock(&mu_);
  pending_.clear();
}

}  // namespace kvdepot
