// kvcachectl drain: the Drain RPC.
#include "absl/strings/str_cat.h"
#include "client/kvcachectl/commands.h"
#include "client/kvcachectl/daemon_cmd.h"

namespace kvdepot::ctl {

namespace {

const CommandSpec kDrainSpec{
    "kvcachectl drain [flags]",
    "Stops the daemon accepting new work: health turns NOT_SERVING (so a\n"
    "readiness probe takes it out of service) and new sessions, buffers,\n"
    "pools and cache operations get UNAVAILABLE; reads (stats, pools,\n"
    "inspect, verify) keep working. Reports the requests in flight and the\n"
    "open sessions. One-way: restart the daemon (SIGTERM) to finish.",
    DaemonFlags({})};

}  // namespace

int RunDrainCommand(const Args& args, std::ostream& out, std::ostream& err) {
  ParsedArgs parsed;
  DaemonCall call;
  if (int rc = ParseDaemonArgs(kDrainSpec, args, out, err, &parsed, &call);
      rc >= 0) {
    return rc;
  }
  if (!parsed.positional().empty()) {
    return UsageError("drain takes no arguments", kDrainSpec, err);
  }
  if (int rc = Connect(&call, err); rc >= 0) return rc;
  v1::DrainResponse r;
  std::unique_ptr<grpc::ClientContext> ctx = call.Context();
  grpc::Status s = call.client->stub()->Drain(ctx.get(), {}, &r);
  if (!s.ok()) return Fail(FromGrpcStatus(s), err);
  if (call.structured()) {
    PrintProto(r, call, out);
    return kExitOk;
  }
  PrintTable({{"draining:", r.started() ? "started now" : "already draining"},
              {"in flight:", absl::StrCat(r.in_flight(), " requests")},
              {"sessions:", absl::StrCat(r.sessions(), " open (", r.buffers(),
                                         " buffers)")}},
             out);
  return kExitOk;
}

}  // namespace kvdepot::ctl
