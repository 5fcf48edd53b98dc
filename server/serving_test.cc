// The serving model in-process: both models answer; on the callback model
// an empty call is answered while long scans occupy the ops pool, a call
// beyond the pool's queue bound gets RESOURCE_EXHAUSTED at once, and bad
// serving options are refused.
#include "server/serving.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "client/kvdepot_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/in_process_daemon.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Daemon> StartDaemon(const ServingOptions& serving,
                                    absl::Duration verify_block_delay) {
  DaemonOptions o = InProcessDaemonOptions("serving");
  o.serving = serving;
  o.service.verify_block_delay = verify_block_delay;
  // These tests bound the scan pool itself: one client fills it, so the
  // per-client Verify limit (which must stay below ops_threads) is off.
  o.service.max_verify_streams_per_client = 0;
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

std::unique_ptr<KVCacheClient> Connect(const Daemon& d) {
  absl::StatusOr<std::unique_ptr<KVCacheClient>> c = ConnectInProcess(d);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

void CreatePool(KVCacheClient& c, int64_t blocks) {
  v1::CreatePoolRequest r;
  r.set_name("p");
  r.set_format("V41");
  r.set_block_size(16);
  r.set_num_blocks(blocks);
  r.set_num_layers(1);
  ASSERT_TRUE(c.CreatePool(r).ok());
}

TEST(ServingTest, BothModelsServeTheSameCalls) {
  for (const char* model : {"callback", "sync"}) {
    ServingOptions s;
    s.model = model;
    std::unique_ptr<Daemon> d = StartDaemon(s, absl::ZeroDuration());
    ASSERT_NE(d, nullptr) << model;
    std::unique_ptr<KVCacheClient> c = Connect(*d);
    ASSERT_NE(c, nullptr);
    EXPECT_TRUE(c->Ping().ok()) << model;
    CreatePool(*c, 4);  // offloaded on the callback model
    absl::StatusOr<v1::PoolInfo> p = c->GetPool("p");
    ASSERT_TRUE(p.ok()) << model << ": " << p.status();
    EXPECT_EQ(p->layout().num_blocks(), 4);
    grpc::ClientContext ctx;
    v1::VerifyRequest vr;
    vr.set_pool("p");
    auto reader = c->stub()->Verify(&ctx, vr);
    v1::VerifyProgress msg, last;
    int n = 0;
    while (reader->Read(&msg)) {
      last = msg;
      ++n;
    }
    EXPECT_TRUE(reader->Finish().ok()) << model;
    EXPECT_GT(n, 0) << model;
    EXPECT_TRUE(last.done()) << model;
    EXPECT_EQ(last.blocks_done(), 4) << model;
  }
}

TEST(ServingTest, ShortCallsAreAnsweredWhileScansRunAndTheQueueIsBounded) {
  ServingOptions s;
  s.ops_threads = 1;
  s.max_queued_calls = 1;
  // Each Verify takes 8 blocks x 250 ms = 2 s.
  std::unique_ptr<Daemon> d = StartDaemon(s, absl::Milliseconds(250));
  ASSERT_NE(d, nullptr);
  std::unique_ptr<KVCacheClient> c = Connect(*d);
  ASSERT_NE(c, nullptr);
  CreatePool(*c, 8);

  // One scan runs, one waits in the queue, the third is refused at once.
  struct Scan {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::VerifyProgress>> reader;
  };
  std::vector<std::unique_ptr<Scan>> scans;
  v1::VerifyRequest vr;
  vr.set_pool("p");
  for (int i = 0; i < 2; ++i) {
    scans.push_back(std::make_unique<Scan>());
    scans.back()->reader = c->stub()->Verify(&scans.back()->ctx, vr);
    // The first must have left the queue before the second comes.
    absl::SleepFor(absl::Milliseconds(300));
  }
  const absl::Time t0 = absl::Now();
  {
    grpc::ClientContext ctx;
    auto reader = c->stub()->Verify(&ctx, vr);
    v1::VerifyProgress msg;
    while (reader->Read(&msg)) {
    }
    const grpc::Status st = reader->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr("queued"));
  }
  // Inline calls do not wait for the scans.
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(c->Ping().ok());
  EXPECT_TRUE(c->GetPool("p").ok());
  EXPECT_LT(absl::Now() - t0, absl::Seconds(1))
      << "the refusal and 20 Pings waited for a scan";
  for (auto& scan : scans) {
    v1::VerifyProgress msg;
    while (scan->reader->Read(&msg)) {
    }
    EXPECT_TRUE(scan->reader->Finish().ok());
  }
}

TEST(ServingTest, BadOptionsAreRefused) {
  ServingOptions s;
  s.model = "async";
  absl::StatusOr<std::unique_ptr<Serving>> r = MakeServing(nullptr, s);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("\"async\""));
  s = ServingOptions();
  s.worker_threads = 0;
  r = MakeServing(nullptr, s);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("worker_threads"));
  s = ServingOptions();
  s.ops_threads = 5000;
  EXPECT_EQ(MakeServing(nullptr, s).status().code(),
            absl::StatusCode::kInvalidArgument);
  s = ServingOptions();
  s.max_queued_calls = 0;
  r = MakeServing(nullptr, s);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("max_queued_calls"));
  s = ServingOptions();
  s.inline_max_rows = -1;
  EXPECT_EQ(MakeServing(nullptr, s).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvdepot
