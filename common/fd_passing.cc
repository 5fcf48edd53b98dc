#include "common/fd_passing.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvdepot {
namespace {

// Room for kMaxFdsPerMessage descriptors, aligned for cmsghdr.
union ControlBuffer {
  char buf[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  struct cmsghdr align;
};

}  // namespace

absl::Status SendMessage(int sock, absl::string_view bytes,
                         absl::Span<const int> fds) {
  if (bytes.empty()) {
    return absl::InvalidArgumentError("a message must not be empty");
  }
  if (fds.size() > static_cast<size_t>(kMaxFdsPerMessage)) {
    return absl::InvalidArgumentError(
        absl::StrCat(fds.size(), " descriptors exceed the ", kMaxFdsPerMessage,
                     " a message may carry"));
  }
  struct iovec iov;
  iov.iov_base = const_cast<char*>(bytes.data());
  iov.iov_len = bytes.size();
  struct msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  ControlBuffer control;
  std::memset(&control, 0, sizeof(control));
  if (!fds.empty()) {
    msg.msg_control = control.buf;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    struct cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t n;
  do {
    n = sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    return absl::UnavailableError(absl::StrCat(
        "sendmsg on the companion socket: ", std::strerror(errno)));
  }
  if (static_cast<size_t>(n) != bytes.size()) {
    return absl::UnavailableError("sendmsg sent a partial message");
  }
  return absl::OkStatus();
}

absl::StatusOr<ReceivedMessage> ReceiveMessage(int sock, size_t max_bytes,
                                               int max_fds) {
  if (max_fds < 0 || max_fds > kMaxFdsPerMessage) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_fds = ", max_fds, " is outside [0, ", kMaxFdsPerMessage, "]"));
  }
  ReceivedMessage out;
  out.bytes.resize(max_bytes);
  struct iovec iov;
  iov.iov_base = out.bytes.data();
  iov.iov_len = out.bytes.size();
  struct msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  ControlBuffer control;
  std::memset(&control, 0, sizeof(control));
  msg.msg_control = control.buf;
  // At least room for one descriptor: with max_fds = 0 a descriptor sent
  // anyway is received (and closed below) rather than silently dropped.
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * (max_fds > 0 ? max_fds : 1));
  ssize_t n;
  do {
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    return absl::UnavailableError(absl::StrCat(
        "recvmsg on the companion socket: ", std::strerror(errno)));
  }
  // Own every descriptor first, so each error below closes them all.
  for (struct cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr;
       c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      out.fds.emplace_back(fd);
    }
  }
  if (n == 0) {
    return absl::OutOfRangeError("the peer closed the companion connection");
  }
  if ((msg.msg_flags & MSG_CTRUNC) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the message carried more than ", max_fds,
                     " descriptors; all of them were closed"));
  }
  if (static_cast<int>(out.fds.size()) > max_fds) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the message carried ", out.fds.size(), " descriptors, more than ",
        max_fds, "; all of them were closed"));
  }
  if ((msg.msg_flags & MSG_TRUNC) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the message is longer than ", max_bytes, " bytes"));
  }
  out.bytes.resize(static_cast<size_t>(n));
  return out;
}

}  // namespace kvdepot
