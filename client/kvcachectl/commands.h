// The daemon-talking kvcachectl commands. Each returns the process exit
// code (args.h: 0 ok, 1 request failed, 2 usage, 3 daemon unreachable) and
// takes everything after its command word.
#ifndef KVDEPOT_CLIENT_KVCACHECTL_COMMANDS_H_
#define KVDEPOT_CLIENT_KVCACHECTL_COMMANDS_H_

#include <ostream>
#include <string>
#include <vector>

namespace kvdepot::ctl {

using Args = std::vector<std::string>;

// status: health, version, backend, devices, uptime, pools. Exit 0 only
// when health is SERVING; 1 when the daemon answers NOT_SERVING
// (draining); 3 when unreachable. The Kubernetes exec probe.
int RunStatusCommand(const Args& args, std::ostream& out, std::ostream& err);
// pool list | get NAME | create NAME ... | delete NAME
int RunPoolCommand(const Args& args, std::ostream& out, std::ostream& err);
// stats: calls by method and status, latencies, tokens/bytes, rejections.
int RunStatsCommand(const Args& args, std::ostream& out, std::ostream& err);
// plan: BuildPlan from a JSON file or flags; prints the segments.
int RunPlanCommand(const Args& args, std::ostream& out, std::ostream& err);
// inspect POOL --layer L (--slot S | --block B): decoded records.
int RunInspectCommand(const Args& args, std::ostream& out, std::ostream& err);
// verify POOL [--layers ...]: scan for bad scales and NaN/Inf, checksums.
// Exit 1 when any block has a problem.
int RunVerifyCommand(const Args& args, std::ostream& out, std::ostream& err);
// drain: stop accepting new work; report in-flight requests.
int RunDrainCommand(const Args& args, std::ostream& out, std::ostream& err);
// registrations: the step path's registrations (SPEC §10) visible to the
// caller, with their step counters and status.
int RunRegistrationsCommand(const Args& args, std::ostream& out,
                            std::ostream& err);

}  // namespace kvdepot::ctl

#endif  // KVDEPOT_CLIENT_KVCACHECTL_COMMANDS_H_
