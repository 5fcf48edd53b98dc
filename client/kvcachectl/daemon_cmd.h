// What every daemon-talking kvcachectl command shares: the global flags
// (--addr, -o/--output, --timeout), connecting without a session, status
// -> exit code mapping (UNAVAILABLE / DEADLINE_EXCEEDED on connect = 3, a
// failed request = 1), JSON output of protos, and small table helpers.
#ifndef KVDEPOT_CLIENT_KVCACHECTL_DAEMON_CMD_H_
#define KVDEPOT_CLIENT_KVCACHECTL_DAEMON_CMD_H_

#include <google/protobuf/message.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "client/kvdepot_client.h"
#include "client/kvcachectl/args.h"

namespace kvdepot::ctl {

// --addr, --output (-o), --timeout: append to a command's flags.
std::vector<FlagSpec> DaemonFlags(std::vector<FlagSpec> own);

struct DaemonCall {
  std::unique_ptr<KVCacheClient> client;
  bool json = false;
  absl::Duration timeout;

  // A context with the --timeout deadline.
  std::unique_ptr<grpc::ClientContext> Context() const;
};

// Parses `args` against `spec` (which must include DaemonFlags), prints
// --help / usage errors, and connects. Returns the exit code to stop with,
// or -1 with *call (and *parsed) ready.
int ParseAndConnect(const CommandSpec& spec,
                    const std::vector<std::string>& args, std::ostream& out,
                    std::ostream& err, ParsedArgs* parsed, DaemonCall* call);

// Parses args only (help and usage handled); -1 to go on.
int ParseOnly(const CommandSpec& spec, const std::vector<std::string>& args,
              std::ostream& out, std::ostream& err, ParsedArgs* parsed);

// Prints "error: ..." and returns the exit code for a failed request:
// kExitUnreachable for UNAVAILABLE without a drain message or for a
// DEADLINE_EXCEEDED while connecting, else kExitFailed.
int Fail(const absl::Status& status, std::ostream& err);
int UsageError(absl::string_view message, const CommandSpec& spec,
               std::ostream& err);

// Compact JSON of a proto (field names as in the .proto, int64 as numbers
// in strings per the proto3 JSON mapping).
std::string ToJson(const google::protobuf::Message& m);

// "1.5 MiB", "12 B".
std::string HumanBytes(int64_t bytes);
// Left-aligned columns, two spaces apart; the first row is the header.
void PrintTable(const std::vector<std::vector<std::string>>& rows,
                std::ostream& out);

}  // namespace kvdepot::ctl

#endif  // KVDEPOT_CLIENT_KVCACHECTL_DAEMON_CMD_H_
