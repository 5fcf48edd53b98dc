// kvcachectl stats: the daemon's counters (Stats RPC).
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/kvcachectl/commands.h"
#include "client/kvcachectl/daemon_cmd.h"

namespace kvdepot::ctl {
namespace {

const CommandSpec kStatsSpec{
    "kvcachectl stats [--all] [flags]",
    "Requests by method and status code with latencies (mean, and p50/p99\n"
    "as histogram bucket bounds; CODES: calls(mean latency) per status\n"
    "code), tokens and bytes stored and loaded,\n"
    "kernel time and rejections by reason. --all lists methods never "
    "called.",
    DaemonFlags({{"all", "list every method, also those never called", "",
                  /*is_bool=*/true}})};

// The upper bound of the bucket holding quantile q, as text ("<=250us").
std::string Quantile(const v1::StatsResponse& s, const v1::RpcStats& r,
                     double q) {
  if (r.calls() == 0) return "-";
  const int64_t rank = static_cast<int64_t>(q * static_cast<double>(r.calls()));
  int64_t seen = 0;
  for (int i = 0; i < r.latency_buckets_size(); ++i) {
    seen += r.latency_buckets(i);
    if (seen > rank || seen == r.calls()) {
      if (i >= s.latency_bounds_us_size()) {
        return absl::StrCat(">", s.latency_bounds_us(i - 1), "us");
      }
      return absl::StrCat("<=", s.latency_bounds_us(i), "us");
    }
  }
  return "-";
}

}  // namespace

int RunStatsCommand(const Args& args, std::ostream& out, std::ostream& err) {
  ParsedArgs parsed;
  DaemonCall call;
  if (int rc = ParseDaemonArgs(kStatsSpec, args, out, err, &parsed, &call);
      rc >= 0) {
    return rc;
  }
  if (!parsed.positional().empty()) {
    return UsageError("stats takes no arguments", kStatsSpec, err);
  }
  if (int rc = Connect(&call, err); rc >= 0) return rc;
  absl::StatusOr<v1::StatsResponse> s = call.client->Stats();
  if (!s.ok()) return Fail(s.status(), err);
  if (call.structured()) {
    PrintProto(*s, call, out);
    return kExitOk;
  }
  const bool all = parsed.Get("all") == "true";
  std::vector<std::vector<std::string>> rows = {
      {"METHOD", "CALLS", "ERRORS", "MEAN", "P50", "P99", "CODES"}};
  for (const v1::RpcStats& r : s->rpcs()) {
    if (r.calls() == 0 && !all) continue;
    std::vector<std::string> codes;
    for (const v1::CodeCount& c : r.codes()) {
      codes.push_back(absl::StrCat(c.code(), ":", c.calls(), "(",
                                   c.total_latency_us() / c.calls(), "us)"));
    }
    rows.push_back({r.rpc(), absl::StrCat(r.calls()), absl::StrCat(r.errors()),
                    r.calls() > 0
                        ? absl::StrCat(r.total_latency_us() / r.calls(), "us")
                        : "-",
                    Quantile(*s, r, 0.5), Quantile(*s, r, 0.99),
                    absl::StrJoin(codes, " ")});
  }
  PrintTable(rows, out);
  out << "\n";
  std::vector<std::string> rejections;
  for (const v1::Rejection& r : s->rejections()) {
    rejections.push_back(absl::StrCat(r.reason(), ":", r.count()));
  }
  std::vector<std::string> dropped;
  for (const v1::LogLinesDropped& d : s->log_lines_dropped()) {
    if (d.lines() > 0)
      dropped.push_back(absl::StrCat(d.kind(), ":", d.lines()));
  }
  PrintTable({{"stored:", absl::StrCat(s->tokens_stored(), " tokens, ",
                                       HumanBytes(s->bytes_stored()))},
              {"loaded:", absl::StrCat(s->tokens_loaded(), " rows, ",
                                       HumanBytes(s->bytes_loaded()))},
              {"kernel time:",
               absl::StrFormat("store %.3f ms, load %.3f ms",
                               static_cast<double>(s->store_kernel_us()) / 1e3,
                               static_cast<double>(s->load_kernel_us()) / 1e3)},
              {"rejections:",
               rejections.empty() ? "none" : absl::StrJoin(rejections, " ")},
              {"log lines dropped:",
               dropped.empty() ? "none" : absl::StrJoin(dropped, " ")},
              {"pools:", absl::StrCat(s->pools(), " (",
                                      HumanBytes(s->pool_bytes()), ")")},
              {"sessions:",
               absl::StrCat(s->sessions(), " (", s->buffers(), " buffers, ",
                            HumanBytes(s->buffer_bytes()), ")")},
              {"uptime:", absl::FormatDuration(absl::Seconds(s->uptime_s()))}},
             out);
  return kExitOk;
}

}  // namespace kvdepot::ctl
