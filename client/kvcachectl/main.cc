// kvcachectl: the operator's CLI for kvcached. main() only dispatches; each
// command lives in its own library.
#include <iostream>
#include <string>
#include <vector>

#include "client/kvcachectl/args.h"
#include "client/kvcachectl/commands.h"
#include "client/kvcachectl/format_cmd.h"

namespace {

constexpr char kTopHelp[] =
    "kvcachectl controls and inspects kvcached, the KV-cache daemon.\n"
    "\n"
    "Usage: kvcachectl COMMAND [SUBCOMMAND] [ARGS] [flags]\n"
    "\n"
    "Commands:\n"
    "  status   health, version, backend, uptime, pools (the k8s probe)\n"
    "  format   offline tools for the byte contract: list, layout, encode,\n"
    "           decode (no daemon needed)\n"
    "\n"
    "Daemon commands take --addr ADDR (/path, unix:/path or host:port;\n"
    "default: the daemon's default socket), -o table|json, --timeout 5s.\n"
    "\n"
    "Run `kvcachectl COMMAND --help` for a command's usage.\n"
    "Exit codes: 0 ok, 1 request failed, 2 usage error, 3 daemon "
    "unreachable.\n";

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    std::cerr << kTopHelp;
    return kvcache::ctl::kExitUsage;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  if (command == "--help" || command == "-h" || command == "help") {
    std::cout << kTopHelp;
    return kvcache::ctl::kExitOk;
  }
  if (command == "status") {
    return kvcache::ctl::RunStatusCommand(args, std::cout, std::cerr);
  }
  if (command == "format") {
    return kvcache::ctl::RunFormatCommand(args, std::cout, std::cerr);
  }
  std::cerr << "error: unknown command \"" << command << "\"\n\n" << kTopHelp;
  return kvcache::ctl::kExitUsage;
}
