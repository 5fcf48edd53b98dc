#include "server/logging.h"

#include <grpc/support/log.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/stubs/logging.h"
#include "server/log_limiter.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace kvdepot {
namespace {

constexpr const char* kLevels[] = {"trace", "debug", "info",
                                   "warn",  "error", "off"};
constexpr spdlog::level::level_enum kLevelValues[] = {
    spdlog::level::trace, spdlog::level::debug, spdlog::level::info,
    spdlog::level::warn,  spdlog::level::err,   spdlog::level::off};

// %* in a pattern: the message as the inside of a JSON string.
class JsonMessageFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    const std::string s =
        JsonEscape(absl::string_view(msg.payload.data(), msg.payload.size()));
    dest.append(s.data(), s.data() + s.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonMessageFlag>();
  }
};

}  // namespace

std::string EscapeForLog(absl::string_view value, size_t max_bytes) {
  std::string out;
  const absl::string_view kept = value.substr(0, max_bytes);
  out.reserve(kept.size());
  for (const char c : kept) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u >= 0x7f || c == '"' || c == '\\') {
      absl::StrAppendFormat(&out, "\\x%02x", u);
    } else {
      out.push_back(c);
    }
  }
  if (kept.size() < value.size()) {
    absl::StrAppend(&out, "...(", value.size(), " bytes)");
  }
  return out;
}

std::string JsonEscape(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (u < 0x20) {
      absl::StrAppendFormat(&out, "\\u%04x", u);
    } else {
      out.push_back(c);
    }
  }
  return out;
}

absl::Status CheckLogFlags(absl::string_view level, absl::string_view format) {
  bool known = false;
  for (const char* l : kLevels) known = known || level == l;
  if (!known) {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_level = \"", EscapeForLog(level),
                     "\" is not one of trace, debug, info, warn, error, off"));
  }
  if (format != "text" && format != "json") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--log_format = \"", EscapeForLog(format), "\" is not text or json"));
  }
  return absl::OkStatus();
}

namespace {

// libprotobuf's own messages. The ones a running daemon gets come from
// parsing what clients sent (ERROR "String field ... contains invalid UTF-8
// data when parsing a protocol buffer", on every such message of a gRPC
// call, a companion message or a step ring): at the default level they
// would let any client write a line per message. They go to the log at
// debug level, escaped; FATAL (protobuf aborts after it) at error.
void ProtobufLog(google::protobuf::LogLevel level, const char* filename,
                 int line, const std::string& message) {
  const std::string text = absl::StrCat("libprotobuf ", filename, ":", line,
                                        " ", EscapeForLog(message));
  if (level == google::protobuf::LOGLEVEL_FATAL) {
    spdlog::error("{}", text);
  } else {
    spdlog::debug("{}", text);
  }
}

// gRPC's own lines, which a client can cause too: every connection to the
// mutual-TLS port whose handshake fails ("Handshake failed with fatal
// error ...", also for bytes that are not TLS at all) is one ERROR line, as
// are other protocol errors. gRPC writes them to stderr itself, unescaped,
// in its own format and without a limit. Here they go to the log like
// every other line (text or JSON, the message escaped and cut at 2000
// bytes) at gRPC's severity, through the rate limit of their own kind
// (ClientLog::kGrpc; they name no client, so all of them take the kind's
// shared half). gRPC's GRPC_VERBOSITY still chooses which severities
// arrive (ERROR by default). Two exceptions pass always: the lines gRPC
// writes right before it aborts (GPR_ASSERT's "assertion failed",
// gpr_unreachable_code's "UNREACHABLE CODE"; there is at most one), and
// lines that arrive once the log is gone at exit, which go to stderr as
// gRPC would write them.
std::atomic<bool> g_grpc_routed{false};

bool PrecedesAbort(absl::string_view message) {
  return absl::StartsWith(message, "assertion failed") ||
         absl::StartsWith(message, "UNREACHABLE CODE");
}

void GrpcLog(gpr_log_func_args* args) {
  const char* file = args->file != nullptr ? args->file : "?";
  const char* slash = std::strrchr(file, '/');
  const char* base = slash != nullptr ? slash + 1 : file;
  const absl::string_view message =
      args->message != nullptr ? args->message : "";
  if (!g_grpc_routed.load(std::memory_order_acquire)) {
    std::fprintf(stderr, "%s %s:%d] %s\n",
                 gpr_log_severity_string(args->severity), base, args->line,
                 std::string(message).c_str());
    return;
  }
  const spdlog::level::level_enum level =
      args->severity == GPR_LOG_SEVERITY_ERROR  ? spdlog::level::err
      : args->severity == GPR_LOG_SEVERITY_INFO ? spdlog::level::info
                                                : spdlog::level::debug;
  // Lines --log_level hides take nothing from the limit.
  if (!spdlog::should_log(level)) return;
  if (!PrecedesAbort(message) &&
      !AdmitClientLog(ClientLog::kGrpc, LogClient::Unidentified())) {
    return;
  }
  spdlog::log(level, "grpc {}:{} {}", base, args->line,
              EscapeForLog(message, 2000));
}

void RouteGrpcLogs() {
  static const bool once = [] {
    gpr_set_log_function(&GrpcLog);
    // Static destructors (spdlog's registry among them) run after this:
    // a gRPC thread that logs during exit writes to stderr instead.
    std::atexit([] { g_grpc_routed.store(false, std::memory_order_release); });
    return true;
  }();
  (void)once;
  g_grpc_routed.store(true, std::memory_order_release);
}

}  // namespace

absl::Status InitLogging(absl::string_view level, absl::string_view format) {
  if (absl::Status s = CheckLogFlags(level, format); !s.ok()) return s;
  auto logger = std::make_shared<spdlog::logger>(
      "kvdepotd", std::make_shared<spdlog::sinks::stderr_sink_mt>());
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  if (format == "json") {
    formatter->add_flag<JsonMessageFlag>('*').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%f%z","level":"%l","logger":"%n","msg":"%*"})");
  } else {
    formatter->set_pattern("%Y-%m-%dT%H:%M:%S.%f%z %l %n %v");
  }
  logger->set_formatter(std::move(formatter));
  for (size_t i = 0; i < std::size(kLevels); ++i) {
    if (level == kLevels[i]) logger->set_level(kLevelValues[i]);
  }
  logger->flush_on(spdlog::level::trace);
  spdlog::set_default_logger(std::move(logger));
  google::protobuf::SetLogHandler(&ProtobufLog);
  RouteGrpcLogs();
  return absl::OkStatus();
}

}  // namespace kvdepot
