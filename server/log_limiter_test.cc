#include "server/log_limiter.h"

#include <memory>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

const absl::Time kT0 = absl::FromUnixSeconds(1'800'000'000);

// Lines from `calls` clients never seen before (so only the limiter's own
// bucket holds them back).
int Written(LogRateLimiter& l, absl::Time at, int calls) {
  static uint32_t next_uid = 100'000;
  int n = 0;
  for (int i = 0; i < calls; ++i) n += l.Admit(at, LogClient::Uid(next_uid++));
  return n;
}

// Lines from one client.
int WrittenBy(LogRateLimiter& l, absl::Time at, LogClient client, int calls) {
  int n = 0;
  for (int i = 0; i < calls; ++i) n += l.Admit(at, client);
  return n;
}

TEST(LogRateLimiterTest, ABurstOfOneSecondThenTheRate) {
  LogRateLimiter l(5);
  EXPECT_EQ(Written(l, kT0, 100), 5);
  EXPECT_EQ(l.dropped_total(), 95);
  // 0.2 s later: one more line.
  EXPECT_EQ(Written(l, kT0 + absl::Milliseconds(200), 10), 1);
  // The bucket holds one second's worth however long the quiet was.
  EXPECT_EQ(Written(l, kT0 + absl::Hours(1), 100), 5);
  EXPECT_EQ(l.dropped_total(), 95 + 9 + 95);
}

TEST(LogRateLimiterTest, DropsAreTakenOncePerIntervalAndAllCounted) {
  LogRateLimiter l(2);
  const absl::Duration every = absl::Seconds(10);
  EXPECT_EQ(l.TakeDropped(kT0, every).lines, 0);  // nothing dropped yet
  EXPECT_EQ(Written(l, kT0, 2), 2);
  const absl::Time first_drop = kT0 + absl::Milliseconds(10);
  EXPECT_EQ(Written(l, first_drop, 7), 0);
  LogRateLimiter::Dropped d = l.TakeDropped(kT0 + absl::Seconds(1), every);
  EXPECT_EQ(d.lines, 7);
  EXPECT_EQ(d.first, first_drop);
  // More drops, but the last report is under `every` ago: kept for later.
  EXPECT_EQ(Written(l, kT0 + absl::Seconds(1), 10), 2);
  EXPECT_EQ(l.TakeDropped(kT0 + absl::Seconds(5), every).lines, 0);
  d = l.TakeDropped(kT0 + absl::Seconds(11), every);
  EXPECT_EQ(d.lines, 8);
  EXPECT_EQ(d.first, kT0 + absl::Seconds(1));
  // Forced (no interval): whatever is left; then nothing.
  EXPECT_EQ(Written(l, kT0 + absl::Seconds(11), 5), 2);
  EXPECT_EQ(l.TakeDropped(kT0 + absl::Seconds(12), absl::ZeroDuration()).lines,
            3);
  EXPECT_EQ(l.TakeDropped(kT0 + absl::Seconds(30), absl::ZeroDuration()).lines,
            0);
  EXPECT_EQ(l.dropped_total(), 7 + 8 + 3);
}

// Lines a writer dropped by its own throttle count and are reported with
// the limiter's own drops, and take none of its lines.
TEST(LogRateLimiterTest, LinesDroppedElsewhereAreCountedAndReported) {
  LogRateLimiter l(2);
  const absl::Time first_drop = kT0 + absl::Milliseconds(3);
  l.CountDropped(first_drop);
  l.CountDropped(kT0 + absl::Milliseconds(4));
  EXPECT_EQ(l.dropped_total(), 2);
  EXPECT_EQ(Written(l, kT0 + absl::Milliseconds(5), 4), 2);
  const LogRateLimiter::Dropped d =
      l.TakeDropped(kT0 + absl::Seconds(1), absl::ZeroDuration());
  EXPECT_EQ(d.lines, 2 + 2);
  EXPECT_EQ(d.first, first_drop);
  EXPECT_EQ(l.dropped_total(), 4);
}

TEST(LogRateLimiterTest, AClockGoingBackAddsNoLines) {
  LogRateLimiter l(3);
  EXPECT_EQ(Written(l, kT0, 3), 3);
  EXPECT_EQ(Written(l, kT0 - absl::Seconds(10), 3), 0);
  EXPECT_EQ(Written(l, kT0, 3), 0);
  EXPECT_EQ(Written(l, kT0 + absl::Seconds(1), 5), 3);
}

TEST(LogRateLimiterTest, RateZeroIsNoLimit) {
  LogRateLimiter l(0);
  EXPECT_EQ(WrittenBy(l, kT0, LogClient::Uid(1), 10'000), 10'000);
  EXPECT_EQ(l.dropped_total(), 0);
  EXPECT_EQ(l.tracked_clients(), 0);
  l.SetRate(1);
  EXPECT_EQ(Written(l, kT0, 10), 1);
}

TEST(LogRateLimiterTest, AFloodingClientTakesItsShareAndOthersStillWrite) {
  LogRateLimiter l(10);
  EXPECT_EQ(LogRateLimiter::ClientShare(10), 5);
  const LogClient a = LogClient::Uid(1000), b = LogClient::Uid(1001);
  EXPECT_EQ(WrittenBy(l, kT0, a, 100), 5);
  EXPECT_EQ(WrittenBy(l, kT0, b, 100), 5);
  // The limiter's bucket is empty now: a third client waits for it too.
  EXPECT_EQ(WrittenBy(l, kT0, LogClient::Uid(1002), 10), 0);
  EXPECT_EQ(l.dropped_total(), 95 + 95 + 10);
  // A client's share refills at half the rate: 0.2 s gives it one line.
  EXPECT_EQ(WrittenBy(l, kT0 + absl::Milliseconds(200), a, 10), 1);
  // A second later every bucket is full again.
  EXPECT_EQ(WrittenBy(l, kT0 + absl::Seconds(2), a, 100), 5);
  EXPECT_EQ(WrittenBy(l, kT0 + absl::Seconds(2), b, 100), 5);
}

// A refused line takes nothing: a client over its share leaves the limiter's
// bucket to the others.
TEST(LogRateLimiterTest, ALineRefusedByItsShareTakesNothingElse) {
  LogRateLimiter l(4);
  const LogClient a = LogClient::Uid(7);
  EXPECT_EQ(WrittenBy(l, kT0, a, 1000), 2);
  EXPECT_EQ(Written(l, kT0, 10), 2);  // 4 - a's 2, however much a tried
}

TEST(LogRateLimiterTest, IdentitiesAreSharesOfTheirOwnTheRestShareOne) {
  LogRateLimiter l(100);  // shares of 50
  EXPECT_EQ(WrittenBy(l, kT0, LogClient::Unidentified(), 60), 50);
  // uid 0 (root) is not "unidentified"; uids and subjects are apart.
  EXPECT_EQ(WrittenBy(l, kT0, LogClient::Uid(0), 1), 1);
  EXPECT_EQ(WrittenBy(l, kT0, LogClient::TlsSubject("CN=a"), 10), 10);
  EXPECT_EQ(WrittenBy(l, kT0, LogClient::TlsSubject("CN=b"), 10), 10);
  EXPECT_EQ(l.tracked_clients(), 4);
  EXPECT_NE(LogClient::Uid(0).key(), LogClient::Unidentified().key());
  EXPECT_NE(LogClient::TlsSubject("").key(), LogClient::Unidentified().key());
  EXPECT_EQ(LogClient::TlsSubject("CN=a").key(),
            LogClient::TlsSubject("CN=a").key());
}

TEST(LogRateLimiterTest, TheClientTableIsBounded) {
  LogRateLimiter l(100'000);  // shares of 50'000: only the table limits
  const int max = LogRateLimiter::kMaxClients;
  for (int i = 0; i < max; ++i) {
    ASSERT_TRUE(l.Admit(kT0, LogClient::Uid(i)));
  }
  EXPECT_EQ(l.tracked_clients(), max);
  // The unidentified share, used up...
  EXPECT_EQ(WrittenBy(l, kT0, LogClient::Unidentified(), 60'000), 50'000);
  EXPECT_EQ(l.tracked_clients(), max + 1);
  // ...is what a new client gets while every tracked one is recent.
  EXPECT_EQ(WrittenBy(l, kT0, LogClient::Uid(max), 3), 0);
  EXPECT_EQ(l.tracked_clients(), max + 1);
  // A second later the idle ones are dropped and it has a share again.
  EXPECT_EQ(WrittenBy(l, kT0 + absl::Seconds(1), LogClient::Uid(max), 3), 3);
  EXPECT_EQ(l.tracked_clients(), 2);  // it and the unidentified share
}

TEST(LogRateLimiterTest, SetRateStartsEveryBucketFull) {
  LogRateLimiter l(4);
  const LogClient a = LogClient::Uid(7);
  EXPECT_EQ(WrittenBy(l, kT0, a, 10), 2);
  l.SetRate(8);
  EXPECT_EQ(l.tracked_clients(), 0);
  EXPECT_EQ(WrittenBy(l, kT0, a, 10), 4);
}

class ClientLogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out_);
    saved_ = spdlog::default_logger();
    auto logger = std::make_shared<spdlog::logger>("test", sink);
    logger->set_pattern("%l %v");
    spdlog::set_default_logger(logger);
  }
  void TearDown() override {
    spdlog::set_default_logger(saved_);
    SetClientLogRate(kDefaultClientLogLinesPerSecond);
  }
  std::ostringstream out_;
  std::shared_ptr<spdlog::logger> saved_;
};

TEST_F(ClientLogTest, EachKindHasItsOwnBucketAndDropsAreReported) {
  ReportDroppedClientLogLines(absl::ZeroDuration());  // earlier tests' drops
  out_.str("");
  // A rate no burst of calls a few microseconds apart can refill.
  SetClientLogRate(4);
  const int64_t dropped_before = ClientLogLinesDropped(ClientLog::kFailedCall);
  const LogClient a = LogClient::Uid(1), b = LogClient::Uid(2);
  int written = 0;
  for (int i = 0; i < 50; ++i) {
    written += AdmitClientLog(ClientLog::kFailedCall, a);
    written += AdmitClientLog(ClientLog::kFailedCall, b);
  }
  EXPECT_EQ(written, 4);
  EXPECT_EQ(ClientLogLinesDropped(ClientLog::kFailedCall) - dropped_before, 96);
  // A flood of failed calls leaves the other kinds their lines.
  EXPECT_TRUE(AdmitClientLog(ClientLog::kClientEvent, a));
  EXPECT_TRUE(AdmitClientLog(ClientLog::kRefusedConnection, a));
  EXPECT_EQ(out_.str(), "");
  // The report: one line for the flooded kind only.
  ReportDroppedClientLogLines(absl::ZeroDuration());
  EXPECT_THAT(out_.str(),
              HasSubstr("warning log: 96 failed_call lines dropped since "));
  EXPECT_THAT(out_.str(), HasSubstr("(--client_log_lines_per_second=4)"));
  EXPECT_THAT(out_.str(), Not(HasSubstr("client_event")));
  out_.str("");
  ReportDroppedClientLogLines(absl::ZeroDuration());
  EXPECT_EQ(out_.str(), "");
}

TEST_F(ClientLogTest, LinesDroppedByTheirWriterAreReported) {
  ReportDroppedClientLogLines(absl::ZeroDuration());  // earlier tests' drops
  out_.str("");
  const int64_t before = ClientLogLinesDropped(ClientLog::kRefusedConnection);
  for (int i = 0; i < 4; ++i) {
    CountDroppedClientLog(ClientLog::kRefusedConnection);
  }
  EXPECT_EQ(ClientLogLinesDropped(ClientLog::kRefusedConnection) - before, 4);
  EXPECT_TRUE(
      AdmitClientLog(ClientLog::kRefusedConnection, LogClient::Unidentified()));
  ReportDroppedClientLogLines(absl::ZeroDuration());
  EXPECT_THAT(out_.str(),
              HasSubstr("log: 4 refused_connection lines dropped since "));
}

TEST_F(ClientLogTest, NoLimitWritesEveryLine) {
  SetClientLogRate(0);
  for (int i = 0; i < 1000; ++i) {
    ASSERT_TRUE(AdmitClientLog(ClientLog::kClientEvent, LogClient::Uid(1)));
  }
  EXPECT_EQ(out_.str(), "");
}

TEST(ClientLogNameTest, NamesAreTheMetricLabels) {
  EXPECT_STREQ(ClientLogName(ClientLog::kFailedCall), "failed_call");
  EXPECT_STREQ(ClientLogName(ClientLog::kClientEvent), "client_event");
  EXPECT_STREQ(ClientLogName(ClientLog::kRefusedConnection),
               "refused_connection");
  EXPECT_STREQ(ClientLogName(ClientLog::kGrpc), "grpc");
}

}  // namespace
}  // namespace kvdepot
