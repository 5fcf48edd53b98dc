// An inline call (gRPC's thread, server/backend/inline_call.h) never waits
// for a pool's lock: a holder may be waiting for the GPU. Finding the lock
// taken, Store and Load are deferred, having written nothing and counted
// nothing; through the callback serving model the call then runs again on
// a worker, which waits for the lock, and succeeds, while the gRPC threads
// go on answering. CPU backend, in process (tests/fuzz/service_world.h).
#include <grpcpp/grpcpp.h>
#include <grpcpp/test/server_context_test_spouse.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvdepot/v1/kvdepot.grpc.pb.h"
#include "proto/wire.h"
#include "server/backend/inline_call.h"
#include "server/service.h"
#include "server/serving.h"
#include "tests/fuzz/service_world.h"

namespace kvdepot {
namespace {

constexpr int kElements = 512;  // pool "v": V41, block 64 x 4, one layer

v1::StoreRequest OneToken(const std::string& session, int32_t slot) {
  v1::StoreRequest r;
  r.set_session_id(session);
  r.set_pool("v");
  r.set_layer(0);
  r.set_num_tokens(1);
  r.set_dtype(v1::INPUT_DTYPE_BF16);
  std::vector<int32_t> slots{slot};
  EncodeInt32s(slots, r.mutable_slot_mapping());
  std::string kv(2 * kElements, '\0');
  for (int i = 0; i < kElements; ++i) {
    kv[2 * i + 1] = static_cast<char>(0x3F);  // BF16 1.875 .. 1.0 range
    kv[2 * i] = static_cast<char>(i & 0x7F);
  }
  r.mutable_kv()->set_inline_data(kv);
  return r;
}

v1::LoadRequest LoadOne(const std::string& session, int32_t slot) {
  v1::LoadRequest r;
  r.set_session_id(session);
  r.set_pool("v");
  r.set_layer(0);
  const int32_t block = slot / 64, offset = slot % 64;
  std::vector<int32_t> segments{block, offset, offset + 1, 0};
  EncodeInt32s(segments, r.mutable_segments()->mutable_segments());
  r.mutable_segments()->set_num_segments(1);
  r.mutable_segments()->set_total_k(1);
  r.mutable_data()->set_inline_output(true);
  return r;
}

int64_t StoreCalls(KVCacheService& service, const std::string& session) {
  v1::StatsRequest req;
  v1::StatsResponse stats;
  grpc::ServerContext ctx;
  grpc::testing::ServerContextTestSpouse spouse(&ctx);
  spouse.AddClientMetadata(kSessionMetadataKey, session);
  EXPECT_TRUE(service.Stats(&ctx, &req, &stats).ok());
  for (const v1::RpcStats& r : stats.rpcs()) {
    if (r.rpc() == "Store") return r.calls();
  }
  return 0;
}

TEST(InlineDeferTest, ALockedPoolDefersTheInlineCallWhichChangesNothing) {
  fuzz::ServiceWorld w;
  std::shared_ptr<Pool> pool = *w.pools.Get("pool", "v");
  const v1::StoreRequest store = OneToken(w.session, 70);
  const v1::LoadRequest load = LoadOne(w.session, 70);
  v1::LoadResponse before;
  {
    grpc::ServerContext ctx;
    ASSERT_TRUE(w.service.Load(&ctx, &load, &before).ok());
  }
  {
    absl::MutexLock held(&pool->mu);  // as a call waiting for its kernels
    InlineCall inline_call;
    grpc::ServerContext ctx;
    v1::StoreResponse out;
    const grpc::Status s = w.service.Store(&ctx, &store, &out);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE)
        << s.error_message();
    EXPECT_TRUE(inline_call.deferred());
  }
  {
    absl::MutexLock held(&pool->mu);
    InlineCall inline_call;
    grpc::ServerContext ctx;
    v1::LoadResponse out;
    (void)w.service.Load(&ctx, &load, &out);
    EXPECT_TRUE(inline_call.deferred()) << "a Load needs the lock shared";
  }
  {
    absl::ReaderMutexLock shared(&pool->mu);  // another Load: no conflict
    InlineCall inline_call;
    grpc::ServerContext ctx;
    v1::LoadResponse out;
    EXPECT_TRUE(w.service.Load(&ctx, &load, &out).ok());
    EXPECT_FALSE(inline_call.deferred());
    EXPECT_EQ(out.data(), before.data()) << "the deferred Store wrote";
  }
  EXPECT_EQ(StoreCalls(w.service, w.session), 0)
      << "a deferred attempt is not a call";
  // The rerun (a worker: may wait) stores.
  grpc::ServerContext ctx;
  v1::StoreResponse out;
  ASSERT_TRUE(w.service.Store(&ctx, &store, &out).ok());
  EXPECT_EQ(out.tokens_written(), 1);
  EXPECT_EQ(StoreCalls(w.service, w.session), 1);
  v1::LoadResponse after;
  ASSERT_TRUE(w.service.Load(&ctx, &load, &after).ok());
  EXPECT_NE(after.data(), before.data());
}

TEST(InlineDeferTest, TheServingModelRunsADeferredCallOnAWorker) {
  fuzz::ServiceWorld w;
  ServingOptions o;
  o.worker_threads = 2;
  absl::StatusOr<std::unique_ptr<Serving>> serving = MakeServing(&w.service, o);
  ASSERT_TRUE(serving.ok()) << serving.status();
  grpc::ServerBuilder builder;
  builder.RegisterService((*serving)->service());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  std::unique_ptr<v1::KVCache::Stub> stub =
      v1::KVCache::NewStub(server->InProcessChannel(grpc::ChannelArguments()));
  std::shared_ptr<Pool> pool = *w.pools.Get("pool", "v");

  auto* held = new absl::MutexLock(&pool->mu);
  absl::Notification stored;
  grpc::Status store_status;
  v1::StoreResponse store_out;
  std::thread client([&] {
    grpc::ClientContext ctx;
    store_status = stub->Store(&ctx, OneToken(w.session, 5), &store_out);
    stored.Notify();
  });
  // One token: inline, deferred, then waiting on a worker for the lock.
  EXPECT_FALSE(stored.WaitForNotificationWithTimeout(absl::Milliseconds(200)))
      << "the Store finished while the pool's lock was held";
  // Meanwhile gRPC's threads answer.
  for (int i = 0; i < 4; ++i) {
    grpc::ClientContext ctx;
    ctx.AddMetadata(kSessionMetadataKey, w.session);
    v1::PingRequest ping;
    v1::PingResponse pong;
    EXPECT_TRUE(stub->Ping(&ctx, ping, &pong).ok());
  }
  delete held;
  ASSERT_TRUE(stored.WaitForNotificationWithTimeout(absl::Seconds(10)));
  client.join();
  EXPECT_TRUE(store_status.ok()) << store_status.error_message();
  EXPECT_EQ(store_out.tokens_written(), 1);
  EXPECT_EQ(StoreCalls(w.service, w.session), 1);
  grpc::ClientContext ctx;
  v1::LoadResponse loaded;
  ASSERT_TRUE(stub->Load(&ctx, LoadOne(w.session, 5), &loaded).ok());
  EXPECT_EQ(loaded.total_k(), 1);
  server->Shutdown();
  server->Wait();
  (*serving)->Shutdown();
}

}  // namespace
}  // namespace kvdepot
