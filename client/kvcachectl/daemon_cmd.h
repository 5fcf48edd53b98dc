// What every daemon-talking kvcachectl command shares: the global flags
// (--addr, -o/--output, --timeout), the address (--addr, else $KVDEPOT_ADDR,
// else the default socket), connecting without a session only after the
// command line was checked (usage errors exit 2 even with no daemon),
// status -> exit code mapping (UNAVAILABLE / DEADLINE_EXCEEDED on connect
// = 3, a failed request = 1) with google.rpc.BadRequest field paths, and
// small table helpers.
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
#include "client/kvcachectl/args.h"
#include "client/kvcachectl/output.h"
#include "client/kvdepot_client.h"

namespace kvdepot::ctl {

// The environment variable naming the daemon's address when --addr is
// not given.
inline constexpr char kAddressEnv[] = "KVDEPOT_ADDR";

// --addr, --output (-o), --timeout: append to a command's flags. A
// streaming command (verify) has no deadline unless --timeout is given.
std::vector<FlagSpec> DaemonFlags(std::vector<FlagSpec> own,
                                  bool streaming = false);

// --addr if given, else $KVDEPOT_ADDR if set and not empty, else "" (the
// default socket).
std::string DaemonAddress(const ParsedArgs& parsed);

struct DaemonCall {
  std::unique_ptr<KVCacheClient> client;  // set by Connect
  ClientOptions options;                  // set by ParseDaemonArgs
  OutputFormat format = OutputFormat::kTable;
  bool has_deadline = true;  // false: streaming without --timeout
  absl::Duration timeout;    // each request's deadline when has_deadline

  // -o json or -o yaml.
  bool structured() const { return format != OutputFormat::kTable; }
  // A context with the --timeout deadline (none when !has_deadline).
  std::unique_ptr<grpc::ClientContext> Context() const;
};

// Parses `args` against `spec` (which must include DaemonFlags), prints
// --help / usage errors and checks --output and --timeout. Connects to
// nothing. Returns the exit code to stop with, or -1 with *call (and
// *parsed) ready for Connect.
int ParseDaemonArgs(const CommandSpec& spec,
                    const std::vector<std::string>& args, std::ostream& out,
                    std::ostream& err, ParsedArgs* parsed, DaemonCall* call);

// Connects to the daemon (no session). Returns kExitUnreachable after
// printing why, or -1 with call->client set. Call it only after every
// usage check, so a usage error never waits for a daemon.
int Connect(DaemonCall* call, std::ostream& err);

// Parses args only (help and usage handled); -1 to go on.
int ParseOnly(const CommandSpec& spec, const std::vector<std::string>& args,
              std::ostream& out, std::ostream& err, ParsedArgs* parsed);

// A google.rpc.BadRequest field violation from a failed call's details.
struct FieldViolation {
  std::string field;  // e.g. "layer" or "block_table[3]"
  std::string description;
};
std::vector<FieldViolation> BadRequestViolations(const absl::Status& status);

// Prints "error: CODE: message" (plus one "  field PATH: description"
// line per google.rpc.BadRequest violation in the status details) and
// returns the exit code for a failed request: kExitUnreachable for
// UNAVAILABLE without a drain message, else kExitFailed.
int Fail(const absl::Status& status, std::ostream& err);
int UsageError(absl::string_view message, const CommandSpec& spec,
               std::ostream& err);

// Prints `m` (ProtoToJson) or `j` in the call's -o format.
void PrintProto(const google::protobuf::Message& m, const DaemonCall& call,
                std::ostream& out);
void PrintJson(const Json& j, const DaemonCall& call, std::ostream& out);

// "1.5 MiB", "12 B".
std::string HumanBytes(int64_t bytes);
// Left-aligned columns, two spaces apart; the first row is the header.
void PrintTable(const std::vector<std::vector<std::string>>& rows,
                std::ostream& out);

}  // namespace kvdepot::ctl

#endif  // KVDEPOT_CLIENT_KVCACHECTL_DAEMON_CMD_H_
