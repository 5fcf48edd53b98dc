// kvcachectl status: grpc.health.v1 Check("") + Stats + ListPools + Ping.
#include <grpcpp/generic/generic_stub.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/kvcachectl/commands.h"
#include "client/kvcachectl/daemon_cmd.h"

namespace kvdepot::ctl {
namespace {

const CommandSpec kStatusSpec{
    "kvcachectl status [--addr ADDR] [-o table|json] [--timeout 5s]",
    "Health, version, backend, devices, uptime and pools of the daemon.\n"
    "Exit 0 only when health is SERVING, 1 when the daemon answers but is\n"
    "NOT_SERVING (draining), 3 when it cannot be reached: usable as a\n"
    "Kubernetes exec probe:\n"
    "  kvcachectl status --addr unix:/run/kvdepot/daemon/kvdepotd.sock",
    DaemonFlags({})};

// grpc.health.v1.Health/Check with service "" (an empty request). The
// reply is HealthCheckResponse: field 1 (varint) = 1 SERVING,
// 2 NOT_SERVING, 0 UNKNOWN, 3 SERVICE_UNKNOWN.
absl::StatusOr<int> HealthCheck(const DaemonCall& call) {
  grpc::GenericStub stub(call.client->channel());
  std::unique_ptr<grpc::ClientContext> ctx = call.Context();
  grpc::Slice empty("");
  grpc::ByteBuffer request(&empty, 1), response;
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(ctx.get(), "/grpc.health.v1.Health/Check", grpc::StubOptions(),
                 &request, &response, [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  if (!status.ok()) return FromGrpcStatus(status);
  std::vector<grpc::Slice> slices;
  (void)response.Dump(&slices);
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  if (bytes.empty()) return 0;  // proto3 default: UNKNOWN
  if (bytes.size() == 2 && bytes[0] == '\x08') return bytes[1];
  return absl::InternalError("unexpected HealthCheckResponse bytes");
}

const char* HealthName(int h) {
  switch (h) {
    case 1:
      return "SERVING";
    case 2:
      return "NOT_SERVING";
    case 3:
      return "SERVICE_UNKNOWN";
    default:
      return "UNKNOWN";
  }
}

std::string Uptime(int64_t s) { return absl::FormatDuration(absl::Seconds(s)); }

}  // namespace

int RunStatusCommand(const Args& args, std::ostream& out, std::ostream& err) {
  ParsedArgs parsed;
  DaemonCall call;
  if (int rc = ParseDaemonArgs(kStatusSpec, args, out, err, &parsed, &call);
      rc >= 0) {
    return rc;
  }
  if (!parsed.positional().empty()) {
    return UsageError("status takes no arguments", kStatusSpec, err);
  }
  if (int rc = Connect(&call, err); rc >= 0) return rc;
  absl::StatusOr<int> health = HealthCheck(call);
  if (!health.ok()) {
    err << "error: health check failed: " << health.status().message() << "\n";
    return health.status().code() == absl::StatusCode::kUnavailable ||
                   health.status().code() == absl::StatusCode::kDeadlineExceeded
               ? kExitUnreachable
               : kExitFailed;
  }
  const bool serving = *health == 1;
  // The rest is best effort: a daemon shutting down refuses Stats.
  const absl::Time ping_start = absl::Now();
  const absl::Status ping = call.client->Ping();
  const int64_t ping_us = absl::ToInt64Microseconds(absl::Now() - ping_start);
  absl::StatusOr<v1::StatsResponse> stats = call.client->Stats();
  absl::StatusOr<v1::ListPoolsResponse> pools = call.client->ListPools();
  if (call.structured()) {
    Json j = Json::object();
    j["health"] = HealthName(*health);
    j["serving"] = serving;
    if (ping.ok()) j["ping_us"] = ping_us;
    if (stats.ok()) {
      v1::StatsResponse brief = *stats;
      brief.clear_rpcs();
      brief.clear_latency_bounds_us();
      brief.clear_rejections();
      j["stats"] = ProtoToJson(brief);
    }
    if (pools.ok()) j["pools"] = ProtoToJson(*pools)["pools"];
    PrintJson(j, call, out);
  } else {
    std::vector<std::vector<std::string>> rows = {
        {"health:", HealthName(*health)}};
    if (stats.ok()) {
      rows.push_back({"version:", stats->version()});
      rows.push_back({"backend:", stats->backend()});
      rows.push_back({"devices:", stats->devices().empty()
                                      ? std::string("-")
                                      : absl::StrJoin(stats->devices(), ",")});
      rows.push_back({"uptime:", Uptime(stats->uptime_s())});
      rows.push_back({"draining:", stats->draining() ? "yes" : "no"});
      rows.push_back({"in flight:", absl::StrCat(stats->in_flight())});
      rows.push_back(
          {"sessions:",
           absl::StrCat(stats->sessions(), " (", stats->buffers(), " buffers, ",
                        HumanBytes(stats->buffer_bytes()), ")")});
      rows.push_back(
          {"pools:", absl::StrCat(stats->pools(), " (",
                                  HumanBytes(stats->pool_bytes()), ")")});
    } else {
      rows.push_back({"stats:", std::string(stats.status().message())});
    }
    if (ping.ok()) rows.push_back({"ping:", absl::StrCat(ping_us, "us")});
    PrintTable(rows, out);
    if (pools.ok() && pools->pools_size() > 0) {
      std::vector<std::vector<std::string>> t = {{"POOL", "FORMAT", "DEVICE",
                                                  "LAYERS", "BLOCKS",
                                                  "BLOCK_SIZE", "BYTES"}};
      for (const v1::PoolInfo& p : pools->pools()) {
        t.push_back({p.name(), p.layout().format(), p.device(),
                     absl::StrCat(p.layout().num_layers()),
                     absl::StrCat(p.layout().num_blocks()),
                     absl::StrCat(p.layout().block_size()),
                     HumanBytes(p.layout().total_bytes())});
      }
      out << "\n";
      PrintTable(t, out);
    }
  }
  if (!serving) {
    err << "kvdepot is " << HealthName(*health) << "\n";
    return kExitFailed;
  }
  return kExitOk;
}

}  // namespace kvdepot::ctl
