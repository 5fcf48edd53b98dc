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

const absl::Time kT0 = absl::FromUnixSeconds(1'800'000'000);

int Written(LogRateLimiter& l, absl::Time at, int calls) {
  int n = 0;
  for (int i = 0; i < calls; ++i) n += l.Admit(at).write;
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

TEST(LogRateLimiterTest, TheFirstLineWrittenAfterDropsCarriesTheirCount) {
  LogRateLimiter l(2);
  EXPECT_EQ(l.Admit(kT0).dropped_before, 0);
  EXPECT_TRUE(l.Admit(kT0).write);
  const absl::Time first_drop = kT0 + absl::Milliseconds(10);
  EXPECT_FALSE(l.Admit(first_drop).write);
  for (int i = 0; i < 6; ++i) EXPECT_FALSE(l.Admit(first_drop).write);
  const LogRateLimiter::Decision d = l.Admit(kT0 + absl::Seconds(1));
  ASSERT_TRUE(d.write);
  EXPECT_EQ(d.dropped_before, 7);
  EXPECT_EQ(d.first_dropped, first_drop);
  // Reported once.
  EXPECT_EQ(l.Admit(kT0 + absl::Seconds(1)).dropped_before, 0);
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
  EXPECT_EQ(Written(l, kT0, 10'000), 10'000);
  EXPECT_EQ(l.dropped_total(), 0);
  l.SetRate(1);
  EXPECT_EQ(Written(l, kT0, 10), 1);
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
  // A rate no burst of calls a few microseconds apart can refill.
  SetClientLogRate(3);
  const int64_t dropped_before = ClientLogLinesDropped(ClientLog::kFailedCall);
  int written = 0;
  for (int i = 0; i < 50; ++i)
    written += AdmitClientLog(ClientLog::kFailedCall);
  EXPECT_EQ(written, 3);
  EXPECT_EQ(ClientLogLinesDropped(ClientLog::kFailedCall) - dropped_before, 47);
  // A flood of failed calls leaves the other kinds their lines.
  EXPECT_TRUE(AdmitClientLog(ClientLog::kClientEvent));
  EXPECT_TRUE(AdmitClientLog(ClientLog::kRefusedConnection));
  EXPECT_EQ(out_.str(), "");
  // The next line written of the flooded kind (the bucket refilled here by
  // setting the rate) is preceded by the count of those dropped.
  SetClientLogRate(3);
  EXPECT_TRUE(AdmitClientLog(ClientLog::kFailedCall));
  EXPECT_THAT(out_.str(),
              HasSubstr("warning log: 47 failed_call lines dropped since "));
  EXPECT_THAT(out_.str(), HasSubstr("(--client_log_lines_per_second=3)"));
}

TEST_F(ClientLogTest, NoLimitWritesEveryLine) {
  SetClientLogRate(0);
  for (int i = 0; i < 1000; ++i) {
    ASSERT_TRUE(AdmitClientLog(ClientLog::kClientEvent));
  }
  EXPECT_EQ(out_.str(), "");
}

TEST(ClientLogNameTest, NamesAreTheMetricLabels) {
  EXPECT_STREQ(ClientLogName(ClientLog::kFailedCall), "failed_call");
  EXPECT_STREQ(ClientLogName(ClientLog::kClientEvent), "client_event");
  EXPECT_STREQ(ClientLogName(ClientLog::kRefusedConnection),
               "refused_connection");
}

}  // namespace
}  // namespace kvdepot
