// A small kubectl-style argument parser for kvcachectl's subcommands.
//
// Each subcommand declares the flags it accepts; the parser takes
// `--name=value`, `--name value`, `-o value` (alias of --output), bare
// boolean flags, `--help`/`-h`, and positional arguments. Unknown flags and
// missing values are usage errors (exit code 2), so a typo never silently
// runs a different request.
#ifndef KVDEPOT_CLIENT_KVCACHECTL_ARGS_H_
#define KVDEPOT_CLIENT_KVCACHECTL_ARGS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvdepot::ctl {

// Exit codes of kvcachectl (documented in the README).
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;       // the request failed
inline constexpr int kExitUsage = 2;        // bad command line
inline constexpr int kExitUnreachable = 3;  // the daemon could not be reached

struct FlagSpec {
  std::string name;           // without dashes, e.g. "block_size"
  std::string help;           // one line
  std::string default_value;  // shown in --help; "" means none
  bool is_bool = false;       // takes no value
};

struct CommandSpec {
  std::string usage;        // e.g. "kvcachectl format layout FORMAT [flags]"
  std::string description;  // a paragraph
  std::vector<FlagSpec> flags;
};

class ParsedArgs {
 public:
  const std::vector<std::string>& positional() const { return positional_; }
  bool help() const { return help_; }
  bool Has(absl::string_view name) const;
  // The flag's value, or its declared default.
  std::string Get(absl::string_view name) const;
  // Integer flag; INVALID_ARGUMENT naming the flag when not an integer or
  // outside [min, max].
  absl::StatusOr<int64_t> GetInt(absl::string_view name, int64_t min,
                                 int64_t max) const;

 private:
  friend absl::StatusOr<ParsedArgs> ParseArgs(const CommandSpec&,
                                              const std::vector<std::string>&);
  const CommandSpec* spec_ = nullptr;
  std::map<std::string, std::string, std::less<>> values_;
  std::vector<std::string> positional_;
  bool help_ = false;
};

// Parses `args` (everything after the subcommand words) against `spec`.
absl::StatusOr<ParsedArgs> ParseArgs(const CommandSpec& spec,
                                     const std::vector<std::string>& args);

// The --help text of a command.
std::string HelpText(const CommandSpec& spec);

// kubectl-style global flags may come before the command
// (`kvcachectl --addr /tmp/kv.sock -o json pool list`): moves a leading run
// of --addr, --timeout and -o/--output (with `=VALUE` or a separate value)
// behind the command words, where the command's parser reads them.
std::vector<std::string> HoistGlobalFlags(std::vector<std::string> args);

}  // namespace kvdepot::ctl

#endif  // KVDEPOT_CLIENT_KVCACHECTL_ARGS_H_
