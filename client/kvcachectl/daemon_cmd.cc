#include "client/kvcachectl/daemon_cmd.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvdepot::ctl {

std::vector<FlagSpec> DaemonFlags(std::vector<FlagSpec> own) {
  own.push_back({"addr",
                 "daemon address: /path, unix:/path or host:port (default: "
                 "the daemon's default socket)",
                 ""});
  own.push_back({"output", "output format: table or json", "table"});
  own.push_back({"timeout", "deadline of each request, e.g. 500ms, 5s", "5s"});
  return own;
}

std::unique_ptr<grpc::ClientContext> DaemonCall::Context() const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() +
                    absl::ToChronoMilliseconds(timeout));
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

int ParseAndConnect(const CommandSpec& spec,
                    const std::vector<std::string>& args, std::ostream& out,
                    std::ostream& err, ParsedArgs* parsed, DaemonCall* call) {
  if (int rc = ParseOnly(spec, args, out, err, parsed); rc >= 0) return rc;
  const std::string output = parsed->Get("output");
  if (output != "table" && output != "json") {
    return UsageError(
        absl::StrCat("--output = \"", output, "\" is not table or json"), spec,
        err);
  }
  call->json = output == "json";
  if (!absl::ParseDuration(parsed->Get("timeout"), &call->timeout) ||
      call->timeout <= absl::ZeroDuration()) {
    return UsageError(absl::StrCat("--timeout = \"", parsed->Get("timeout"),
                                   "\" is not a positive duration like 5s"),
                      spec, err);
  }
  ClientOptions options;
  options.address = parsed->Get("addr");
  options.client_name = "kvcachectl";
  options.open_session = true;  // a companion session: the caller's identity
  options.keep_alive = false;
  options.timeout = call->timeout;
  options.connect_timeout = call->timeout;
  absl::StatusOr<std::unique_ptr<KVCacheClient>> client =
      KVCacheClient::Connect(options);
  if (!client.ok()) {
    err << "error: " << client.status().message() << "\n";
    return kExitUnreachable;
  }
  call->client = *std::move(client);
  return -1;
}

int Fail(const absl::Status& status, std::ostream& err) {
  err << "error: " << absl::StatusCodeToString(status.code()) << ": "
      << status.message() << "\n";
  if (status.code() == absl::StatusCode::kUnavailable &&
      !absl::StrContains(status.message(), "draining")) {
    return kExitUnreachable;
  }
  return kExitFailed;
}

std::string ToJson(const google::protobuf::Message& m) {
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  o.always_print_primitive_fields = true;
  std::string s;
  (void)google::protobuf::util::MessageToJsonString(m, &s, o);
  return s;
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
