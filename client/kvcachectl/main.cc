// kvcachectl: the operator's CLI for kvdepot. main() only dispatches; each
// command lives in its own library.
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "client/kvcachectl/args.h"
#include "client/kvcachectl/commands.h"
#include "client/kvcachectl/format_cmd.h"
#include "common/version.h"

namespace {

constexpr char kTopHelp[] =
    "kvcachectl controls and inspects kvdepot, the KV-cache daemon.\n"
    "\n"
    "Usage: kvcachectl COMMAND [SUBCOMMAND] [ARGS] [flags]\n"
    "\n"
    "Commands:\n"
    "  status   health, version, backend, uptime, pools (the k8s probe)\n"
    "  pool     list, get, create, delete pools\n"
    "  stats    requests by method and code, latencies, tokens, bytes\n"
    "  plan     build a load plan for sequences and print its segments\n"
    "  inspect  decode the records of a slot or block\n"
    "  verify   scan a pool for bad scales and NaN/Inf; block checksums\n"
    "  drain    stop accepting new work; report in-flight requests\n"
    "  registrations  the decode step path's registrations and status\n"
    "  format   offline tools for the byte contract: list, layout, encode,\n"
    "           decode (no daemon needed)\n"
    "  version  print kvcachectl's version (also --version)\n"
    "\n"
    "Daemon commands take --addr ADDR (/path, unix:/path or host:port;\n"
    "default: $KVDEPOT_ADDR, else the daemon's default socket),\n"
    "-o table|json|yaml and --timeout 5s (verify: no deadline).\n"
    "\n"
    "Run `kvcachectl COMMAND --help` for a command's usage.\n"
    "Exit codes: 0 ok, 1 request failed, 2 usage error, 3 daemon "
    "unreachable.\n";

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args =
      kvdepot::ctl::HoistGlobalFlags({argv + 1, argv + argc});
  if (args.empty()) {
    std::cerr << kTopHelp;
    return kvdepot::ctl::kExitUsage;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  if (command == "--help" || command == "-h" || command == "help") {
    std::cout << kTopHelp;
    return kvdepot::ctl::kExitOk;
  }
  if (command == "--version" || command == "version") {
    if (!args.empty() && args[0] != "--help" && args[0] != "-h") {
      std::cerr << "error: version takes no arguments\n";
      return kvdepot::ctl::kExitUsage;
    }
    if (!args.empty()) {
      std::cout << "Usage: kvcachectl version\n\nPrints the version.\n";
    } else {
      std::cout << "kvcachectl " << kvdepot::kKvdepotVersion << "\n";
    }
    return kvdepot::ctl::kExitOk;
  }
  using Command =
      int (*)(const std::vector<std::string>&, std::ostream&, std::ostream&);
  const std::pair<const char*, Command> kCommands[] = {
      {"status", kvdepot::ctl::RunStatusCommand},
      {"pool", kvdepot::ctl::RunPoolCommand},
      {"stats", kvdepot::ctl::RunStatsCommand},
      {"plan", kvdepot::ctl::RunPlanCommand},
      {"inspect", kvdepot::ctl::RunInspectCommand},
      {"verify", kvdepot::ctl::RunVerifyCommand},
      {"drain", kvdepot::ctl::RunDrainCommand},
      {"registrations", kvdepot::ctl::RunRegistrationsCommand},
  };
  for (const auto& [name, run] : kCommands) {
    if (command == name) return run(args, std::cout, std::cerr);
  }
  if (command == "format") {
    return kvdepot::ctl::RunFormatCommand(args, std::cout, std::cerr);
  }
  std::cerr << "error: unknown command \"" << command << "\"\n\n" << kTopHelp;
  return kvdepot::ctl::kExitUsage;
}
