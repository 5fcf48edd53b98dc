#include "server/sessions.h"

#include <memory>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

// Memory that records its release.
class FakeMemory final : public Memory {
 public:
  FakeMemory(int64_t size, int* released) : size_(size), released_(released) {}
  ~FakeMemory() override { ++*released_; }
  uint8_t* data() const override { return nullptr; }
  int64_t size() const override { return size_; }
  void FillHandle(v1::SharedHandle*) const override {}

 private:
  int64_t size_;
  int* released_;
};

const absl::Time kT0 = absl::FromUnixSeconds(1000);

TEST(SessionsTest, LeaseRenewsAndExpiresReleasingBuffers) {
  SessionManager m(SessionLimits{});
  absl::Duration lease;
  absl::StatusOr<std::string> id = m.Open("w", absl::Seconds(2), kT0, &lease);
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(id->size(), 32u);
  EXPECT_EQ(lease, absl::Seconds(2));
  int released = 0;
  absl::StatusOr<std::shared_ptr<Buffer>> b =
      m.AddBuffer(*id, std::make_unique<FakeMemory>(100, &released), kT0);
  ASSERT_TRUE(b.ok());
  const uint64_t bid = (*b)->id;
  b->reset();
  // Renewed at t0 + 1.5 s: alive at t0 + 3 s, gone after t0 + 3.5 s.
  ASSERT_TRUE(m.Touch(*id, kT0 + absl::Milliseconds(1500)).ok());
  EXPECT_EQ(m.Reap(kT0 + absl::Seconds(3)), 0);
  EXPECT_EQ(m.Stats().buffer_bytes, 100);
  EXPECT_TRUE(m.GetBuffer("buffer_id", bid).ok());
  EXPECT_EQ(m.Reap(kT0 + absl::Seconds(4)), 1);
  EXPECT_EQ(released, 1);
  EXPECT_EQ(m.Stats().sessions, 0);
  EXPECT_EQ(m.Stats().buffers, 0);
  EXPECT_EQ(m.Stats().buffer_bytes, 0);
  absl::Status s = m.GetBuffer("kv.slice.buffer_id", bid).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()), HasSubstr("kv.slice.buffer_id = 1"));
  EXPECT_EQ(m.Touch(*id, kT0 + absl::Seconds(4)).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(SessionsTest, ABufferInUseOutlivesItsRelease) {
  SessionManager m(SessionLimits{});
  absl::Duration lease;
  absl::StatusOr<std::string> id =
      m.Open("w", absl::ZeroDuration(), kT0, &lease);
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(lease, SessionLimits{}.default_lease);
  int released = 0;
  absl::StatusOr<std::shared_ptr<Buffer>> b =
      m.AddBuffer(*id, std::make_unique<FakeMemory>(8, &released), kT0);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(m.ReleaseBuffer(*id, (*b)->id, kT0).ok());
  EXPECT_EQ(released, 0);  // still held by `b`
  b->reset();
  EXPECT_EQ(released, 1);
  EXPECT_EQ(m.ReleaseBuffer(*id, 77, kT0).code(), absl::StatusCode::kNotFound);
}

TEST(SessionsTest, CloseLimitsAndClampedLeases) {
  SessionLimits limits;
  limits.max_sessions = 1;
  limits.max_buffers_per_session = 1;
  limits.max_lease = absl::Seconds(5);
  SessionManager m(limits);
  absl::Duration lease;
  absl::StatusOr<std::string> id = m.Open("w", absl::Hours(1), kT0, &lease);
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(lease, absl::Seconds(5));
  EXPECT_EQ(m.Open("x", absl::ZeroDuration(), kT0, &lease).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(m.Open("x", absl::Seconds(-1), kT0, &lease).status().code(),
            absl::StatusCode::kInvalidArgument);
  int released = 0;
  ASSERT_TRUE(
      m.AddBuffer(*id, std::make_unique<FakeMemory>(8, &released), kT0).ok());
  EXPECT_EQ(m.AddBuffer(*id, std::make_unique<FakeMemory>(8, &released), kT0)
                .status()
                .code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(released, 1);  // the refused one
  absl::StatusOr<int64_t> closed = m.Close(*id);
  ASSERT_TRUE(closed.ok());
  EXPECT_EQ(*closed, 1);
  EXPECT_EQ(released, 2);
  EXPECT_EQ(m.Close(*id).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvdepot
