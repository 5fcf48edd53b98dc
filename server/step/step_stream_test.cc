// StepStream and the unary Step on the callback service, without a GPU
// (StepTestRig: FakeEngine registrations whose steps stay in flight until
// the test finishes them): per-message refusals keep the stream open, a
// stream's binding to one session (metadata or first message; another
// session's id refused without a lookup; a closed session refused), the
// attack by another session's stream, the daemon-wide and per-session
// stream limits and their slots given back when a client cancels, the
// drain, idle streams holding no thread, and the unary path as it was.
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvdepot/v1/step.grpc.pb.h"
#include "server/step/step_test_rig.h"

namespace kvdepot::step {
namespace {

using ::testing::HasSubstr;
using Stream = grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>;

// Polls `done` until it holds or 10 s pass.
bool Eventually(const std::function<bool()>& done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return true;
}

int ProcessThreads() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (absl::StartsWith(line, "Threads:")) return std::stoi(line.substr(8));
  }
  return -1;
}

class StepStreamTest : public ::testing::Test {
 protected:
  void Start(StepServiceOptions service = {}) {
    StepTestRigOptions o;
    o.auto_finish = false;
    o.max_batch = 8;
    o.top_k = 16;
    o.service = service;
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
  struct Call {
    std::unique_ptr<grpc::ClientContext> ctx =
        std::make_unique<grpc::ClientContext>();
    std::unique_ptr<Stream> stream;
  };
  // A stream; `metadata_session` non-empty: sent as kvdepot-session-id.
  Call Open(const std::string& metadata_session = "") {
    Call c;
    c.ctx->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::seconds(30));
    if (!metadata_session.empty()) {
      c.ctx->AddMetadata("kvdepot-session-id", metadata_session);
    }
    c.stream = stub_->StepStream(c.ctx.get());
    return c;
  }
  // One message and its reply (the test fails when none comes).
  v1::StepResponse Send(Call& c, const v1::StepRequest& r) {
    v1::StepResponse out;
    EXPECT_TRUE(c.stream->Write(r));
    EXPECT_TRUE(c.stream->Read(&out)) << "no reply: the stream ended";
    return out;
  }
  v1::StepRequest Step(const std::string& session, uint64_t step_id) {
    return rig_->Step(session, reg_, step_id, 3);
  }
  uint64_t LastStep() {
    absl::StatusOr<Caller> c =
        rig_->sessions()->Authenticate(a_.id, absl::Now());
    EXPECT_TRUE(c.ok());
    absl::StatusOr<v1::RegistrationInfo> info =
        rig_->step()->registry()->Status(*c, reg_);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->last_step_id() : 0;
  }
  int OpenStreams() const { return rig_->step()->service()->open_streams(); }

  std::unique_ptr<StepTestRig> rig_;
  std::unique_ptr<v1::Step::Stub> stub_;
  OpenedSession a_, b_;
  uint64_t reg_ = 0;
};

TEST_F(StepStreamTest, ARefusedMessageGetsItsErrorAndTheStreamGoesOn) {
  Start();
  Call c = Open();
  // The wrong step id: refused, naming the field.
  v1::StepResponse r = Send(c, Step(a_.id, 5));
  EXPECT_EQ(r.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.error_message(), HasSubstr("is not the next step (1)"));
  EXPECT_EQ(r.error_field(), "step_id");
  EXPECT_EQ(r.queued(), 0);
  // A slot outside the pool: refused with the index.
  v1::StepRequest bad = Step(a_.id, 1);
  std::string slots = bad.slot_mapping();
  const int32_t outside = 1 << 30;
  std::memcpy(slots.data() + 4, &outside, 4);
  bad.set_slot_mapping(slots);
  r = Send(c, bad);
  EXPECT_EQ(r.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(r.error_field(), "slot_mapping[1]") << r.error_message();
  EXPECT_EQ(rig_->factory()->last()->enqueued(), 0);
  // The same stream: good steps are accepted, in order.
  r = Send(c, Step(a_.id, 1));
  EXPECT_EQ(r.error_code(), 0) << r.error_message();
  EXPECT_EQ(r.step_id(), 1u);
  EXPECT_EQ(r.queued(), 1);
  r = Send(c, Step(a_.id, 2));
  EXPECT_EQ(r.error_code(), 0) << r.error_message();
  EXPECT_EQ(r.queued(), 2);
  // A third in flight: RESOURCE_EXHAUSTED as a reply, and it consumes no id.
  r = Send(c, Step(a_.id, 3));
  EXPECT_EQ(r.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(r.error_message(), HasSubstr("in flight already"));
  EXPECT_EQ(r.error_field(), "");
  ASSERT_TRUE(rig_->factory()->last()->FinishOne());
  r = Send(c, Step(a_.id, 3));
  EXPECT_EQ(r.error_code(), 0) << r.error_message();
  EXPECT_EQ(rig_->factory()->last()->enqueued(), 3);
  EXPECT_EQ(LastStep(), 3u);
  ASSERT_TRUE(c.stream->WritesDone());
  EXPECT_TRUE(c.stream->Finish().ok());
  EXPECT_TRUE(Eventually([&] { return OpenStreams() == 0; }));
}

TEST_F(StepStreamTest, AnotherSessionsStreamCannotStepTheRegistration) {
  Start();
  Call c = Open();
  for (int i = 0; i < 2; ++i) {  // bound to b_ by its first message
    v1::StepResponse r = Send(c, Step(b_.id, 1));
    EXPECT_EQ(r.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(r.error_message(), HasSubstr("neither owned by nor granted"));
  }
  // Nor through the metadata of the owner's id with its own messages: the
  // metadata binds, and b_'s id in a message is refused.
  Call m = Open(a_.id);
  v1::StepResponse r = Send(m, Step(b_.id, 1));
  EXPECT_EQ(r.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(rig_->factory()->last()->enqueued(), 0);
  EXPECT_EQ(LastStep(), 0u);
  // The owner's stream goes on.
  r = Send(m, Step("", 1));
  EXPECT_EQ(r.error_code(), 0) << r.error_message();
  EXPECT_EQ(LastStep(), 1u);
  c.ctx->TryCancel();
  m.ctx->TryCancel();
}

TEST_F(StepStreamTest, AStreamIsBoundToTheSessionOfItsFirstMessage) {
  Start();
  Call c = Open();
  // Before binding: no session, then a forged one: UNAUTHENTICATED, open.
  v1::StepResponse r = Send(c, Step("", 1));
  EXPECT_EQ(r.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  r = Send(c, Step("1.00000000000000000000000000000000", 1));
  EXPECT_EQ(r.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  r = Send(c, Step(a_.id, 1));  // binds
  EXPECT_EQ(r.error_code(), 0) << r.error_message();
  // Another (valid) session's id, or a forged one: refused without lookup.
  for (const std::string& other :
       {b_.id, std::string("1.00000000000000000000000000000000")}) {
    r = Send(c, Step(other, 2));
    EXPECT_EQ(r.error_code(), grpc::StatusCode::PERMISSION_DENIED) << other;
    EXPECT_EQ(r.error_field(), "");
    EXPECT_THAT(r.error_message(), HasSubstr("bound to session"));
  }
  // The bound id again, or none: the bound session.
  r = Send(c, Step("", 2));
  EXPECT_EQ(r.error_code(), 0) << r.error_message();
  EXPECT_EQ(LastStep(), 2u);
  ASSERT_TRUE(c.stream->WritesDone());
  EXPECT_TRUE(c.stream->Finish().ok());
}

TEST_F(StepStreamTest, ABadMetadataSessionEndsTheCallAtOnce) {
  Start();
  Call c = Open("1.00000000000000000000000000000000");
  v1::StepResponse r;
  c.stream->Write(Step(a_.id, 1));
  EXPECT_FALSE(c.stream->Read(&r));
  EXPECT_EQ(c.stream->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(LastStep(), 0u);
  EXPECT_TRUE(Eventually([&] { return OpenStreams() == 0; }));
}

TEST_F(StepStreamTest, MessagesAfterTheSessionClosedAreRefused) {
  Start();
  Call c = Open();
  v1::StepResponse r = Send(c, Step(a_.id, 1));
  EXPECT_EQ(r.error_code(), 0) << r.error_message();
  ASSERT_GT(rig_->sessions()->CloseNumber(a_.number), 0);
  for (int i = 0; i < 2; ++i) {
    r = Send(c, Step(a_.id, 2));
    EXPECT_EQ(r.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    r = Send(c, Step("", 2));
    EXPECT_EQ(r.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(rig_->factory()->last()->enqueued(), 1);
  ASSERT_TRUE(c.stream->WritesDone());
  EXPECT_TRUE(c.stream->Finish().ok());
}

TEST_F(StepStreamTest, ASessionsStreamsAreCappedAndCancelGivesTheSlotBack) {
  StepServiceOptions o;
  o.max_streams_per_session = 2;
  Start(o);
  std::vector<Call> calls;
  for (int i = 0; i < 2; ++i) {
    calls.push_back(Open());
    v1::StepResponse r = Send(calls.back(), Step(a_.id, 99));  // binds
    EXPECT_EQ(r.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  // A third stream of a_: ends at binding, with the limit's name.
  Call third = Open();
  v1::StepResponse r;
  EXPECT_TRUE(third.stream->Write(Step(a_.id, 1)));
  EXPECT_FALSE(third.stream->Read(&r));
  grpc::Status s = third.stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(),
              HasSubstr("--max_step_streams_per_session = 2"));
  EXPECT_EQ(LastStep(), 0u);
  // Through the metadata: refused when the call starts.
  Call md = Open(a_.id);
  EXPECT_FALSE(md.stream->Read(&r));
  EXPECT_EQ(md.stream->Finish().error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  // Another session is not limited by a_'s streams.
  Call other = Open();
  r = Send(other, Step(b_.id, 1));
  EXPECT_EQ(r.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // The client cancels one of a_'s: its slot comes back.
  calls[0].ctx->TryCancel();
  EXPECT_FALSE(calls[0].stream->Read(&r));
  EXPECT_EQ(calls[0].stream->Finish().error_code(),
            grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(Eventually([&] { return OpenStreams() == 2; })) << OpenStreams();
  Call again = Open();
  r = Send(again, Step(a_.id, 1));
  EXPECT_EQ(r.error_code(), 0) << r.error_message();
  for (Call* c : {&calls[1], &other, &again}) c->ctx->TryCancel();
  EXPECT_TRUE(Eventually([&] { return OpenStreams() == 0; }));
}

TEST_F(StepStreamTest, TheDaemonsStreamsAreCappedAndClosingGivesTheSlotBack) {
  StepServiceOptions o;
  o.max_streams = 2;
  Start(o);
  Call c1 = Open();
  Call c2 = Open();
  // Unbound streams count too: each has answered a message.
  EXPECT_EQ(Send(c1, Step("", 1)).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Send(c2, Step(b_.id, 1)).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  Call c3 = Open();
  v1::StepResponse r;
  EXPECT_FALSE(c3.stream->Read(&r));
  grpc::Status s = c3.stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("--max_step_streams = 2"));
  // A stream the client closes (WritesDone) gives its slot back too.
  ASSERT_TRUE(c1.stream->WritesDone());
  EXPECT_TRUE(c1.stream->Finish().ok());
  ASSERT_TRUE(Eventually([&] { return OpenStreams() == 1; })) << OpenStreams();
  Call c4 = Open();
  r = Send(c4, Step(a_.id, 1));
  EXPECT_EQ(r.error_code(), 0) << r.error_message();
  c2.ctx->TryCancel();
  c4.ctx->TryCancel();
  EXPECT_TRUE(Eventually([&] { return OpenStreams() == 0; }));
}

TEST_F(StepStreamTest, IdleStreamsHoldNoThread) {
  StepServiceOptions o;
  o.max_streams = 64;
  o.max_streams_per_session = 64;
  Start(o);
  std::vector<Call> calls;
  calls.push_back(Open());
  EXPECT_EQ(Send(calls[0], Step(a_.id, 99)).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  const int before = ProcessThreads();
  for (int i = 0; i < 40; ++i) {
    calls.push_back(Open());
    EXPECT_EQ(Send(calls.back(), Step(a_.id, 99)).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  // 40 more open, idle streams (each waiting for its next message); a
  // thread per stream (the sync API) would show here.
  EXPECT_EQ(OpenStreams(), 41);
  EXPECT_LT(ProcessThreads() - before, 10) << before;
  for (Call& c : calls) c.ctx->TryCancel();
  EXPECT_TRUE(Eventually([&] { return OpenStreams() == 0; }));
}

TEST_F(StepStreamTest, TheDrainEndsOpenStreamsAndRefusesNewOnes) {
  Start();
  Call c = Open();
  EXPECT_EQ(Send(c, Step(a_.id, 1)).error_code(), 0);
  rig_->step()->EndStreams();
  v1::StepResponse r;
  EXPECT_FALSE(c.stream->Read(&r));
  EXPECT_EQ(c.stream->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  Call late = Open();
  EXPECT_FALSE(late.stream->Read(&r));
  EXPECT_EQ(late.stream->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(Eventually([&] { return OpenStreams() == 0; }));
}

TEST_F(StepStreamTest, TheUnaryStepIsUnchangedAndSharesTheStepIds) {
  Start();
  auto unary = [&](const v1::StepRequest& req, v1::StepResponse* out) {
    grpc::ClientContext ctx;
    return stub_->Step(&ctx, req, out);
  };
  v1::StepResponse out;
  grpc::Status s = unary(Step(a_.id, 1), &out);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(out.step_id(), 1u);
  EXPECT_EQ(out.queued(), 1);
  EXPECT_EQ(out.error_code(), 0);
  // Errors are the call's status, with the field as a BadRequest detail.
  s = unary(Step(a_.id, 7), &out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  google::rpc::Status details;
  ASSERT_TRUE(details.ParseFromString(s.error_details()));
  google::rpc::BadRequest bad;
  ASSERT_EQ(details.details_size(), 1);
  ASSERT_TRUE(details.details(0).UnpackTo(&bad));
  EXPECT_EQ(bad.field_violations(0).field(), "step_id");
  EXPECT_EQ(unary(Step(b_.id, 2), &out).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(unary(Step("", 2), &out).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  // A stream continues where the unary calls left off, and back.
  Call c = Open();
  EXPECT_EQ(Send(c, Step(a_.id, 2)).error_code(), 0);
  ASSERT_TRUE(rig_->factory()->last()->FinishOne());
  s = unary(Step(a_.id, 3), &out);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(LastStep(), 3u);
  {
    grpc::ClientContext ctx;
    v1::ListRegistrationsRequest l;
    l.set_session_id(a_.id);
    v1::ListRegistrationsResponse list;
    ASSERT_TRUE(stub_->ListRegistrations(&ctx, l, &list).ok());
    EXPECT_EQ(list.registrations_size(), 1);
  }
  // RegisterWorker and Unregister run on the pool, with the same answers.
  {
    grpc::ClientContext ctx;
    v1::RegisterWorkerRequest bad;
    bad.set_session_id(a_.id);
    v1::RegisterWorkerResponse reply;
    s = stub_->RegisterWorker(&ctx, bad, &reply);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << s.error_message();
  }
  for (const std::string& who : {b_.id, a_.id}) {
    grpc::ClientContext ctx;
    v1::UnregisterRequest u;
    u.set_session_id(who);
    u.set_registration_id(reg_);
    v1::UnregisterResponse reply;
    s = stub_->Unregister(&ctx, u, &reply);
    EXPECT_EQ(s.error_code(), who == a_.id
                                  ? grpc::StatusCode::OK
                                  : grpc::StatusCode::PERMISSION_DENIED)
        << s.error_message();
  }
  v1::StepResponse gone = Send(c, Step(a_.id, 4));
  EXPECT_EQ(gone.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(gone.error_field(), "");
  ASSERT_TRUE(c.stream->WritesDone());
  EXPECT_TRUE(c.stream->Finish().ok());
}

}  // namespace
}  // namespace kvdepot::step
