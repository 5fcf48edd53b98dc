// Step.PlanStep at the service edge (CI, no GPU): the Step service in
// process on FakeEngine registrations (step_test_rig.h), called over its
// Unix socket. A decode step's plan (built on the gRPC thread) and one
// large enough to be built on a step worker come back whole; the caller
// must be authenticated and own or be granted the registration; PlanStep
// consumes no step id; replies are admitted against the reply budget and
// held until each call is done.
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvdepot/v1/step.grpc.pb.h"
#include "proto/wire.h"
#include "server/memory_budget.h"
#include "server/reply_scope.h"
#include "server/step/step_service.h"
#include "server/step/step_test_rig.h"

namespace kvdepot::step {
namespace {

using ::testing::HasSubstr;

class PlanStepServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    StepTestRigOptions o;
    o.max_batch = 512;
    o.top_k = 16;
    absl::StatusOr<std::unique_ptr<StepTestRig>> rig = StepTestRig::Start(o);
    ASSERT_TRUE(rig.ok()) << rig.status();
    rig_ = *std::move(rig);
    stub_ = v1::Step::NewStub(rig_->NewChannel());
    absl::StatusOr<StepTestRig::Parties> parties = rig_->OpenParties();
    ASSERT_TRUE(parties.ok()) << parties.status();
    a_ = parties->worker;
    b_ = parties->intruder;
    reg_ = parties->registration;
  }

  grpc::Status Plan(const v1::StepRequest& r, v1::PlanStepResponse* out) {
    grpc::ClientContext ctx;
    return stub_->PlanStep(&ctx, r, out);
  }

  std::unique_ptr<StepTestRig> rig_;
  std::unique_ptr<v1::Step::Stub> stub_;
  OpenedSession a_, b_;
  uint64_t reg_ = 0;
};

// Batch 3 is planned inline, batch 512 (512 x 64 table entries) on a step
// worker: both carry the request's slots and one table row per token.
TEST_F(PlanStepServiceTest, SmallAndLargePlansComeBackWhole) {
  for (int batch : {3, 512}) {
    SCOPED_TRACE(batch);
    const v1::StepRequest r = rig_->Step(a_.id, reg_, 1, batch);
    EXPECT_EQ(int64_t{batch} * r.block_table_cols() >= kPlanStepInlineEntries,
              batch == 512);
    v1::PlanStepResponse p;
    const grpc::Status s = Plan(r, &p);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(p.num_tokens(), batch);
    const std::vector<int32_t> m = ReadInt32s(p.metadata());
    const std::vector<int32_t> slots = ReadInt32s(r.slot_mapping());
    ASSERT_GE(p.slots(), 0);
    ASSERT_LE(p.slots() + batch, static_cast<int64_t>(m.size()));
    EXPECT_EQ(std::vector<int32_t>(m.begin() + p.slots(),
                                   m.begin() + p.slots() + batch),
              slots);
    const std::vector<int32_t> tables = ReadInt32s(r.block_tables());
    const int64_t cols = r.block_table_cols();
    ASSERT_GE(p.row_block_tables(), 0);
    ASSERT_LE(p.row_block_tables() + batch * cols,
              static_cast<int64_t>(m.size()));
    EXPECT_EQ(
        std::vector<int32_t>(m.begin() + p.row_block_tables(),
                             m.begin() + p.row_block_tables() + batch * cols),
        tables)
        << "decode rows: row r is sequence r";
  }
  EXPECT_EQ(rig_->factory()->last()->enqueued(), 0);
  // Step 1 is still the next step.
  grpc::ClientContext ctx;
  v1::StepResponse out;
  const grpc::Status s = stub_->Step(&ctx, rig_->Step(a_.id, reg_, 1, 3), &out);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST_F(PlanStepServiceTest, StrangersAndMissingSessionsAreRefused) {
  for (int batch : {3, 512}) {
    SCOPED_TRACE(batch);
    v1::PlanStepResponse p;
    grpc::Status s = Plan(rig_->Step(b_.id, reg_, 1, batch), &p);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(s.error_message(), HasSubstr("registration_id"));
    EXPECT_TRUE(p.metadata().empty());
    s = Plan(rig_->Step("", reg_, 1, batch), &p);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    v1::StepRequest bad = rig_->Step(a_.id, reg_, 1, batch);
    bad.set_top_k(17);
    s = Plan(bad, &p);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("top_k"));
  }
}

// A client that stops reading could otherwise pile plans of up to 64 MiB
// up in the daemon: each reply is admitted against the reply budget (here
// 64 KiB per client) and given back when the call is done.
TEST(PlanStepBudgetTest, RepliesAreAdmittedAgainstTheReplyBudget) {
  MemoryBudget replies(int64_t{1} << 20, int64_t{64} << 10, "--max_reply_bytes",
                       ReplyBudgetNames());
  StepTestRigOptions o;
  o.max_batch = 512;
  o.top_k = 16;
  o.service.replies = &replies;
  absl::StatusOr<std::unique_ptr<StepTestRig>> rig = StepTestRig::Start(o);
  ASSERT_TRUE(rig.ok()) << rig.status();
  std::unique_ptr<v1::Step::Stub> stub =
      v1::Step::NewStub((*rig)->NewChannel());
  absl::StatusOr<StepTestRig::Parties> parties = (*rig)->OpenParties();
  ASSERT_TRUE(parties.ok()) << parties.status();
  // 512 rows of 64 table entries: > 128 KiB of metadata, built on a step
  // worker; refused, and nothing is held.
  for (int batch : {512, 200}) {
    SCOPED_TRACE(batch);
    grpc::ClientContext ctx;
    v1::PlanStepResponse p;
    const grpc::Status s = stub->PlanStep(
        &ctx, (*rig)->Step(parties->worker.id, parties->registration, 1, batch),
        &p);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(s.error_message(), HasSubstr("PlanStep reply"));
    EXPECT_TRUE(p.metadata().empty());
  }
  // A decode step of 3 rows fits; its bytes come back once it is done.
  grpc::ClientContext ctx;
  v1::PlanStepResponse p;
  const grpc::Status s = stub->PlanStep(
      &ctx, (*rig)->Step(parties->worker.id, parties->registration, 1, 3), &p);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_FALSE(p.metadata().empty());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (replies.used() != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(replies.used(), 0);
}

}  // namespace
}  // namespace kvdepot::step
