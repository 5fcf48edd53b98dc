// Counters of the daemon's work, shared by the Stats RPC and the Prometheus
// /metrics page: calls by RPC and status code, latency histograms, tokens
// and bytes stored and loaded, kernel time, rejections by reason. Lock-free
// on the request path (relaxed atomics; no allocation per call).
#ifndef KVDEPOT_SERVER_METRICS_H_
#define KVDEPOT_SERVER_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kvdepot/v1/kvdepot.pb.h"
#include "server/limits.h"

namespace kvdepot {

// Upper bounds of the latency histogram buckets, microseconds.
inline constexpr std::array<int64_t, 14> kLatencyBoundsUs = {
    50,    100,   250,   500,    1000,   2500,    5000,
    10000, 25000, 50000, 100000, 250000, 1000000, 5000000};

// Why a call failed: "draining" for calls refused by a drain,
// "limit_<name>" for a refusal by one of the limits (server/limits.h), else
// the lower-case status code name ("invalid_argument", "not_found", ...).
inline constexpr int kNumStatusCodes = 17;

class ServerMetrics {
 public:
  // `rpc_names[i]` names RPC index i (the service's Rpc enum).
  explicit ServerMetrics(std::vector<std::string> rpc_names);

  // One finished call of RPC index `rpc` (in [0, rpc_names.size())).
  // `limit`: the limit that refused it (LimitOf(status)), counted as its
  // rejection reason instead of the code.
  void RecordCall(int rpc, absl::StatusCode code, int64_t latency_us,
                  bool refused_by_drain,
                  std::optional<Limit> limit = std::nullopt);
  // A refusal by `limit` outside the RPCs (the companion socket).
  void RecordLimit(Limit limit);
  // A Store that wrote `tokens` records of `bytes` in all, in `us`.
  void RecordStore(int64_t tokens, int64_t bytes, int64_t us);
  // A Load of `rows` output rows of `bytes` in all, in `us`.
  void RecordLoad(int64_t rows, int64_t bytes, int64_t us);

  // Fills the counter fields of a StatsResponse: rpcs (calls, errors,
  // latency, codes, buckets), latency_bounds_us, tokens/bytes, kernel
  // time, rejections. The caller fills the gauges (pools, sessions...).
  void Fill(v1::StatsResponse* out) const;

 private:
  struct PerRpc {
    std::atomic<int64_t> calls{0};
    std::atomic<int64_t> errors{0};
    std::atomic<int64_t> latency_us{0};
    std::array<std::atomic<int64_t>, kNumStatusCodes> codes{};
    std::array<std::atomic<int64_t>, kNumStatusCodes> code_latency_us{};
    std::array<std::atomic<int64_t>, kLatencyBoundsUs.size() + 1> buckets{};
  };

  const std::vector<std::string> rpc_names_;
  std::unique_ptr<PerRpc[]> rpcs_;
  std::array<std::atomic<int64_t>, kNumStatusCodes> rejections_{};
  std::atomic<int64_t> drain_rejections_{0};
  std::array<std::atomic<int64_t>, static_cast<size_t>(Limit::kCount)>
      limit_rejections_{};
  std::atomic<int64_t> tokens_stored_{0};
  std::atomic<int64_t> bytes_stored_{0};
  std::atomic<int64_t> store_us_{0};
  std::atomic<int64_t> tokens_loaded_{0};
  std::atomic<int64_t> bytes_loaded_{0};
  std::atomic<int64_t> load_us_{0};
};

// The Prometheus text exposition (format 0.0.4) of a StatsResponse: every
// family with HELP and TYPE, names prefixed kvdepot_, latencies in
// seconds.
std::string RenderPrometheus(const v1::StatsResponse& stats);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_METRICS_H_
