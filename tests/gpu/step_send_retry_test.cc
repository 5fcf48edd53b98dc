// SendRespectingDepth on a fake Step call: RESOURCE_EXHAUSTED sent again
// until accepted or the budget is spent, every other code returned at once.
#include "tests/gpu/step_send_retry.h"

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvdepot::testing {
namespace {

absl::Status Full() {
  return absl::ResourceExhaustedError(
      "step_id 255: 2 steps of registration 4 are in flight already; send it "
      "again when one finished");
}

TEST(SendRespectingDepthTest, AcceptedAtOnceIsSentOnce) {
  int calls = 0, retries = -1;
  EXPECT_TRUE(SendRespectingDepth(
                  [&] {
                    ++calls;
                    return absl::OkStatus();
                  },
                  {}, &retries)
                  .ok());
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(retries, 0);
}

TEST(SendRespectingDepthTest, RefusedWhileFullThenAccepted) {
  for (int refusals : {1, 3, 17}) {
    int calls = 0, retries = -1;
    const absl::Status s = SendRespectingDepth(
        [&] { return ++calls <= refusals ? Full() : absl::OkStatus(); }, {},
        &retries);
    EXPECT_TRUE(s.ok()) << refusals << ": " << s;
    EXPECT_EQ(calls, refusals + 1);
    EXPECT_EQ(retries, refusals);
  }
}

TEST(SendRespectingDepthTest, OtherCodesAreNotRetried) {
  for (absl::Status other :
       {absl::InvalidArgumentError("step_id: 7 is not the next step (6)"),
        absl::FailedPreconditionError("registration 4 was cancelled"),
        absl::DeadlineExceededError("Deadline Exceeded"),
        absl::UnavailableError("draining")}) {
    int calls = 0, retries = -1;
    const absl::Status s = SendRespectingDepth(
        [&] {
          ++calls;
          return other;
        },
        {}, &retries);
    EXPECT_EQ(s, other);
    EXPECT_EQ(calls, 1);
    EXPECT_EQ(retries, 0);
  }
}

TEST(SendRespectingDepthTest, AnotherCodeAfterRefusalsEndsTheRetries) {
  int calls = 0;
  const absl::Status s = SendRespectingDepth([&] {
    return ++calls < 3 ? Full() : absl::FailedPreconditionError("cancelled");
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(calls, 3);
}

TEST(SendRespectingDepthTest, GivesUpAfterTheBudget) {
  InFlightRetry r;
  r.budget = absl::Milliseconds(20);
  int calls = 0, retries = -1;
  const absl::Time t0 = absl::Now();
  const absl::Status s = SendRespectingDepth(
      [&] {
        ++calls;
        return Full();
      },
      r, &retries);
  const absl::Duration took = absl::Now() - t0;
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(s.message(), "in flight already")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "still refused after")) << s;
  EXPECT_GE(took, r.budget);
  EXPECT_LT(took, absl::Seconds(5));  // bounded, with room for a slow host
  EXPECT_EQ(retries, calls - 1);
  EXPECT_GE(retries, 1);
  // Backoff grows to max_backoff (1 ms): far fewer calls than 20 ms / 20 us.
  EXPECT_LE(calls, 40);
}

}  // namespace
}  // namespace kvdepot::testing
