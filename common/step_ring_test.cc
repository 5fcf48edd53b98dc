#include "common/step_ring.h"

#include <atomic>
#include <cstring>
#include <thread>

#include "absl/time/clock.h"
#include "common/memfd.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

TEST(StepRingGeometry, AcceptsPowersOfTwoAndAlignedSlots) {
  EXPECT_TRUE(CheckStepRingGeometry("r", 1, 4096).ok());
  EXPECT_TRUE(CheckStepRingGeometry("r", 64, 65536).ok());
  EXPECT_EQ(StepRingBytes(4, 8192), 4096 + 4 * (8192 + 4096));
  EXPECT_EQ(StepRingBytes(1, 4160) % 4096, 0);
}

TEST(StepRingGeometry, RefusesEachBadFieldByName) {
  for (int64_t slots : {0, -1, 3, 6, 128, 1 << 20}) {
    absl::Status s = CheckStepRingGeometry("open_step_ring", slots, 4096);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << slots;
    EXPECT_NE(s.message().find("open_step_ring.slots"), std::string::npos);
  }
  for (int64_t bytes : {int64_t{0}, int64_t{4095}, int64_t{4100},
                        kStepRingMaxRequestBytes + 64, int64_t{-4096}}) {
    absl::Status s = CheckStepRingGeometry("open_step_ring", 2, bytes);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bytes;
    EXPECT_NE(s.message().find("open_step_ring.request_bytes"),
              std::string::npos);
  }
  // Each bound alone is fine; together they exceed the ring's total.
  absl::Status s =
      CheckStepRingGeometry("r", kStepRingMaxSlots, kStepRingMaxRequestBytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("more than"), std::string::npos);
}

TEST(StepRingView, SlotsWrapWithTheCounters) {
  std::vector<uint8_t> mem(StepRingBytes(4, 4096));
  StepRingView v(mem.data(), 4, 4096);
  EXPECT_EQ(v.request_slot(0), mem.data() + 4096);
  EXPECT_EQ(v.request_slot(5), mem.data() + 4096 + 4096);
  EXPECT_EQ(v.request_slot(0xffffffffu), mem.data() + 4096 + 3 * 4096);
  EXPECT_EQ(v.reply_slot(2), mem.data() + 4096 + 4 * 4096 + 2 * 4096);
  // 2^32 is a multiple of every slot count: slot n and n + 2^32 coincide.
  EXPECT_EQ(v.request_slot(0xfffffffcu), v.request_slot(0));
}

TEST(StepRingView, TheMessageIsClampedWhateverTheLengthWordSays) {
  std::vector<uint8_t> mem(StepRingBytes(1, 4096));
  StepRingView v(mem.data(), 1, 4096);
  v.SetMessage("ring closed");
  EXPECT_EQ(v.Message(), "ring closed");
  v.SetMessage(std::string(5000, 'x'));
  EXPECT_EQ(v.Message().size(), kStepRingMaxMessageBytes);
  v.word(kStepRingMessageOffset).store(0xffffffffu);  // a hostile peer
  EXPECT_EQ(v.Message().size(), kStepRingMaxMessageBytes);
}

// The futex works across two mappings of one memfd (as between the
// daemon and its scheduler): a sleeper on one mapping wakes when the word
// changes through the other.
TEST(StepRingWait, WakesAcrossTwoMappingsOfOneMemfd) {
  absl::StatusOr<MemfdRegion> a = MemfdRegion::Create("ring", 8192);
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<UniqueFd> fd = a->Dup();
  ASSERT_TRUE(fd.ok());
  absl::StatusOr<MemfdRegion> b =
      MemfdRegion::Import("ring", std::move(*fd), 8192);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_NE(a->data(), b->data());
  StepRingView va(a->data(), 1, 4096), vb(b->data(), 1, 4096);
  std::atomic<bool> woke{false};
  const absl::Time start = absl::Now();
  std::thread sleeper([&] {
    while (va.submitted().load() == 0) {
      StepRingWait(va.raw(kStepRingSubmittedOffset), 0, absl::Seconds(20));
    }
    woke = true;
  });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(woke.load());
  vb.submitted().store(1);
  StepRingWake(vb.raw(kStepRingSubmittedOffset));
  sleeper.join();
  EXPECT_TRUE(woke.load());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(StepRingWait, ReturnsAtOnceWhenTheWordDiffersAndAfterTheTimeout) {
  std::vector<uint32_t> word(1, 7);
  absl::Time t = absl::Now();
  StepRingWait(word.data(), 6, absl::Seconds(20));
  EXPECT_LT(absl::Now() - t, absl::Seconds(5));
  t = absl::Now();
  StepRingWait(word.data(), 7, absl::Milliseconds(30));
  EXPECT_GE(absl::Now() - t, absl::Milliseconds(25));
}

}  // namespace
}  // namespace kvdepot
