#include "server/step/stream_slots.h"

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace kvdepot::step {
namespace {

TEST(StreamSlotsTest, BoundsTheDaemonAndEachSessionAndGivesBack) {
  StreamSlots slots(3, 2);
  ASSERT_TRUE(slots.Open().ok());
  ASSERT_TRUE(slots.Bind(7).ok());
  ASSERT_TRUE(slots.Open().ok());
  ASSERT_TRUE(slots.Bind(7).ok());
  ASSERT_TRUE(slots.Open().ok());
  // Session 7 has two: a third is refused, naming the flag.
  absl::Status s = slots.Bind(7);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(s.message(), "--max_step_streams_per_session"))
      << s;
  EXPECT_EQ(slots.open_of(7), 2);
  // Another session may bind the third stream; a fourth is over the daemon.
  ASSERT_TRUE(slots.Bind(8).ok());
  s = slots.Open();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(s.message(), "--max_step_streams = 3")) << s;
  // Given back: both the daemon's and the session's slot.
  slots.Close(7);
  EXPECT_EQ(slots.open(), 2);
  EXPECT_EQ(slots.open_of(7), 1);
  ASSERT_TRUE(slots.Open().ok());
  ASSERT_TRUE(slots.Bind(7).ok());
  // An unbound stream gives back only the daemon's.
  slots.Close(7);
  slots.Close(7);
  slots.Close(8);
  EXPECT_EQ(slots.open(), 0);
  EXPECT_EQ(slots.open_of(7), 0);
  EXPECT_EQ(slots.open_of(8), 0);
  // The two refusals above are counted, and both figures reach /metrics.
  EXPECT_EQ(slots.refused(), 2);
  ASSERT_TRUE(slots.Open().ok());
  const std::string text = slots.RenderPrometheus();
  EXPECT_TRUE(absl::StrContains(text, "\nkvdepot_step_streams_open 1\n"))
      << text;
  EXPECT_TRUE(
      absl::StrContains(text, "\nkvdepot_step_streams_refused_total 2\n"))
      << text;
}

}  // namespace
}  // namespace kvdepot::step
