// The daemon's logs: spdlog to stderr, one line per event, timestamps in
// ISO 8601 with the zone offset, as text or as one JSON object per line.
// Values a client chose (pool names, buffer ids, error messages quoting
// them) go through EscapeForLog so a name cannot forge or break a line.
//
//   text: 2025-01-31T12:00:00.123456+01:00 info kvdepotd rpc=GetPool ...
//   json: {"time":"2025-01-31T12:00:00.123456+01:00","level":"info",
//          "logger":"kvdepotd","msg":"rpc=GetPool ..."}
#ifndef KVDEPOT_SERVER_LOGGING_H_
#define KVDEPOT_SERVER_LOGGING_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvdepot {

// The longest untrusted value kept in a log line, in bytes before escaping.
inline constexpr size_t kMaxLoggedValueBytes = 200;

// `value` with control characters, DEL, '"', '\\' and bytes >= 0x80 written
// as \xNN, cut after `max_bytes` input bytes with "...(N bytes)" appended.
// The result is printable ASCII without quotes, so it is safe inside
// key="value" text and inside a JSON string.
std::string EscapeForLog(absl::string_view value,
                         size_t max_bytes = kMaxLoggedValueBytes);

// `text` as the inside of a JSON string (quotes, backslashes and control
// characters escaped; other bytes as they are).
std::string JsonEscape(absl::string_view text);

// INVALID_ARGUMENT naming the flag unless `level` is one of trace, debug,
// info, warn, error, off and `format` is text or json.
absl::Status CheckLogFlags(absl::string_view level, absl::string_view format);

// Makes the default spdlog logger write to stderr in `format` at `level`
// (both as CheckLogFlags accepts). Also takes over libprotobuf's messages
// (debug level: they quote clients' bytes) and gRPC's own lines (at gRPC's
// severity, escaped, limited as lines clients cause: ClientLog::kGrpc).
absl::Status InitLogging(absl::string_view level, absl::string_view format);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_LOGGING_H_
