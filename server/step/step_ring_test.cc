// Step rings (server/step/step_rings.h, client/step_ring.h) without a GPU
// (StepTestRig's FakeEngine registrations): steps through the ring as a
// StepStream runs them, replies in order, refusals that keep the ring
// open, and every way a hostile scheduler can write the shared memory:
// garbage bytes, a length beyond the slot, a counter that jumps, bytes
// changed while the daemon reads. Then the ring's session: another
// session's id or registration refused, a closed session's ring closed,
// the companion connection and the drain closing rings, the shared
// stream limits, and the geometry checks on the companion socket.
#include "client/step_ring.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "client/companion_connection.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/companion.h"
#include "server/step/step_rings.h"
#include "server/step/step_test_rig.h"

namespace kvdepot::step {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(10);

class StepRingTest : public ::testing::Test {
 protected:
  void Start(StepServiceOptions service = {}) {
    StepTestRigOptions o;
    o.auto_finish = false;  // steps stay in flight until Finish()
    o.max_batch = 8;
    o.top_k = 16;
    o.service = service;
    absl::StatusOr<std::unique_ptr<StepTestRig>> rig = StepTestRig::Start(o);
    ASSERT_TRUE(rig.ok()) << rig.status();
    rig_ = *std::move(rig);
    absl::StatusOr<StepTestRig::Parties> parties = rig_->OpenParties();
    ASSERT_TRUE(parties.ok()) << parties.status();
    a_ = parties->worker;
    b_ = parties->intruder;
    reg_ = parties->registration;
  }
  Caller CallerOf(const OpenedSession& s) {
    absl::StatusOr<Caller> c =
        rig_->sessions()->Authenticate(s.id, absl::Now());
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *c : Caller{};
  }
  // A ring of session `s`, opened on the daemon's side as the companion
  // socket does, mapped as the scheduler maps it.
  absl::StatusOr<std::unique_ptr<StepRingClient>> OpenRing(
      const OpenedSession& s, int32_t slots = 4,
      int64_t request_bytes = 64 << 10) {
    v1::StepRingInfo info;
    absl::StatusOr<UniqueFd> fd = rig_->step()->rings()->OpenRing(
        CallerOf(s), s.id, slots, request_bytes, MemoryReservation(), &info);
    if (!fd.ok()) return fd.status();
    return StepRingClient::Map(*std::move(fd),
                               StepRingBytes(slots, request_bytes), info);
  }
  v1::StepRequest Step(uint64_t step_id, const std::string& session = "") {
    v1::StepRequest r = rig_->Step(session, reg_, step_id, 3);
    return r;
  }
  uint64_t LastStep() {
    absl::StatusOr<v1::RegistrationInfo> info =
        rig_->step()->registry()->Status(CallerOf(a_), reg_);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->last_step_id() : 0;
  }
  std::string Metrics() { return rig_->step()->RenderPrometheus(); }
  void Finish() { ASSERT_TRUE(rig_->factory()->last()->FinishOne()); }

  std::unique_ptr<StepTestRig> rig_;
  OpenedSession a_, b_;
  uint64_t reg_ = 0;
};

// Writes `bytes` into request slot n and publishes submitted = n + 1, as
// any scheduler could, bypassing StepRingClient's checks.
void RawSubmit(const StepRingView& v, uint32_t n, const std::string& bytes,
               uint32_t length) {
  uint8_t* slot = v.request_slot(n);
  std::memcpy(slot + kStepRingSlotHeaderBytes, bytes.data(),
              std::min<size_t>(bytes.size(), v.request_capacity()));
  StepRingView::length(slot).store(length);
  v.submitted().store(n + 1);
  StepRingWake(v.raw(kStepRingSubmittedOffset));
}

// Reply n once the daemon published it (the test fails after kWait).
v1::StepResponse RawReply(const StepRingView& v, uint32_t n) {
  const absl::Time deadline = absl::Now() + kWait;
  while (v.done().load() - n == 0 || v.done().load() - n > v.slots()) {
    if (absl::Now() > deadline) {
      ADD_FAILURE() << "no reply " << n;
      return {};
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  uint8_t* slot = v.reply_slot(n);
  v1::StepResponse r;
  EXPECT_TRUE(r.ParseFromArray(slot + kStepRingSlotHeaderBytes,
                               StepRingView::length(slot).load()));
  return r;
}

bool Eventually(const std::function<bool()>& done) {
  const absl::Time deadline = absl::Now() + kWait;
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return true;
}

TEST_F(StepRingTest, StepsRunAsOnAStreamAndRepliesComeInOrder) {
  Start();
  absl::StatusOr<std::unique_ptr<StepRingClient>> ring = OpenRing(a_);
  ASSERT_TRUE(ring.ok()) << ring.status();
  for (uint64_t id = 1; id <= 40; ++id) {
    absl::StatusOr<v1::StepResponse> r = (*ring)->Step(Step(id), kWait);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->error_code(), 0) << r->error_message();
    EXPECT_EQ(r->step_id(), id);
    EXPECT_EQ(r->queued(), 1);
    Finish();
  }
  EXPECT_EQ(LastStep(), 40u);
  // Pipelined: every slot submitted before any reply is collected; one
  // more is refused on the scheduler's side. The replies come in order,
  // each the registry's answer: two steps in flight, then its limit, then
  // a step id that skips the refused one.
  for (uint64_t id = 41; id <= 44; ++id) {
    ASSERT_TRUE((*ring)->Submit(Step(id)).ok());
  }
  absl::StatusOr<uint32_t> over = (*ring)->Submit(Step(45));
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  for (uint64_t id = 41; id <= 44; ++id) {
    absl::StatusOr<v1::StepResponse> r = (*ring)->Collect(kWait);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->step_id(), id);
    if (id <= 42) {
      EXPECT_EQ(r->error_code(), 0) << r->error_message();
      EXPECT_EQ(r->queued(), id - 40);
    } else if (id == 43) {
      EXPECT_THAT(r->error_message(), HasSubstr("in flight already"));
    } else {
      EXPECT_THAT(r->error_message(), HasSubstr("not the next step (43)"));
    }
  }
  EXPECT_EQ((*ring)->Collect(absl::ZeroDuration()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(LastStep(), 42u);
  EXPECT_THAT(Metrics(), HasSubstr("\nkvdepot_step_ring_requests_total 44\n"));
  EXPECT_THAT(Metrics(), HasSubstr("\nkvdepot_step_rings_open 1\n"));
  // The ring holds a StepStream slot of its session.
  EXPECT_EQ(rig_->step()->service()->open_streams(), 1);
}

TEST_F(StepRingTest, ARefusedRequestGetsItsErrorAndTheRingGoesOn) {
  Start();
  absl::StatusOr<std::unique_ptr<StepRingClient>> ring = OpenRing(a_);
  ASSERT_TRUE(ring.ok()) << ring.status();
  v1::StepRequest bad = Step(1);
  std::string mapping = bad.slot_mapping();
  const int32_t huge = 1 << 30;
  std::memcpy(mapping.data() + 4, &huge, 4);
  bad.set_slot_mapping(mapping);
  absl::StatusOr<v1::StepResponse> r = (*ring)->Step(bad, kWait);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->error_code(),
            static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(r->error_field(), "slot_mapping[1]");
  EXPECT_EQ(r->step_id(), 1u);
  EXPECT_EQ(LastStep(), 0u);  // nothing enqueued
  // A step id out of order: the registry's rule, the same error.
  r = (*ring)->Step(Step(5), kWait);
  ASSERT_TRUE(r.ok());
  EXPECT_NE(r->error_code(), 0);
  EXPECT_THAT(r->error_message(), HasSubstr("step_id"));
  r = (*ring)->Step(Step(1), kWait);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->error_code(), 0) << r->error_message();
  EXPECT_EQ(LastStep(), 1u);
}

TEST_F(StepRingTest, TooLargeARequestIsRefusedBeforeItIsWritten) {
  Start();
  absl::StatusOr<std::unique_ptr<StepRingClient>> ring = OpenRing(a_, 2, 4096);
  ASSERT_TRUE(ring.ok()) << ring.status();
  v1::StepRequest big = Step(1);
  big.set_slot_mapping(std::string(8192, '\0'));
  absl::StatusOr<uint32_t> n = (*ring)->Submit(big);
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(n.status().message(), HasSubstr("request_bytes"));
  EXPECT_EQ((*ring)->uncollected(), 0);
}

TEST_F(StepRingTest, HostileBytesGetErrorRepliesAndChangeNothing) {
  Start();
  absl::StatusOr<std::unique_ptr<StepRingClient>> ring = OpenRing(a_, 4, 4096);
  ASSERT_TRUE(ring.ok()) << ring.status();
  const StepRingView& v = (*ring)->view();
  // Not a StepRequest (an invalid wire type).
  RawSubmit(v, 0, std::string("\xff\xff\xff\xff\xff\xff", 6), 6);
  v1::StepResponse r = RawReply(v, 0);
  EXPECT_EQ(r.error_code(),
            static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.error_message(), HasSubstr("step_ring.request[0]"));
  // A length beyond the slot: refused by name, nothing read past it.
  RawSubmit(v, 1, "", 0xfffffff0u);
  r = RawReply(v, 1);
  EXPECT_EQ(r.error_code(),
            static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(r.error_field(), "step_ring.request[1].length");
  RawSubmit(v, 2, "", 4096 - 7);  // one byte more than the slot holds
  r = RawReply(v, 2);
  EXPECT_EQ(r.error_field(), "step_ring.request[2].length");
  // Zero bytes parse as an empty StepRequest: the registry refuses it.
  RawSubmit(v, 3, "", 0);
  r = RawReply(v, 3);
  EXPECT_NE(r.error_code(), 0);
  EXPECT_EQ(LastStep(), 0u);
  // A good request after all that (slot 0 again: its reply was read).
  std::string good;
  ASSERT_TRUE(Step(1).SerializeToString(&good));
  RawSubmit(v, 4, good, static_cast<uint32_t>(good.size()));
  r = RawReply(v, 4);
  EXPECT_EQ(r.error_code(), 0) << r.error_message();
  EXPECT_EQ(LastStep(), 1u);
  EXPECT_EQ((*ring)->state(), kStepRingOpen);
}

TEST_F(StepRingTest, ACounterThatJumpsFailsTheRingAndOnlyIt) {
  Start();
  absl::StatusOr<std::unique_ptr<StepRingClient>> ring = OpenRing(a_);
  absl::StatusOr<std::unique_ptr<StepRingClient>> other = OpenRing(a_);
  ASSERT_TRUE(ring.ok() && other.ok());
  const StepRingView& v = (*ring)->view();
  v.submitted().store(5);  // 5 ahead of done = 0, the ring has 4 slots
  StepRingWake(v.raw(kStepRingSubmittedOffset));
  ASSERT_TRUE(Eventually([&] { return (*ring)->state() != kStepRingOpen; }));
  EXPECT_EQ((*ring)->state(), kStepRingFailed);
  EXPECT_THAT((*ring)->closing_message(), HasSubstr("step_ring.submitted"));
  absl::StatusOr<uint32_t> n = (*ring)->Submit(Step(1));
  EXPECT_EQ(n.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(n.status().message(), HasSubstr("more than the ring's 4 slots"));
  EXPECT_EQ(v.done().load(), 0u);  // nothing was answered
  EXPECT_THAT(Metrics(), HasSubstr("\nkvdepot_step_rings_failed_total 1\n"));
  // A counter that runs backwards is as far ahead modulo 2^32.
  const StepRingView& w = (*other)->view();
  absl::StatusOr<v1::StepResponse> ok = (*other)->Step(Step(1), kWait);
  ASSERT_TRUE(ok.ok() && ok->error_code() == 0);
  w.submitted().store(0);
  StepRingWake(w.raw(kStepRingSubmittedOffset));
  ASSERT_TRUE(Eventually([&] { return (*other)->state() != kStepRingOpen; }));
  EXPECT_EQ(LastStep(), 1u);
}

TEST_F(StepRingTest, BytesChangedWhileTheDaemonReadsNeverHurtIt) {
  Start();
  absl::StatusOr<std::unique_ptr<StepRingClient>> ring = OpenRing(a_, 8, 4096);
  ASSERT_TRUE(ring.ok()) << ring.status();
  const StepRingView& v = (*ring)->view();
  std::string good;
  ASSERT_TRUE(Step(1).SerializeToString(&good));
  std::atomic<bool> stop{false};
  // One thread scribbles random bytes over every request slot's length
  // and payload; this thread keeps publishing, as fast as replies come.
  std::thread scribbler([&] {
    std::mt19937 rng(7);
    while (!stop.load()) {
      uint8_t* slot = v.request_slot(rng() % 8);
      const size_t at = rng() % 4096;
      slot[at] = static_cast<uint8_t>(rng());
      if (rng() % 4 == 0) StepRingView::length(slot).store(rng() % 5000);
    }
  });
  uint32_t n = 0;
  const absl::Time end = absl::Now() + absl::Milliseconds(500);
  while (absl::Now() < end && (*ring)->state() == kStepRingOpen) {
    RawSubmit(v, n, good, static_cast<uint32_t>(good.size()));
    RawReply(v, n);
    ++n;
  }
  stop = true;
  scribbler.join();
  EXPECT_GT(n, 10u);
  EXPECT_EQ((*ring)->state(), kStepRingOpen);
  // The daemon still steps for others.
  absl::StatusOr<std::unique_ptr<StepRingClient>> fresh = OpenRing(a_);
  ASSERT_TRUE(fresh.ok());
  const uint64_t next = LastStep() + 1;
  absl::StatusOr<v1::StepResponse> r = (*fresh)->Step(Step(next), kWait);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->error_code(), 0) << r->error_message();
}

TEST_F(StepRingTest, ARingStepsOnlyForItsOwnSession) {
  Start();
  absl::StatusOr<std::unique_ptr<StepRingClient>> intruder = OpenRing(b_);
  ASSERT_TRUE(intruder.ok()) << intruder.status();
  // Another session's registration: refused by the registry.
  absl::StatusOr<v1::StepResponse> r = (*intruder)->Step(Step(1), kWait);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->error_code(),
            static_cast<int32_t>(absl::StatusCode::kPermissionDenied));
  // Naming the owner's session id in the request changes nothing: a
  // request may name only the ring's session.
  r = (*intruder)->Step(Step(1, a_.id), kWait);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->error_code(),
            static_cast<int32_t>(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(r->error_message(), HasSubstr("belongs to session"));
  EXPECT_EQ(LastStep(), 0u);
  // The owner's own ring may name its session or none.
  absl::StatusOr<std::unique_ptr<StepRingClient>> own = OpenRing(a_);
  ASSERT_TRUE(own.ok());
  r = (*own)->Step(Step(1, a_.id), kWait);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->error_code(), 0) << r->error_message();
}

TEST_F(StepRingTest, ARingOfAClosedSessionAnswersThenCloses) {
  Start();
  absl::StatusOr<std::unique_ptr<StepRingClient>> ring = OpenRing(b_);
  ASSERT_TRUE(ring.ok());
  rig_->sessions()->CloseNumber(b_.number);
  absl::StatusOr<v1::StepResponse> r = (*ring)->Step(Step(1), kWait);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->error_code(),
            static_cast<int32_t>(absl::StatusCode::kUnauthenticated));
  ASSERT_TRUE(Eventually([&] { return (*ring)->state() == kStepRingClosed; }));
  EXPECT_EQ((*ring)->Submit(Step(1)).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(StepRingTest, TheDrainClosesRingsAndRefusesNewOnes) {
  Start();
  absl::StatusOr<std::unique_ptr<StepRingClient>> ring = OpenRing(a_);
  ASSERT_TRUE(ring.ok());
  ASSERT_TRUE((*ring)->Submit(Step(1)).ok());
  ASSERT_TRUE((*ring)->Collect(kWait).ok());
  const absl::Time t = absl::Now();
  rig_->step()->EndStreams();
  EXPECT_LT(absl::Now() - t, absl::Seconds(5));
  EXPECT_EQ((*ring)->state(), kStepRingClosed);
  EXPECT_THAT((*ring)->closing_message(), HasSubstr("daemon closed"));
  EXPECT_EQ((*ring)->Submit(Step(2)).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(OpenRing(a_).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(rig_->step()->rings()->open(), 0);
  EXPECT_EQ(rig_->step()->service()->open_streams(), 0);
}

TEST_F(StepRingTest, RingsShareTheStreamLimits) {
  StepServiceOptions limits;
  limits.max_streams = 3;
  limits.max_streams_per_session = 2;
  Start(limits);
  absl::StatusOr<std::unique_ptr<StepRingClient>> r1 = OpenRing(a_);
  absl::StatusOr<std::unique_ptr<StepRingClient>> r2 = OpenRing(a_);
  ASSERT_TRUE(r1.ok() && r2.ok());
  absl::StatusOr<std::unique_ptr<StepRingClient>> r3 = OpenRing(a_);
  EXPECT_EQ(r3.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r3.status().message(),
              HasSubstr("--max_step_streams_per_session"));
  absl::StatusOr<std::unique_ptr<StepRingClient>> r4 = OpenRing(b_);
  ASSERT_TRUE(r4.ok());
  absl::StatusOr<std::unique_ptr<StepRingClient>> r5 = OpenRing(b_);
  EXPECT_EQ(r5.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r5.status().message(), HasSubstr("--max_step_streams = 3"));
  // Closing a session's rings gives their slots back.
  rig_->step()->rings()->CloseRingsOf(a_.number);
  EXPECT_EQ(rig_->step()->service()->open_streams(), 1);
  EXPECT_TRUE(OpenRing(a_).ok());
}

TEST_F(StepRingTest, OnlyItsSessionClosesARing) {
  Start();
  absl::StatusOr<std::unique_ptr<StepRingClient>> ring = OpenRing(a_);
  ASSERT_TRUE(ring.ok());
  StepRings* rings = rig_->step()->rings();
  const uint64_t id = (*ring)->ring_id();
  // Another session's ring and no ring at all read the same.
  absl::Status s = rings->CloseRing(CallerOf(b_), id);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("close_step_ring.ring_id"));
  EXPECT_EQ(rings->CloseRing(CallerOf(a_), id + 100).message(),
            absl::StrCat("close_step_ring.ring_id: this session has no step "
                         "ring ",
                         id + 100));
  EXPECT_EQ((*ring)->state(), kStepRingOpen);
  ASSERT_TRUE(rings->CloseRing(CallerOf(a_), id).ok());
  EXPECT_EQ((*ring)->state(), kStepRingClosed);
  EXPECT_EQ(rings->open(), 0);
  EXPECT_EQ(rig_->step()->service()->open_streams(), 0);
  EXPECT_EQ(rings->CloseRing(CallerOf(a_), id).code(),
            absl::StatusCode::kNotFound);
}

// The whole path a scheduler takes: the companion socket opens the ring
// (a sealed memfd handed over as a descriptor), the registration's owner
// grants it to the scheduler's session, steps go through, and closing the
// connection closes the ring.
class StepRingCompanionTest : public StepRingTest {
 protected:
  void StartCompanion() {
    Start();
    // Short: a socket path has at most 107 bytes.
    dir_ = "/tmp/kvdepot_ring_" + std::to_string(getpid());
    mkdir(dir_.c_str(), 0700);
    CompanionOptions co;
    co.path = dir_ + "/k.ctl";
    co.step_rings = rig_->step()->rings();
    co.budget = &budget_;
    absl::StatusOr<std::unique_ptr<CompanionServer>> c = CompanionServer::Start(
        co, rig_->backend(), rig_->pools(), rig_->sessions());
    ASSERT_TRUE(c.ok()) << c.status();
    companion_ = *std::move(c);
    absl::StatusOr<std::unique_ptr<CompanionConnection>> conn =
        CompanionConnection::Open(co.path, -1, "scheduler");
    ASSERT_TRUE(conn.ok()) << conn.status();
    conn_ = *std::move(conn);
  }
  void TearDown() override {
    conn_.reset();
    companion_.reset();
    if (!dir_.empty()) rmdir(dir_.c_str());
  }
  // 8 MiB per client: a ring of 4 x 1 MiB fits, one of 16 x 1 MiB not.
  MemoryBudget budget_{int64_t{64} << 20, int64_t{8} << 20, "test"};
  std::string dir_;
  std::unique_ptr<CompanionServer> companion_;
  std::unique_ptr<CompanionConnection> conn_;
};

TEST_F(StepRingCompanionTest, OpenedOnTheCompanionSocketAndClosedWithIt) {
  StartCompanion();
  v1::GrantRegistrationRequest g;
  g.set_registration_id(reg_);
  g.add_sessions(conn_->hello().session_number());
  ASSERT_TRUE(rig_->step()->registry()->Grant(CallerOf(a_), g).ok());
  absl::StatusOr<std::unique_ptr<StepRingClient>> ring =
      StepRingClient::Open(conn_.get(), 2, 8192);
  ASSERT_TRUE(ring.ok()) << ring.status();
  EXPECT_EQ((*ring)->slots(), 2u);
  for (uint64_t id = 1; id <= 5; ++id) {
    absl::StatusOr<v1::StepResponse> r = (*ring)->Step(Step(id), kWait);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->error_code(), 0) << r->error_message();
    Finish();
  }
  EXPECT_EQ(LastStep(), 5u);
  // Close() closes the daemon's side and gives the slot back.
  absl::StatusOr<std::unique_ptr<StepRingClient>> second =
      StepRingClient::Open(conn_.get(), 2, 8192);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(rig_->step()->rings()->open(), 2);
  ASSERT_TRUE((*second)->Close().ok());
  EXPECT_EQ((*second)->state(), kStepRingClosed);
  EXPECT_EQ(rig_->step()->rings()->open(), 1);
  EXPECT_TRUE((*second)->Close().ok());  // idempotent
  EXPECT_EQ(rig_->step()->rings()->open(), 1);
  conn_.reset();  // the session ends with its connection
  ASSERT_TRUE(Eventually([&] { return (*ring)->state() == kStepRingClosed; }));
  EXPECT_EQ(rig_->step()->rings()->open(), 0);
  // The scheduler's mapping stays valid after the daemon let go of it.
  EXPECT_EQ((*ring)->view().done().load(), 5u);
}

TEST_F(StepRingCompanionTest, BadGeometryIsRefusedByField) {
  StartCompanion();
  for (auto [slots, bytes, field] :
       {std::tuple{3, int64_t{0}, "open_step_ring.slots"},
        std::tuple{128, int64_t{0}, "open_step_ring.slots"},
        std::tuple{-4, int64_t{0}, "open_step_ring.slots"},
        std::tuple{2, int64_t{100}, "open_step_ring.request_bytes"},
        std::tuple{2, int64_t{1} << 40, "open_step_ring.request_bytes"},
        std::tuple{64, int64_t{16} << 20, "open_step_ring.request_bytes"}}) {
    absl::StatusOr<std::unique_ptr<StepRingClient>> ring =
        StepRingClient::Open(conn_.get(), slots, bytes);
    EXPECT_EQ(ring.status().code(), absl::StatusCode::kInvalidArgument)
        << slots << " " << bytes;
    EXPECT_THAT(ring.status().message(), HasSubstr(field));
  }
  EXPECT_EQ(rig_->step()->rings()->open(), 0);
  // The defaults: 4 slots of 1 MiB.
  absl::StatusOr<std::unique_ptr<StepRingClient>> ring =
      StepRingClient::Open(conn_.get());
  ASSERT_TRUE(ring.ok()) << ring.status();
  EXPECT_EQ((*ring)->slots(), 4u);
  EXPECT_EQ((*ring)->request_capacity(), (1 << 20) - 8);
}

TEST_F(StepRingCompanionTest, ARingBeyondTheSessionsBudgetIsRefused) {
  StartCompanion();
  absl::StatusOr<std::unique_ptr<StepRingClient>> big =
      StepRingClient::Open(conn_.get(), 16, 1 << 20);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(big.status().message(),
              HasSubstr("open_step_ring.request_bytes"));
  EXPECT_EQ(rig_->step()->rings()->open(), 0);
  EXPECT_EQ(rig_->step()->service()->open_streams(), 0);
  // What fits is admitted, and its bytes come back when it closes.
  absl::StatusOr<std::unique_ptr<StepRingClient>> ring =
      StepRingClient::Open(conn_.get(), 4, 1 << 20);
  ASSERT_TRUE(ring.ok()) << ring.status();
  EXPECT_EQ(StepRingClient::Open(conn_.get(), 4, 1 << 20).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE((*ring)->Close().ok());
  absl::StatusOr<std::unique_ptr<StepRingClient>> again =
      StepRingClient::Open(conn_.get(), 4, 1 << 20);
  EXPECT_TRUE(again.ok()) << again.status();
}

}  // namespace
}  // namespace kvdepot::step
