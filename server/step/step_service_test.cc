// The Step service at the daemon's edge, CPU backend (CI): the service is
// registered next to KVCache; without a GPU RegisterWorker is
// FAILED_PRECONDITION and nothing is registered; calls without a session
// or naming someone else's registration are refused.
#include <stdlib.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/kvdepot_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvdepot/v1/step.grpc.pb.h"
#include "proto/step_doorbell.h"
#include "server/daemon.h"

namespace kvdepot::step {
namespace {

using ::testing::HasSubstr;

TEST(StepServiceTest, CpuDaemonServesTheStepServiceAndRefusesWorkers) {
  std::string dir = "/tmp/kvdepot-step-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  DaemonOptions o;
  o.listen = dir + "/kv.sock";
  o.backend = "cpu";
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_TRUE(d.ok()) << d.status();
  ClientOptions co;
  co.address = (*d)->target();
  absl::StatusOr<std::unique_ptr<KVCacheClient>> c = KVCacheClient::Connect(co);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<BufferMapping> doorbell =
      (*c)->AllocateBuffer(doorbell::RegionBytes(1));
  ASSERT_TRUE(doorbell.ok()) << doorbell.status();
  std::unique_ptr<v1::Step::Stub> stub = v1::Step::NewStub((*c)->channel());

  v1::RegisterWorkerRequest r;
  r.set_session_id((*c)->session_id());
  r.set_doorbell_buffer_id(doorbell->id());
  r.set_max_tokens(4);
  r.set_max_seqs(1);
  r.add_layers();
  v1::RegisterWorkerResponse reg;
  {
    grpc::ClientContext ctx;
    grpc::Status s = stub->RegisterWorker(&ctx, r, &reg);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(), HasSubstr("cpu backend"));
  }
  {
    grpc::ClientContext ctx;
    v1::ListRegistrationsRequest l;
    l.set_session_id((*c)->session_id());
    v1::ListRegistrationsResponse list;
    ASSERT_TRUE(stub->ListRegistrations(&ctx, l, &list).ok());
    EXPECT_EQ(list.registrations_size(), 0);
  }
  {
    grpc::ClientContext ctx;
    v1::StepRequest step;
    step.set_session_id((*c)->session_id());
    step.set_registration_id(1);
    step.set_step_id(1);
    v1::StepResponse out;
    EXPECT_EQ(stub->Step(&ctx, step, &out).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    v1::StepRequest step;  // no session
    step.set_registration_id(1);
    v1::StepResponse out;
    EXPECT_EQ(stub->Step(&ctx, step, &out).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    v1::StepRequest step;  // a forged session id
    step.set_session_id("1.00000000000000000000000000000000");
    step.set_registration_id(1);
    v1::StepResponse out;
    EXPECT_EQ(stub->Step(&ctx, step, &out).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  c->reset();
  (*d)->Shutdown();
}

}  // namespace
}  // namespace kvdepot::step
