#include "server/metrics.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvdepot {
namespace {

constexpr auto kRelaxed = std::memory_order_relaxed;

std::string CodeName(int code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

// Seconds from microseconds, exactly as Prometheus floats print them.
std::string Seconds(int64_t us) {
  return absl::StrFormat("%.6f", static_cast<double>(us) / 1e6);
}

void Family(std::string* out, absl::string_view name, absl::string_view type,
            absl::string_view help) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type,
                  "\n");
}

// Label values here are RPC names, code names and backend names: no quotes,
// backslashes or newlines, but escape anyway.
std::string Escape(absl::string_view v) {
  std::string s;
  for (char c : v) {
    if (c == '\\' || c == '"') s.push_back('\\');
    if (c == '\n') {
      s += "\\n";
      continue;
    }
    s.push_back(c);
  }
  return s;
}

}  // namespace

ServerMetrics::ServerMetrics(std::vector<std::string> rpc_names)
    : rpc_names_(std::move(rpc_names)), rpcs_(new PerRpc[rpc_names_.size()]) {}

void ServerMetrics::RecordCall(int rpc, absl::StatusCode code,
                               int64_t latency_us, bool refused_by_drain,
                               std::optional<Limit> limit) {
  PerRpc& r = rpcs_[rpc];
  r.calls.fetch_add(1, kRelaxed);
  r.latency_us.fetch_add(latency_us, kRelaxed);
  int c = static_cast<int>(code);
  if (c < 0 || c >= kNumStatusCodes)
    c = static_cast<int>(absl::StatusCode::kUnknown);
  r.codes[c].fetch_add(1, kRelaxed);
  r.code_latency_us[c].fetch_add(latency_us, kRelaxed);
  size_t b = 0;
  while (b < kLatencyBoundsUs.size() && latency_us > kLatencyBoundsUs[b]) ++b;
  r.buckets[b].fetch_add(1, kRelaxed);
  if (code == absl::StatusCode::kOk) return;
  r.errors.fetch_add(1, kRelaxed);
  if (refused_by_drain) {
    drain_rejections_.fetch_add(1, kRelaxed);
  } else if (limit.has_value()) {
    RecordLimit(*limit);
  } else {
    rejections_[c].fetch_add(1, kRelaxed);
  }
}

void ServerMetrics::RecordLimit(Limit limit) {
  const int i = static_cast<int>(limit);
  if (i < 0 || i >= static_cast<int>(Limit::kCount)) return;
  limit_rejections_[i].fetch_add(1, kRelaxed);
}

void ServerMetrics::RecordStore(int64_t tokens, int64_t bytes, int64_t us) {
  tokens_stored_.fetch_add(tokens, kRelaxed);
  bytes_stored_.fetch_add(bytes, kRelaxed);
  store_us_.fetch_add(us, kRelaxed);
}

void ServerMetrics::RecordLoad(int64_t rows, int64_t bytes, int64_t us) {
  tokens_loaded_.fetch_add(rows, kRelaxed);
  bytes_loaded_.fetch_add(bytes, kRelaxed);
  load_us_.fetch_add(us, kRelaxed);
}

void ServerMetrics::Fill(v1::StatsResponse* out) const {
  for (int64_t b : kLatencyBoundsUs) out->add_latency_bounds_us(b);
  for (size_t i = 0; i < rpc_names_.size(); ++i) {
    const PerRpc& r = rpcs_[i];
    v1::RpcStats* rs = out->add_rpcs();
    rs->set_rpc(rpc_names_[i]);
    rs->set_calls(r.calls.load(kRelaxed));
    rs->set_errors(r.errors.load(kRelaxed));
    rs->set_total_latency_us(r.latency_us.load(kRelaxed));
    for (int c = 0; c < kNumStatusCodes; ++c) {
      const int64_t n = r.codes[c].load(kRelaxed);
      if (n == 0) continue;
      v1::CodeCount* cc = rs->add_codes();
      cc->set_code(CodeName(c));
      cc->set_calls(n);
      cc->set_total_latency_us(r.code_latency_us[c].load(kRelaxed));
    }
    for (const auto& b : r.buckets) rs->add_latency_buckets(b.load(kRelaxed));
  }
  out->set_tokens_stored(tokens_stored_.load(kRelaxed));
  out->set_bytes_stored(bytes_stored_.load(kRelaxed));
  out->set_tokens_loaded(tokens_loaded_.load(kRelaxed));
  out->set_bytes_loaded(bytes_loaded_.load(kRelaxed));
  out->set_store_kernel_us(store_us_.load(kRelaxed));
  out->set_load_kernel_us(load_us_.load(kRelaxed));
  if (const int64_t n = drain_rejections_.load(kRelaxed); n > 0) {
    v1::Rejection* r = out->add_rejections();
    r->set_reason("draining");
    r->set_count(n);
  }
  for (int c = 0; c < kNumStatusCodes; ++c) {
    const int64_t n = rejections_[c].load(kRelaxed);
    if (n == 0) continue;
    v1::Rejection* r = out->add_rejections();
    r->set_reason(absl::AsciiStrToLower(CodeName(c)));
    r->set_count(n);
  }
  for (int i = 0; i < static_cast<int>(Limit::kCount); ++i) {
    const int64_t n = limit_rejections_[i].load(kRelaxed);
    if (n == 0) continue;
    v1::Rejection* r = out->add_rejections();
    r->set_reason(absl::StrCat("limit_", LimitName(static_cast<Limit>(i))));
    r->set_count(n);
  }
}

std::string RenderPrometheus(const v1::StatsResponse& s) {
  std::string out;
  Family(&out, "kvdepot_info", "gauge",
         "Constant 1; the labels name the version and the backend.");
  absl::StrAppend(&out, "kvdepot_info{version=\"", Escape(s.version()),
                  "\",backend=\"", Escape(s.backend()), "\"} 1\n");
  Family(&out, "kvdepot_uptime_seconds", "gauge",
         "Seconds since the daemon started.");
  absl::StrAppend(&out, "kvdepot_uptime_seconds ", s.uptime_s(), "\n");
  Family(&out, "kvdepot_draining", "gauge",
         "1 while the daemon drains (no new work accepted).");
  absl::StrAppend(&out, "kvdepot_draining ", s.draining() ? 1 : 0, "\n");
  Family(&out, "kvdepot_in_flight_requests", "gauge", "RPCs running now.");
  absl::StrAppend(&out, "kvdepot_in_flight_requests ", s.in_flight(), "\n");

  const struct {
    const char* name;
    const char* help;
    int64_t value;
  } gauges[] = {
      {"kvdepot_pools", "Pools.", s.pools()},
      {"kvdepot_pool_bytes", "Bytes of all pools.", s.pool_bytes()},
      {"kvdepot_sessions", "Open client sessions.", s.sessions()},
      {"kvdepot_leased_buffers", "Buffers held by sessions.", s.buffers()},
      {"kvdepot_leased_buffer_bytes", "Bytes of the buffers held by sessions.",
       s.buffer_bytes()},
      {"kvdepot_memory_budget_bytes",
       "Bytes pools and buffers are admitted against (0 = not budgeted).",
       s.memory_budget_bytes()},
      {"kvdepot_memory_budget_used_bytes",
       "Bytes of the memory budget held by pools and buffers.",
       s.memory_budget_used_bytes()},
      {"kvdepot_descriptors_held",
       "Descriptors the CPU backend's pools and buffers hold.",
       s.descriptors_held()},
      {"kvdepot_descriptors_limit",
       "Descriptors pools and buffers may hold (--max_descriptors; 0 = "
       "none held by memory: the CUDA backend).",
       s.descriptors_limit()},
      {"kvdepot_tls_connections",
       "Connections the mutual-TLS TCP port's relay carries now (0 without "
       "such a port).",
       s.tls_connections()},
  };
  for (const auto& g : gauges) {
    Family(&out, g.name, "gauge", g.help);
    absl::StrAppend(&out, g.name, " ", g.value, "\n");
  }

  Family(&out, "kvdepot_requests_total", "counter",
         "Finished RPCs by method and status code.");
  for (const v1::RpcStats& r : s.rpcs()) {
    for (const v1::CodeCount& c : r.codes()) {
      absl::StrAppend(&out, "kvdepot_requests_total{method=\"", Escape(r.rpc()),
                      "\",code=\"", Escape(c.code()), "\"} ", c.calls(), "\n");
    }
  }

  Family(&out, "kvdepot_request_duration_seconds", "histogram",
         "RPC latency in the daemon by method.");
  for (const v1::RpcStats& r : s.rpcs()) {
    int64_t cumulative = 0;
    const std::string method = Escape(r.rpc());
    for (int i = 0; i < r.latency_buckets_size(); ++i) {
      cumulative += r.latency_buckets(i);
      const std::string le = i < s.latency_bounds_us_size()
                                 ? Seconds(s.latency_bounds_us(i))
                                 : std::string("+Inf");
      absl::StrAppend(&out, "kvdepot_request_duration_seconds_bucket{method=\"",
                      method, "\",le=\"", le, "\"} ", cumulative, "\n");
    }
    absl::StrAppend(&out, "kvdepot_request_duration_seconds_sum{method=\"",
                    method, "\"} ", Seconds(r.total_latency_us()), "\n");
    absl::StrAppend(&out, "kvdepot_request_duration_seconds_count{method=\"",
                    method, "\"} ", r.calls(), "\n");
  }

  const struct {
    const char* name;
    const char* help;
    int64_t value;
  } counters[] = {
      {"kvdepot_tokens_stored_total", "Tokens written by Store.",
       s.tokens_stored()},
      {"kvdepot_stored_bytes_total", "Pool bytes written by Store.",
       s.bytes_stored()},
      {"kvdepot_tokens_loaded_total", "Rows read by Load.", s.tokens_loaded()},
      {"kvdepot_loaded_bytes_total", "Output bytes written by Load.",
       s.bytes_loaded()},
  };
  for (const auto& c : counters) {
    Family(&out, c.name, "counter", c.help);
    absl::StrAppend(&out, c.name, " ", c.value, "\n");
  }

  Family(&out, "kvdepot_kernel_seconds_total", "counter",
         "Time in the backend's store and load kernels.");
  absl::StrAppend(&out, "kvdepot_kernel_seconds_total{op=\"store\"} ",
                  Seconds(s.store_kernel_us()), "\n");
  absl::StrAppend(&out, "kvdepot_kernel_seconds_total{op=\"load\"} ",
                  Seconds(s.load_kernel_us()), "\n");

  Family(&out, "kvdepot_rejections_total", "counter",
         "Failed RPCs by reason (draining, or the status code).");
  for (const v1::Rejection& r : s.rejections()) {
    absl::StrAppend(&out, "kvdepot_rejections_total{reason=\"",
                    Escape(r.reason()), "\"} ", r.count(), "\n");
  }

  Family(&out, "kvdepot_log_lines_dropped_total", "counter",
         "Log lines clients caused that the log rate limit dropped, by kind "
         "(--client_log_lines_per_second).");
  for (const v1::LogLinesDropped& d : s.log_lines_dropped()) {
    absl::StrAppend(&out, "kvdepot_log_lines_dropped_total{kind=\"",
                    Escape(d.kind()), "\"} ", d.lines(), "\n");
  }
  return out;
}

}  // namespace kvdepot
