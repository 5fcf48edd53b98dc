#include "client/kvcachectl/daemon_cmd.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace kvdepot::ctl {

std::vector<FlagSpec> DaemonFlags(std::vector<FlagSpec> own, bool streaming) {
  own.push_back(
      {"addr",
       absl::StrCat("daemon address: /path, unix:/path or host:port "
                    "(default: $",
                    kAddressEnv, ", else the daemon's default socket)"),
       ""});
  own.push_back({"output", "output format: table, json or yaml", "table"});
  if (streaming) {
    own.push_back({"timeout",
                   "deadline of the whole call, e.g. 10m (default: none; "
                   "connecting waits at most 5s)",
                   ""});
  } else {
    own.push_back(
        {"timeout", "deadline of each request, e.g. 500ms, 5s", "5s"});
  }
  return own;
}

std::string DaemonAddress(const ParsedArgs& parsed) {
  if (parsed.Has("addr")) return parsed.Get("addr");
  const char* env = std::getenv(kAddressEnv);
  return env != nullptr ? std::string(env) : std::string();
}

std::unique_ptr<grpc::ClientContext> DaemonCall::Context() const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  if (has_deadline) {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      absl::ToChronoMilliseconds(timeout));
  }
  return ctx;
}

int UsageError(absl::string_view message, const CommandSpec& spec,
               std::ostream& err) {
  err << "error: " << message << "\n\n" << HelpText(spec);
  return kExitUsage;
}

int ParseOnly(const CommandSpec& spec, const std::vector<std::string>& args,
              std::ostream& out, std::ostream& err, ParsedArgs* parsed) {
  absl::StatusOr<ParsedArgs> p = ParseArgs(spec, args);
  if (!p.ok()) return UsageError(p.status().message(), spec, err);
  if (p->help()) {
    out << HelpText(spec);
    return kExitOk;
  }
  *parsed = *std::move(p);
  return -1;
}

int ParseDaemonArgs(const CommandSpec& spec,
                    const std::vector<std::string>& args, std::ostream& out,
                    std::ostream& err, ParsedArgs* parsed, DaemonCall* call) {
  if (int rc = ParseOnly(spec, args, out, err, parsed); rc >= 0) return rc;
  const std::string output = parsed->Get("output");
  if (output == "table") {
    call->format = OutputFormat::kTable;
  } else if (output == "json") {
    call->format = OutputFormat::kJson;
  } else if (output == "yaml") {
    call->format = OutputFormat::kYaml;
  } else {
    return UsageError(
        absl::StrCat("--output = \"", output, "\" is not table, json or yaml"),
        spec, err);
  }
  const std::string timeout = parsed->Get("timeout");
  call->has_deadline = !timeout.empty();
  call->timeout = absl::Seconds(5);  // connecting, when there is no deadline
  if (call->has_deadline && (!absl::ParseDuration(timeout, &call->timeout) ||
                             call->timeout <= absl::ZeroDuration() ||
                             call->timeout == absl::InfiniteDuration())) {
    return UsageError(absl::StrCat("--timeout = \"", timeout,
                                   "\" is not a positive duration like 5s"),
                      spec, err);
  }
  call->options.address = DaemonAddress(*parsed);
  call->options.client_name = "kvcachectl";
  call->options.open_session =
      true;  // a companion session: the caller's identity
  call->options.keep_alive = false;
  call->options.timeout = call->timeout;
  call->options.connect_timeout = std::min(call->timeout, absl::Seconds(5));
  if (call->has_deadline) call->options.connect_timeout = call->timeout;
  return -1;
}

int Connect(DaemonCall* call, std::ostream& err) {
  absl::StatusOr<std::unique_ptr<KVCacheClient>> client =
      KVCacheClient::Connect(call->options);
  if (!client.ok()) {
    err << "error: " << client.status().message() << "\n";
    return kExitUnreachable;
  }
  call->client = *std::move(client);
  return -1;
}

std::vector<FieldViolation> BadRequestViolations(const absl::Status& status) {
  std::vector<FieldViolation> out;
  auto payload = status.GetPayload(kGrpcStatusDetailsUrl);
  google::rpc::Status details;
  if (!payload.has_value() || !details.ParseFromString(std::string(*payload))) {
    return out;
  }
  for (const google::protobuf::Any& any : details.details()) {
    google::rpc::BadRequest bad;
    if (!any.UnpackTo(&bad)) continue;
    for (const auto& v : bad.field_violations()) {
      out.push_back({v.field(), v.description()});
    }
  }
  return out;
}

int Fail(const absl::Status& status, std::ostream& err) {
  err << "error: " << absl::StatusCodeToString(status.code()) << ": "
      << status.message() << "\n";
  for (const FieldViolation& v : BadRequestViolations(status)) {
    err << "  field " << v.field << ": " << v.description << "\n";
  }
  if (status.code() == absl::StatusCode::kUnavailable &&
      !absl::StrContains(status.message(), "draining")) {
    return kExitUnreachable;
  }
  return kExitFailed;
}

void PrintProto(const google::protobuf::Message& m, const DaemonCall& call,
                std::ostream& out) {
  PrintStructured(ProtoToJson(m), call.format, out);
}

void PrintJson(const Json& j, const DaemonCall& call, std::ostream& out) {
  PrintStructured(j, call.format, out);
}

std::string HumanBytes(int64_t bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  if (u == 0) return absl::StrCat(bytes, " B");
  return absl::StrFormat("%.1f %s", v, kUnits[u]);
}

void PrintTable(const std::vector<std::vector<std::string>>& rows,
                std::ostream& out) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    width.resize(std::max(width.size(), row.size()));
    for (size_t i = 0; i < row.size(); ++i) {
      width[i] = std::max(width[i], row[i].size());
    }
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size())
        line += std::string(width[i] - row[i].size() + 2, ' ');
    }
    out << line << "\n";
  }
}

}  // namespace kvdepot::ctl
