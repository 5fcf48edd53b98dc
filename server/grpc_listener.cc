#include "server/grpc_listener.h"

#include <fcntl.h>
#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
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

// A fresh name in the directory of `path`: "." and 12 random hex digits
// (as long as the default socket name, "kvdepotd.sock"), unique across
// daemons in other PID namespaces sharing the directory; "" where it does
// not fit a sockaddr_un or no random bytes came.
std::string TemporaryNameBeside(const std::string& path) {
  unsigned char r[6];
  if (getrandom(r, sizeof(r), 0) != static_cast<ssize_t>(sizeof(r))) return "";
  const size_t slash = path.rfind('/');
  const std::string dir =
      slash == std::string::npos ? "." : path.substr(0, slash);
  std::string tmp =
      absl::StrCat(dir, "/.",
                   absl::BytesToHexString(absl::string_view(
                       reinterpret_cast<const char*>(r), sizeof(r))));
  return tmp.size() < sizeof(sockaddr_un{}.sun_path) ? tmp : "";
}

// The socket at `at` (to appear as `path`) gets options' mode and group. A
// mode that cannot be set is logged; a group that cannot be given fails.
absl::Status SetModeAndGroup(const std::string& at, const std::string& path,
                             const GrpcListenerOptions& options) {
  if (chmod(at.c_str(), options.unix_mode) != 0) {
    spdlog::warn("chmod {:04o} {}: {}", options.unix_mode, path,
                 std::strerror(errno));
  }
  if (options.unix_group != static_cast<gid_t>(-1) &&
      chown(at.c_str(), -1, options.unix_group) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot give \"", path, "\" group ", options.unix_group,
                     ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcListener>> GrpcListener::Start(
    const std::string& path, grpc::Server* server,
    GrpcListenerOptions options) {
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
  // Bound, listening, given its mode and group under a temporary name in the
  // same directory, then hard-linked to `path`: a client (or an operator's
  // readiness check) that sees the path finds it accepting, never refused
  // between bind and listen nor with the umask's mode. link, unlike rename,
  // fails where `path` exists, as bind does: a second daemon cannot take
  // the path over. Where the temporary name does not fit sun_path, the
  // socket is bound at `path` itself.
  const std::string tmp = TemporaryNameBeside(path);
  const std::string& at = tmp.empty() ? path : tmp;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, at.data(), at.size());
  const auto refused = [&path] {
    return absl::UnavailableError(absl::StrCat("cannot listen on \"", path,
                                               "\": ", std::strerror(errno)));
  };
  absl::Status placed = absl::OkStatus();
  const bool bound = bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr),
                          sizeof(addr)) == 0;
  if (!bound || listen(fd.get(), options.backlog) != 0) {
    placed = refused();
  } else {
    placed = SetModeAndGroup(at, path, options);
  }
  if (placed.ok() && !tmp.empty() && link(tmp.c_str(), path.c_str()) != 0) {
    placed = refused();
  }
  // The temporary name goes once bound; `path` where this call bound it
  // itself and then failed.
  if (bound && !tmp.empty()) {
    unlink(tmp.c_str());
  } else if (bound && !placed.ok()) {
    unlink(path.c_str());
  }
  if (!placed.ok()) return placed;
  std::vector<UniqueFd> fds;
  fds.push_back(std::move(fd));
  return Run(std::move(fds), server, std::move(options), 0);
}

absl::StatusOr<std::unique_ptr<GrpcListener>> GrpcListener::StartTcp(
    const std::string& host, int port, grpc::Server* server,
    GrpcListenerOptions options) {
  const std::string where = absl::StrCat(host, ":", port);
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--listen: port of \"", where, "\" is outside [0, 65535]"));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  // No host (":port"): every address, as gRPC's own listener took it.
  if (host.empty()) hints.ai_flags |= AI_PASSIVE;
  addrinfo* found = nullptr;
  const int rc =
      getaddrinfo(host.empty() ? nullptr : host.c_str(), "0", &hints, &found);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on \"", where, "\": ", gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> owned(found, freeaddrinfo);
  std::vector<UniqueFd> fds;
  // An IPv6 socket takes IPv4 too (as gRPC's own listener did for "[::]")
  // unless an IPv4 address is bound beside it ("localhost": 127.0.0.1 and
  // ::1 each on their own).
  bool has_v4 = false;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    has_v4 |= a->ai_family == AF_INET;
  }
  // Port 0: the first address's port, then the same for the others.
  int bound = port;
  std::string skipped;  // why the last address left out was
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family != AF_INET && a->ai_family != AF_INET6) continue;
    sockaddr_storage addr{};
    std::memcpy(&addr, a->ai_addr, a->ai_addrlen);
    const uint16_t net_port = htons(static_cast<uint16_t>(bound));
    if (a->ai_family == AF_INET) {
      reinterpret_cast<sockaddr_in*>(&addr)->sin_port = net_port;
    } else {
      reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port = net_port;
    }
    UniqueFd fd(
        socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd.valid() && errno == EAFNOSUPPORT) {  // e.g. IPv6 disabled
      skipped = std::strerror(errno);
      continue;
    }
    if (!fd.valid()) {
      return absl::InternalError(
          absl::StrCat("socket(", where, "): ", std::strerror(errno)));
    }
    // A restart may bind while old connections sit in TIME_WAIT; never
    // SO_REUSEPORT (a second daemon must fail, not share the port).
    const int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (a->ai_family == AF_INET6) {
      const int v6only = has_v4 ? 1 : 0;
      setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof(v6only));
    }
    const bool bound_here =
        bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr),
             a->ai_addrlen) == 0;
    if (!bound_here && errno == EADDRNOTAVAIL && a->ai_family == AF_INET6) {
      // A name's IPv6 address on a host without IPv6 ("localhost"'s ::1):
      // the others may do.
      skipped = std::strerror(errno);
      continue;
    }
    if (!bound_here || listen(fd.get(), options.backlog) != 0) {
      return absl::UnavailableError(absl::StrCat(
          "cannot listen on \"", where, "\": ", std::strerror(errno),
          errno == EADDRINUSE ? " (another daemon?)" : ""));
    }
    if (bound == 0) {
      sockaddr_storage got{};
      socklen_t len = sizeof(got);
      if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&got), &len) != 0) {
        return absl::InternalError(
            absl::StrCat("getsockname: ", std::strerror(errno)));
      }
      bound = ntohs(got.ss_family == AF_INET
                        ? reinterpret_cast<sockaddr_in*>(&got)->sin_port
                        : reinterpret_cast<sockaddr_in6*>(&got)->sin6_port);
    }
    fds.push_back(std::move(fd));
  }
  if (fds.empty()) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on \"", where, "\": no IPv4 or IPv6 address",
        skipped.empty() ? "" : absl::StrCat(" (", skipped, ")")));
  }
  return Run(std::move(fds), server, std::move(options), bound);
}

absl::StatusOr<std::unique_ptr<GrpcListener>> GrpcListener::Run(
    std::vector<UniqueFd> listen_fds, grpc::Server* server,
    GrpcListenerOptions options, int port) {
  UniqueFd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) {
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  std::unique_ptr<GrpcListener> l(new GrpcListener(
      std::move(listen_fds), std::move(wake), server, std::move(options)));
  if (!l->spare_.valid()) {
    return absl::InternalError(
        absl::StrCat("open(/dev/null): ", std::strerror(errno)));
  }
  l->port_ = port;
  GrpcListener* raw = l.get();
  l->thread_ = std::thread([raw] { raw->AcceptLoop(); });
  return l;
}

GrpcListener::GrpcListener(std::vector<UniqueFd> listen_fds, UniqueFd wake_fd,
                           grpc::Server* server, GrpcListenerOptions options)
    : listen_fds_(std::move(listen_fds)),
      wake_fd_(std::move(wake_fd)),
      spare_(OpenSpare()),
      server_(server),
      options_(std::move(options)),
      soft_limit_(SoftDescriptorLimit()) {}

GrpcListener::~GrpcListener() { Stop(); }

void GrpcListener::Stop() {
  if (!stopping_.exchange(true)) {
    const uint64_t one = 1;
    (void)!write(wake_fd_.get(), &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
}

void GrpcListener::Refuse(bool per_uid, const std::string& why,
                          int64_t fd_number) {
  refused_.fetch_add(1);
  const char* reason =
      per_uid ? "limit_connections_per_uid" : "limit_connections";
  const std::function<void()>& count =
      per_uid ? options_.on_refused_per_uid : options_.on_refused;
  if (count) count();
  const int64_t now = absl::GetCurrentTimeNanos();
  if (now - last_log_ns_ < 1'000'000'000) {
    if (options_.on_log_line_dropped) options_.on_log_line_dropped();
  } else {
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

// The key TCP connections (plain or TLS) are counted under (no uid is this).
constexpr uid_t kAnonymousTcpPeer = static_cast<uid_t>(-1);

bool StillOpen(int fd, dev_t dev, ino_t ino) {
  struct stat st {};
  return fstat(fd, &st) == 0 && st.st_dev == dev && st.st_ino == ino;
}

}  // namespace

void GrpcListener::Sweep() {
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

bool GrpcListener::AdmitPeer(int fd, uid_t* uid) {
  if (options_.max_connections_per_uid <= 0) return true;
  if (++accepts_since_sweep_ >= kSweepEvery) {
    accepts_since_sweep_ = 0;
    Sweep();
  }
  struct stat st {};
  // A connected socket always has these; without them the peer is not
  // counted (nothing to count it by), as for the descriptor checks above.
  if (fstat(fd, &st) != 0) return true;
  if (port_ == 0) {  // the Unix socket
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return true;
    *uid = cred.uid;
  } else {
    *uid = kAnonymousTcpPeer;  // TCP: no uid (TLS is gRPC's), one peer together
  }
  std::vector<Held>& mine = held_[*uid];
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

void GrpcListener::AcceptLoop() {
  // The listening sockets, then the wake-up eventfd.
  std::vector<pollfd> fds;
  for (const UniqueFd& l : listen_fds_) fds.push_back({l.get(), POLLIN, 0});
  fds.push_back({wake_fd_.get(), POLLIN, 0});
  while (!stopping_.load()) {
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("grpc listener: poll: {}", std::strerror(errno));
      absl::SleepFor(absl::Milliseconds(10));
      continue;
    }
    if (stopping_.load()) break;
    for (size_t i = 0; i + 1 < fds.size() && !stopping_.load(); ++i) {
      if ((fds[i].revents & POLLIN) != 0) Drain(fds[i].fd);
    }
  }
}

void GrpcListener::Drain(int listen_fd) {
  // Take what is waiting; EAGAIN sends us back to poll.
  while (!stopping_.load()) {
    const int fd =
        accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) {
      // Read per connection: an operator may change it (prlimit).
      soft_limit_ = SoftDescriptorLimit();
      // Counted before it is closed: a client that sees the close finds
      // the refusal in the metrics.
      if (fd >= soft_limit_ - options_.headroom) {
        Refuse(/*per_uid=*/false, "the daemon's descriptors are nearly used up",
               fd);
        close(fd);
        continue;
      }
      uid_t uid = 0;
      if (!AdmitPeer(fd, &uid)) {
        Refuse(
            /*per_uid=*/true,
            absl::StrCat(uid == kAnonymousTcpPeer
                             ? std::string("TCP clients together hold ")
                             : absl::StrCat("uid ", uid, " holds "),
                         options_.max_connections_per_uid,
                         " connections (--max_connections_per_uid)"),
            fd);
        close(fd);
        continue;
      }
      if (port_ != 0) {
        // gRPC sets this on the connections it accepts itself.
        const int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      }
      if (options_.hand_off) {
        options_.hand_off(fd);  // the relay owns it from here
      } else {
        // The server owns it from here (it closes it with the connection).
        grpc::AddInsecureChannelFromFd(server_, fd);
      }
      continue;
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK) return;
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EMFILE || errno == ENFILE) {
      // Take the waiting connection with the spare's descriptor and close
      // it, so the client learns at once instead of waiting in the
      // backlog; then keep the spare again.
      spare_.reset();
      const int taken =
          accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (taken >= 0) {
        // Counted before the client sees the close, as above (an assert
        // right after the close found the count still 0 under ASan).
        Refuse(/*per_uid=*/false, "no descriptor left", -1);
        close(taken);
      } else {  // even the spare's was taken meanwhile: let some go
        absl::SleepFor(absl::Milliseconds(10));
      }
      spare_ = OpenSpare();
      continue;
    }
    // ENOBUFS, ENOMEM, EPROTO...: transient; never give up the socket.
    spdlog::error("grpc listener: accept4: {}", std::strerror(errno));
    absl::SleepFor(absl::Milliseconds(10));
    return;
  }
}

}  // namespace kvdepot
