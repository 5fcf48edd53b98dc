#include "server/unix_listener.h"

#include <fcntl.h>
#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

namespace kvdepot {
namespace {

int64_t SoftDescriptorLimit() {
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == RLIM_INFINITY) {
    return INT64_MAX;
  }
  return static_cast<int64_t>(r.rlim_cur);
}

UniqueFd OpenSpare() {
  return UniqueFd(open("/dev/null", O_RDONLY | O_CLOEXEC));
}

}  // namespace

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Start(
    const std::string& path, grpc::Server* server,
    UnixListenerOptions options) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--listen: socket path \"", path, "\" is empty or longer than ",
        sizeof(addr.sun_path) - 1, " bytes"));
  }
  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) {
    return absl::InternalError(
        absl::StrCat("socket(AF_UNIX): ", std::strerror(errno)));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) !=
          0 ||
      listen(fd.get(), options.backlog) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on \"", path,
                                               "\": ", std::strerror(errno)));
  }
  UniqueFd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) {
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  std::unique_ptr<UnixListener> l(new UnixListener(
      std::move(fd), std::move(wake), server, std::move(options)));
  if (!l->spare_.valid()) {
    return absl::InternalError(
        absl::StrCat("open(/dev/null): ", std::strerror(errno)));
  }
  UnixListener* raw = l.get();
  l->thread_ = std::thread([raw] { raw->AcceptLoop(); });
  return l;
}

UnixListener::UnixListener(UniqueFd listen_fd, UniqueFd wake_fd,
                           grpc::Server* server, UnixListenerOptions options)
    : listen_fd_(std::move(listen_fd)),
      wake_fd_(std::move(wake_fd)),
      spare_(OpenSpare()),
      server_(server),
      options_(std::move(options)),
      soft_limit_(SoftDescriptorLimit()) {}

UnixListener::~UnixListener() { Stop(); }

void UnixListener::Stop() {
  if (!stopping_.exchange(true)) {
    const uint64_t one = 1;
    (void)!write(wake_fd_.get(), &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
}

void UnixListener::Refuse(bool per_uid, const std::string& why,
                          int64_t fd_number) {
  refused_.fetch_add(1);
  const char* reason =
      per_uid ? "limit_connections_per_uid" : "limit_connections";
  const std::function<void()>& count =
      per_uid ? options_.on_refused_per_uid : options_.on_refused;
  if (count) count();
  const int64_t now = absl::GetCurrentTimeNanos();
  if (now - last_log_ns_ >= 1'000'000'000) {
    last_log_ns_ = now;
    spdlog::warn(
        "rpc=connect status=RESOURCE_EXHAUSTED reason={} why=\"{}\" "
        "descriptor={} soft_limit={} headroom={} refused_total={}",
        reason, why, fd_number, soft_limit_, options_.headroom,
        refused_.load());
  }
}

namespace {

// Accepts between two sweeps of every uid's connections: a uid that stops
// connecting would otherwise keep its closed ones listed.
constexpr int64_t kSweepEvery = 1024;

bool StillOpen(int fd, dev_t dev, ino_t ino) {
  struct stat st {};
  return fstat(fd, &st) == 0 && st.st_dev == dev && st.st_ino == ino;
}

}  // namespace

void UnixListener::Sweep() {
  for (auto it = held_.begin(); it != held_.end();) {
    std::vector<Held>& v = it->second;
    v.erase(std::remove_if(
                v.begin(), v.end(),
                [](const Held& h) { return !StillOpen(h.fd, h.dev, h.ino); }),
            v.end());
    if (v.empty()) {
      held_.erase(it++);
    } else {
      ++it;
    }
  }
}

bool UnixListener::AdmitPeer(int fd, uid_t* uid) {
  if (options_.max_connections_per_uid <= 0) return true;
  if (++accepts_since_sweep_ >= kSweepEvery) {
    accepts_since_sweep_ = 0;
    Sweep();
  }
  ucred cred{};
  socklen_t len = sizeof(cred);
  struct stat st {};
  // A Unix socket always has both; without them the peer is not counted
  // (nothing to count it by), as for the descriptor checks above.
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
      fstat(fd, &st) != 0) {
    return true;
  }
  *uid = cred.uid;
  std::vector<Held>& mine = held_[cred.uid];
  mine.erase(std::remove_if(
                 mine.begin(), mine.end(),
                 [](const Held& h) { return !StillOpen(h.fd, h.dev, h.ino); }),
             mine.end());
  if (static_cast<int64_t>(mine.size()) >= options_.max_connections_per_uid) {
    return false;
  }
  mine.push_back(Held{fd, st.st_dev, st.st_ino});
  return true;
}

void UnixListener::AcceptLoop() {
  pollfd fds[2] = {{listen_fd_.get(), POLLIN, 0}, {wake_fd_.get(), POLLIN, 0}};
  while (!stopping_.load()) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("unix listener: poll: {}", std::strerror(errno));
      absl::SleepFor(absl::Milliseconds(10));
      continue;
    }
    if (stopping_.load()) break;
    if ((fds[0].revents & POLLIN) == 0) continue;
    // Drain what is waiting; EAGAIN sends us back to poll.
    while (!stopping_.load()) {
      const int fd = accept4(listen_fd_.get(), nullptr, nullptr,
                             SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0) {
        // Read per connection: an operator may change it (prlimit).
        soft_limit_ = SoftDescriptorLimit();
        // Counted before it is closed: a client that sees the close finds
        // the refusal in the metrics.
        if (fd >= soft_limit_ - options_.headroom) {
          Refuse(/*per_uid=*/false,
                 "the daemon's descriptors are nearly used up", fd);
          close(fd);
          continue;
        }
        uid_t uid = 0;
        if (!AdmitPeer(fd, &uid)) {
          Refuse(/*per_uid=*/true,
                 absl::StrCat("uid ", uid, " holds ",
                              options_.max_connections_per_uid,
                              " connections (--max_connections_per_uid)"),
                 fd);
          close(fd);
          continue;
        }
        // The server owns it from here (it closes it with the connection).
        grpc::AddInsecureChannelFromFd(server_, fd);
        continue;
      }
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) {
        // Take the waiting connection with the spare's descriptor and close
        // it, so the client learns at once instead of waiting in the
        // backlog; then keep the spare again.
        spare_.reset();
        const int taken = accept4(listen_fd_.get(), nullptr, nullptr,
                                  SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (taken >= 0) close(taken);
        spare_ = OpenSpare();
        if (taken >= 0) {
          Refuse(/*per_uid=*/false, "no descriptor left", -1);
        } else {  // even the spare's was taken meanwhile: let some go
          absl::SleepFor(absl::Milliseconds(10));
        }
        continue;
      }
      // ENOBUFS, ENOMEM, EPROTO...: transient; never give up the socket.
      spdlog::error("unix listener: accept4: {}", std::strerror(errno));
      absl::SleepFor(absl::Milliseconds(10));
      break;
    }
  }
}

}  // namespace kvdepot
