#include "server/metrics.h"

#include <map>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

TEST(ServerMetrics, CountsCallsCodesBucketsAndRejections) {
  ServerMetrics m({"Store", "Load"});
  m.RecordCall(0, absl::StatusCode::kOk, 40, false);  // bucket 0 (<= 50)
  m.RecordCall(0, absl::StatusCode::kOk, 50, false);  // bucket 0
  m.RecordCall(0, absl::StatusCode::kOk, 51, false);  // bucket 1
  m.RecordCall(1, absl::StatusCode::kInvalidArgument, 7000000, false);
  m.RecordCall(1, absl::StatusCode::kUnavailable, 3, true);
  m.RecordStore(17, 17 * 584, 9);
  m.RecordLoad(133, 133 * 1024, 11);
  v1::StatsResponse s;
  m.Fill(&s);
  ASSERT_EQ(s.rpcs_size(), 2);
  EXPECT_EQ(s.rpcs(0).rpc(), "Store");
  EXPECT_EQ(s.rpcs(0).calls(), 3);
  EXPECT_EQ(s.rpcs(0).errors(), 0);
  EXPECT_EQ(s.rpcs(0).total_latency_us(), 141);
  ASSERT_EQ(s.rpcs(0).latency_buckets_size(),
            static_cast<int>(kLatencyBoundsUs.size()) + 1);
  EXPECT_EQ(s.rpcs(0).latency_buckets(0), 2);
  EXPECT_EQ(s.rpcs(0).latency_buckets(1), 1);
  ASSERT_EQ(s.rpcs(0).codes_size(), 1);
  EXPECT_EQ(s.rpcs(0).codes(0).code(), "OK");
  EXPECT_EQ(s.rpcs(0).codes(0).total_latency_us(), 141);
  ASSERT_EQ(s.rpcs(1).codes_size(), 2);
  EXPECT_EQ(s.rpcs(1).codes(0).code(), "INVALID_ARGUMENT");
  EXPECT_EQ(s.rpcs(1).codes(0).total_latency_us(), 7000000);
  EXPECT_EQ(s.rpcs(1).codes(1).total_latency_us(), 3);
  EXPECT_EQ(s.rpcs(1).errors(), 2);
  // 7 s is above the last bound: the overflow bucket.
  EXPECT_EQ(s.rpcs(1).latency_buckets(kLatencyBoundsUs.size()), 1);
  EXPECT_EQ(s.tokens_stored(), 17);
  EXPECT_EQ(s.bytes_stored(), 17 * 584);
  EXPECT_EQ(s.tokens_loaded(), 133);
  EXPECT_EQ(s.store_kernel_us(), 9);
  EXPECT_EQ(s.load_kernel_us(), 11);
  ASSERT_EQ(s.rejections_size(), 2);
  EXPECT_EQ(s.rejections(0).reason(), "draining");
  EXPECT_EQ(s.rejections(1).reason(), "invalid_argument");
}

// A refusal by a limit counts under that limit's reason, not under
// resource_exhausted; refusals outside the RPCs (RecordLimit) too.
TEST(ServerMetrics, CountsRejectionsByLimit) {
  ServerMetrics m({"CreatePool"});
  const absl::Status pools = LimitExceeded(Limit::kPools, "too many pools");
  ASSERT_EQ(pools.code(), absl::StatusCode::kResourceExhausted);
  ASSERT_EQ(LimitOf(pools), Limit::kPools);
  EXPECT_EQ(LimitOf(absl::ResourceExhaustedError("no tag")), std::nullopt);
  EXPECT_EQ(LimitOf(absl::OkStatus()), std::nullopt);
  m.RecordCall(0, pools.code(), 5, false, LimitOf(pools));
  m.RecordCall(0, pools.code(), 5, false, LimitOf(pools));
  m.RecordCall(0, absl::StatusCode::kResourceExhausted, 5, false);
  m.RecordLimit(Limit::kDescriptorsPerConnection);
  v1::StatsResponse s;
  m.Fill(&s);
  std::map<std::string, int64_t> by_reason;
  for (const v1::Rejection& r : s.rejections())
    by_reason[r.reason()] = r.count();
  EXPECT_EQ(by_reason, (std::map<std::string, int64_t>{
                           {"resource_exhausted", 1},
                           {"limit_pools", 2},
                           {"limit_descriptors_per_connection", 1}}));
  EXPECT_EQ(s.rpcs(0).errors(), 3);
  EXPECT_TRUE(absl::StrContains(
      RenderPrometheus(s),
      "kvdepot_rejections_total{reason=\"limit_pools\"} 2\n"));
}

TEST(RenderPrometheus, HistogramIsCumulativeWithInfAndCounters) {
  ServerMetrics m({"Ping"});
  for (int64_t us : {10, 60, 60, 2000000}) {
    m.RecordCall(0, absl::StatusCode::kOk, us, false);
  }
  v1::StatsResponse s;
  s.set_backend("cpu");
  s.set_version("0.1.0");
  m.Fill(&s);
  const std::string text = RenderPrometheus(s);
  EXPECT_TRUE(absl::StrContains(text,
                                "kvdepot_request_duration_seconds_bucket{"
                                "method=\"Ping\",le=\"0.000050\"} 1\n"))
      << text;
  EXPECT_TRUE(absl::StrContains(text,
                                "kvdepot_request_duration_seconds_bucket{"
                                "method=\"Ping\",le=\"0.000100\"} 3\n"));
  EXPECT_TRUE(absl::StrContains(text,
                                "kvdepot_request_duration_seconds_bucket{"
                                "method=\"Ping\",le=\"+Inf\"} 4\n"));
  EXPECT_TRUE(absl::StrContains(
      text, "kvdepot_request_duration_seconds_count{method=\"Ping\"} 4\n"));
  EXPECT_TRUE(absl::StrContains(
      text, "kvdepot_requests_total{method=\"Ping\",code=\"OK\"} 4\n"));
  EXPECT_TRUE(
      absl::StrContains(text, "# TYPE kvdepot_rejections_total counter\n"));
  EXPECT_TRUE(absl::StrContains(
      text, "kvdepot_info{version=\"0.1.0\",backend=\"cpu\"} 1\n"));
}

TEST(RenderPrometheus, LogLinesDroppedByKind) {
  v1::StatsResponse s;
  v1::LogLinesDropped* d = s.add_log_lines_dropped();
  d->set_kind("failed_call");
  d->set_lines(7);
  d = s.add_log_lines_dropped();
  d->set_kind("client_event");
  d->set_lines(0);
  const std::string text = RenderPrometheus(s);
  EXPECT_TRUE(absl::StrContains(
      text, "# TYPE kvdepot_log_lines_dropped_total counter\n"));
  EXPECT_TRUE(absl::StrContains(
      text, "kvdepot_log_lines_dropped_total{kind=\"failed_call\"} 7\n"))
      << text;
  EXPECT_TRUE(absl::StrContains(
      text, "kvdepot_log_lines_dropped_total{kind=\"client_event\"} 0\n"));
}

}  // namespace
}  // namespace kvdepot
