#include "client/companion_connection.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/fd_passing.h"

namespace kvdepot {

absl::Status CheckSocketDirectory(const std::string& socket_path) {
  const size_t slash = socket_path.rfind('/');
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0               ? "/"
                                       : socket_path.substr(0, slash);
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) {
    return absl::UnavailableError(absl::StrCat(
        "no daemon at \"", socket_path, "\": its directory \"", dir,
        "\": ", std::strerror(errno), " (is kvdepotd running?)"));
  }
  if ((st.st_mode & S_IWOTH) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "refusing the socket \"%s\": its directory \"%s\" (mode %04o) can be "
        "written by others, who could have put their own socket there; use "
        "the daemon's private directory (SPEC §11)",
        socket_path, dir, st.st_mode & 07777));
  }
  return absl::OkStatus();
}

int64_t ExpectedDaemonUid(int64_t flag) {
  if (flag >= 0) return flag;
  const char* env = std::getenv("KVDEPOT_DAEMON_UID");
  int64_t uid = -1;
  if (env != nullptr && absl::SimpleAtoi(env, &uid) && uid >= 0) return uid;
  return -1;
}

absl::StatusOr<std::unique_ptr<CompanionConnection>> CompanionConnection::Open(
    const std::string& path, int64_t expected_uid,
    const std::string& client_name) {
  if (absl::Status s = CheckSocketDirectory(path); !s.ok()) return s;
  struct sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("companion socket path \"", path, "\" is too long"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  UniqueFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd.valid() ||
      connect(fd.get(), reinterpret_cast<struct sockaddr*>(&addr),
              sizeof(addr)) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot connect to the companion socket \"", path,
                     "\": ", std::strerror(errno)));
  }
  struct ucred cred;
  socklen_t len = sizeof(cred);
  if (getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return absl::UnavailableError("SO_PEERCRED on the companion socket failed");
  }
  const bool uid_ok = expected_uid >= 0
                          ? static_cast<int64_t>(cred.uid) == expected_uid
                          : cred.uid == getuid() || cred.uid == 0;
  if (!uid_ok) {
    return absl::PermissionDeniedError(
        absl::StrCat("the process serving \"", path, "\" runs as uid ",
                     cred.uid, ", not the expected daemon uid ",
                     expected_uid >= 0 ? absl::StrCat(expected_uid)
                                       : absl::StrCat(getuid(), " or 0"),
                     " (KVDEPOT_DAEMON_UID); no memory is handed to it"));
  }
  std::unique_ptr<CompanionConnection> c(
      new CompanionConnection(std::move(fd)));
  v1::CompanionRequest hello;
  hello.mutable_hello()->set_client_name(client_name);
  absl::StatusOr<v1::CompanionReply> r = c->Call(hello, -1, nullptr);
  if (!r.ok()) return r.status();
  c->hello_ = r->hello();
  return c;
}

absl::StatusOr<v1::CompanionReply> CompanionConnection::Call(
    const v1::CompanionRequest& request, int fd, UniqueFd* fd_out) {
  std::string bytes;
  request.SerializeToString(&bytes);
  std::vector<int> fds;
  if (fd >= 0) fds.push_back(fd);
  absl::MutexLock lock(&mu_);
  if (absl::Status s = SendMessage(fd_.get(), bytes, fds); !s.ok()) return s;
  absl::StatusOr<ReceivedMessage> m = ReceiveMessage(fd_.get(), 1 << 20, 1);
  if (!m.ok()) {
    return absl::UnavailableError(
        absl::StrCat("companion socket: ", m.status().message()));
  }
  v1::CompanionReply reply;
  if (!reply.ParseFromString(m->bytes)) {
    return absl::InternalError("the companion reply does not parse");
  }
  if (reply.code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(reply.code()),
                        reply.message());
  }
  if (fd_out != nullptr && !m->fds.empty()) *fd_out = std::move(m->fds[0]);
  return reply;
}

}  // namespace kvdepot
