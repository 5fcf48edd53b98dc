// The daemon's command line before it starts: --help/-h (what kvdepotd is,
// its usage and every flag of its main file), --version, and checks that
// turn a mistyped flag or value into a clear message and exit code 2
// instead of absl's exit 1 or a silently different daemon.
#ifndef KVDEPOT_SERVER_COMMAND_LINE_H_
#define KVDEPOT_SERVER_COMMAND_LINE_H_

#include <ostream>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvdepot {

inline constexpr int kExitStartFailed = 1;  // e.g. the address is taken
inline constexpr int kExitUsage = 2;        // a bad flag or value

// Handles -h/--help and --version anywhere on the command line: prints
// `about`, then the usage and every flag defined in a file whose path ends
// with `flags_file` (name, type, default, help), or the version, to `out`.
// Returns the exit code (0), or -1 when neither was asked for.
int HandleHelpAndVersion(int argc, char** argv, absl::string_view about,
                         absl::string_view flags_file, std::ostream& out);

// Checks every argument before absl parses them: each is a known flag
// (--name=value, --name value, --bool, --nobool) whose value parses;
// positional arguments are refused. INVALID_ARGUMENT naming the flag.
// absl's own usage flags (--helpfull, ...) are left to absl.
absl::Status CheckFlagSyntax(int argc, char** argv);

// `value` of `flag` is "host:port" with port in [1, 65535], or 0 to pick a
// free one; for --listen, also "" or a Unix socket ("/path", "unix:...").
absl::Status CheckAddressFlag(absl::string_view flag, absl::string_view value,
                              bool unix_allowed);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_COMMAND_LINE_H_
