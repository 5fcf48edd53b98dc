// kvcachectl registrations: the step path's registrations (SPEC §10) the
// caller may see (owned, granted; all for an admin), from the Step
// service's ListRegistrations.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/kvcachectl/commands.h"
#include "client/kvcachectl/daemon_cmd.h"
#include "client/kvcachectl/step_status.h"
#include "kvdepot/v1/step.grpc.pb.h"

namespace kvdepot::ctl {

namespace {

const CommandSpec kRegistrationsSpec{
    "kvcachectl registrations [flags]",
    "Lists the decode step path's registrations this identity may see (its\n"
    "own, those granted to it; all for an admin): layers, last accepted and\n"
    "finished step, steps in flight, sticky status bits (1 step-id\n"
    "mismatch, 2 cancelled, 4 out-of-range entries, 8 worker watchdog,\n"
    "16 daemon error),\n"
    "out-of-range count, watchdog expiries, the median GPU time of a\n"
    "layer's phase (timed steps: kvdepotd --step_timing_every; - before\n"
    "the first) and the cancel reason.",
    DaemonFlags({})};

}  // namespace

int RunRegistrationsCommand(const Args& args, std::ostream& out,
                            std::ostream& err) {
  ParsedArgs parsed;
  DaemonCall call;
  if (int rc =
          ParseDaemonArgs(kRegistrationsSpec, args, out, err, &parsed, &call);
      rc >= 0) {
    return rc;
  }
  if (!parsed.positional().empty()) {
    return UsageError("registrations takes no arguments", kRegistrationsSpec,
                      err);
  }
  if (int rc = Connect(&call, err); rc >= 0) return rc;
  std::unique_ptr<v1::Step::Stub> stub =
      v1::Step::NewStub(call.client->channel());
  v1::ListRegistrationsRequest req;
  req.set_session_id(call.client->session_id());
  v1::ListRegistrationsResponse r;
  std::unique_ptr<grpc::ClientContext> ctx = call.Context();
  grpc::Status s = stub->ListRegistrations(ctx.get(), req, &r);
  if (!s.ok()) return Fail(FromGrpcStatus(s), err);
  if (call.structured()) {
    PrintProto(r, call, out);
    return kExitOk;
  }
  std::vector<std::vector<std::string>> rows = {
      {"ID", "NAME", "SESSION", "UID", "LAYERS", "LAST", "DONE", "IN FLIGHT",
       "STATUS", "OUT OF RANGE", "WATCHDOG", "PHASE P50 US", "CANCELLED"}};
  for (const v1::RegistrationInfo& i : r.registrations()) {
    rows.push_back(
        {absl::StrCat(i.registration_id()), TerminalSafe(i.name()),
         absl::StrCat(i.owner_session()), absl::StrCat(i.owner_uid()),
         absl::StrCat(i.num_layers()), absl::StrCat(i.last_step_id()),
         absl::StrCat(i.completed_step_id()), absl::StrCat(i.in_flight()),
         StepStatusNames(i.status_bits()), absl::StrCat(i.out_of_range()),
         absl::StrCat(i.watchdog_expiries()),
         i.handoff_p50_us() > 0 ? absl::StrFormat("%.1f", i.handoff_p50_us())
                                : std::string("-"),
         i.cancelled() ? TerminalSafe(i.cancel_reason()) : "-"});
  }
  PrintTable(rows, out);
  return kExitOk;
}

}  // namespace kvdepot::ctl
