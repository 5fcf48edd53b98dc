#include "tests/raw_http2.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvdepot::testing {
namespace {

constexpr uint8_t kData = 0x0, kHeaders = 0x1, kRstStream = 0x3,
                  kSettings = 0x4, kGoAway = 0x7, kWindowUpdate = 0x8;
constexpr uint8_t kEndStream = 0x1, kAck = 0x1, kEndHeaders = 0x4;
constexpr int64_t kMaxFrame = 16384;  // the default SETTINGS_MAX_FRAME_SIZE

uint32_t Be(absl::string_view p, size_t at, int n) {
  uint32_t v = 0;
  for (int i = 0; i < n; ++i) v = v << 8 | static_cast<uint8_t>(p[at + i]);
  return v;
}

std::string Errno(absl::string_view what) {
  return absl::StrCat(what, ": ", std::strerror(errno));
}

}  // namespace

absl::StatusOr<RawHttp2> RawHttp2::Connect(const std::string& path,
                                           int64_t initial_window) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(Errno("socket"));
  RawHttp2 c(fd);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(Errno("connect"));
  }
  static constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  if (send(fd, kPreface, sizeof(kPreface) - 1, MSG_NOSIGNAL) !=
      static_cast<ssize_t>(sizeof(kPreface) - 1)) {
    return absl::UnavailableError(Errno("send"));
  }
  std::string settings;
  if (initial_window >= 0) {
    const uint32_t v = static_cast<uint32_t>(initial_window);
    settings = {0,
                4,
                static_cast<char>(v >> 24),
                static_cast<char>(v >> 16),
                static_cast<char>(v >> 8),
                static_cast<char>(v)};
  }
  absl::Status s = c.Frame(kSettings, 0, 0, settings);
  if (!s.ok()) return s;
  return c;
}

RawHttp2::RawHttp2(RawHttp2&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      in_(std::move(other.in_)),
      connection_window_(other.connection_window_),
      initial_window_(other.initial_window_),
      stream_window_(std::move(other.stream_window_)),
      body_sent_(std::move(other.body_sent_)) {}

RawHttp2::~RawHttp2() {
  if (fd_ >= 0) close(fd_);
}

absl::Status RawHttp2::Frame(uint8_t type, uint8_t flags, uint32_t stream,
                             absl::string_view payload) {
  const uint32_t n = static_cast<uint32_t>(payload.size());
  std::string f = {static_cast<char>(n >> 16),
                   static_cast<char>(n >> 8),
                   static_cast<char>(n),
                   static_cast<char>(type),
                   static_cast<char>(flags),
                   static_cast<char>(stream >> 24),
                   static_cast<char>(stream >> 16),
                   static_cast<char>(stream >> 8),
                   static_cast<char>(stream)};
  f.append(payload.data(), payload.size());
  size_t done = 0;
  while (done < f.size()) {
    // No SIGPIPE when the daemon has closed the connection: the caller
    // gets UNAVAILABLE instead of the test process dying without a word.
    const ssize_t w = send(fd_, f.data() + done, f.size() - done, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return absl::UnavailableError(Errno("send"));
    done += static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status RawHttp2::OpenStream(uint32_t stream, absl::string_view method) {
  std::string block;
  const std::pair<absl::string_view, absl::string_view> fields[] = {
      {":method", "POST"},
      {":scheme", "http"},
      {":path", method},
      {":authority", "localhost"},
      {"content-type", "application/grpc"},
      {"te", "trailers"}};
  for (const auto& [name, value] : fields) {
    // A literal field without indexing, new name, no Huffman coding.
    block += '\0';
    block += static_cast<char>(name.size());
    block.append(name.data(), name.size());
    block += static_cast<char>(value.size());
    block.append(value.data(), value.size());
  }
  stream_window_[stream] = initial_window_;
  return Frame(kHeaders, kEndHeaders, stream, block);
}

absl::Status RawHttp2::SendMessage(uint32_t stream, absl::string_view message) {
  const uint32_t n = static_cast<uint32_t>(message.size());
  std::string body = {0, static_cast<char>(n >> 24), static_cast<char>(n >> 16),
                      static_cast<char>(n >> 8), static_cast<char>(n)};
  body.append(message.data(), message.size());
  return Frame(kData, kEndStream, stream, body);
}

absl::StatusOr<int64_t> RawHttp2::SendBody(uint32_t stream,
                                           int64_t message_bytes,
                                           int64_t bytes) {
  absl::Status s = Pump();
  if (!s.ok()) return s;
  int64_t sent = 0;
  int64_t& window = stream_window_[stream];
  int64_t& body = body_sent_[stream];
  while (sent < bytes) {
    const int64_t n =
        std::min({kMaxFrame, window, connection_window_, bytes - sent});
    if (n <= 0) break;
    std::string chunk(static_cast<size_t>(n), '\0');
    if (body == 0 && n >= 5) {
      const uint32_t m = static_cast<uint32_t>(message_bytes);
      chunk[1] = static_cast<char>(m >> 24);
      chunk[2] = static_cast<char>(m >> 16);
      chunk[3] = static_cast<char>(m >> 8);
      chunk[4] = static_cast<char>(m);
    }
    s = Frame(kData, 0, stream, chunk);
    if (!s.ok()) return s;
    window -= n;
    connection_window_ -= n;
    body += n;
    sent += n;
  }
  return sent;
}

absl::Status RawHttp2::Pump() {
  for (;;) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, 0) <= 0) break;
    char buf[65536];
    const ssize_t r = read(fd_, buf, sizeof(buf));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      return absl::UnavailableError("the daemon closed the connection");
    in_.append(buf, static_cast<size_t>(r));
  }
  size_t at = 0;
  while (in_.size() - at >= 9) {
    const uint32_t n = Be(in_, at, 3);
    if (in_.size() - at < 9 + n) break;
    const uint8_t type = static_cast<uint8_t>(in_[at + 3]);
    const uint8_t flags = static_cast<uint8_t>(in_[at + 4]);
    const uint32_t stream = Be(in_, at + 5, 4) & 0x7fffffff;
    const absl::string_view p(in_.data() + at + 9, n);
    at += 9 + n;
    if (type == kWindowUpdate && n == 4) {
      const int64_t inc = Be(p, 0, 4) & 0x7fffffff;
      if (stream == 0) {
        connection_window_ += inc;
      } else {
        stream_window_[stream] += inc;
      }
    } else if (type == kSettings && !(flags & kAck)) {
      for (size_t i = 0; i + 6 <= p.size(); i += 6) {
        if (Be(p, i, 2) == 4) {  // INITIAL_WINDOW_SIZE
          const int64_t v = Be(p, i + 2, 4);
          for (auto& [id, w] : stream_window_) w += v - initial_window_;
          initial_window_ = v;
        }
      }
      absl::Status s = Frame(kSettings, kAck, 0, "");
      if (!s.ok()) return s;
    } else if (type == kGoAway || type == kRstStream) {
      if (stream != 0) stream_window_[stream] = 0;
    }
  }
  in_.erase(0, at);
  return absl::OkStatus();
}

}  // namespace kvdepot::testing
