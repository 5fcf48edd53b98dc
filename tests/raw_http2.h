// A raw HTTP/2 client of the daemon's gRPC socket for attack tests: it
// speaks just enough of the protocol (the preface, SETTINGS, HEADERS with
// literal HPACK fields, DATA, WINDOW_UPDATE bookkeeping) to do what no
// well-behaved gRPC client does, e.g. never read a reply, or send most of
// a large message and stop.
#ifndef KVDEPOT_TESTS_RAW_HTTP2_H_
#define KVDEPOT_TESTS_RAW_HTTP2_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvdepot::testing {

class RawHttp2 {
 public:
  // Connects to the Unix socket `path` and sends the client preface with
  // SETTINGS: INITIAL_WINDOW_SIZE = `initial_window` when >= 0 (0: the
  // daemon may send no reply data), else none.
  static absl::StatusOr<RawHttp2> Connect(const std::string& path,
                                          int64_t initial_window);
  RawHttp2(RawHttp2&& other) noexcept;
  RawHttp2& operator=(RawHttp2&&) = delete;
  RawHttp2(const RawHttp2&) = delete;
  // Closes the connection.
  ~RawHttp2();

  // HEADERS (END_HEADERS) opening `stream` (odd) for the gRPC `method`
  // ("/kvdepot.v1.KVCache/Load").
  absl::Status OpenStream(uint32_t stream, absl::string_view method);
  // A whole gRPC message (length-prefixed) as one DATA frame with
  // END_STREAM. At most 16 KiB - 5 bytes.
  absl::Status SendMessage(uint32_t stream, absl::string_view message);
  // Sends up to `bytes` more of `stream`'s body (starting with a gRPC
  // prefix announcing a message of `message_bytes` when nothing was sent
  // yet) as far as the daemon's flow-control windows allow; returns how
  // many it sent. Reads (and answers) what the daemon sent first.
  absl::StatusOr<int64_t> SendBody(uint32_t stream, int64_t message_bytes,
                                   int64_t bytes);
  // Reads what the daemon sent, updating the windows. UNAVAILABLE when the
  // daemon closed the connection (every call here: never SIGPIPE).
  absl::Status Pump();

 private:
  explicit RawHttp2(int fd) : fd_(fd) {}
  absl::Status Frame(uint8_t type, uint8_t flags, uint32_t stream,
                     absl::string_view payload);

  int fd_ = -1;
  std::string in_;
  int64_t connection_window_ = 65535;
  int64_t initial_window_ = 65535;
  std::map<uint32_t, int64_t> stream_window_;
  std::map<uint32_t, int64_t> body_sent_;
};

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_RAW_HTTP2_H_
