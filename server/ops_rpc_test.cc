// The operations RPCs in-process: every validation rule of Inspect and
// Verify (code and message), Verify's streamed progress and checksums on
// awkward block sizes, Drain refusing new work while reads go on, and
// --metrics_address validation.

#include <chrono>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/kvdepot_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "server/in_process_daemon.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

class OpsRpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A Unix socket in a private directory: the client's companion session
    // carries its uid, the daemon's own (admin: Drain is allowed).
    absl::StatusOr<std::unique_ptr<Daemon>> d =
        Daemon::Start(InProcessDaemonOptions("ops"));
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    absl::StatusOr<std::unique_ptr<KVCacheClient>> c =
        ConnectInProcess(*daemon_);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    v1::CreatePoolRequest r;
    r.set_name("p");
    r.set_format("FP8_FP32SF_INDEX");
    r.set_block_size(133);
    r.set_num_blocks(3);
    r.set_num_layers(2);
    ASSERT_TRUE(client_->CreatePool(r).ok());
  }

  grpc::Status Inspect(const v1::InspectRequest& r, v1::InspectResponse* out) {
    grpc::ClientContext ctx;
    return client_->stub()->Inspect(&ctx, r, out);
  }

  // All progress messages of a Verify, and its final status.
  grpc::Status Verify(const v1::VerifyRequest& r,
                      std::vector<v1::VerifyProgress>* msgs) {
    grpc::ClientContext ctx;
    auto reader = client_->stub()->Verify(&ctx, r);
    v1::VerifyProgress m;
    while (reader->Read(&m)) msgs->push_back(m);
    return reader->Finish();
  }

  void Store(int64_t layer, int32_t first_slot, int n, int seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> kv(static_cast<size_t>(n) * 128);
    for (float& v : kv) v = dist(rng);
    std::vector<int32_t> slots(n);
    for (int i = 0; i < n; ++i) slots[i] = first_slot + i;
    v1::StoreRequest s;
    s.set_pool("p");
    s.set_layer(layer);
    s.set_num_tokens(n);
    EncodeInt32s(slots, s.mutable_slot_mapping());
    s.set_dtype(v1::INPUT_DTYPE_FP32);
    s.mutable_kv()->set_inline_data(kv.data(), kv.size() * sizeof(float));
    ASSERT_TRUE(client_->Store(s).ok());
  }

  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<KVCacheClient> client_;
};

TEST_F(OpsRpcTest, InspectValidation) {
  struct Case {
    v1::InspectRequest r;
    grpc::StatusCode code;
    const char* message;
  };
  std::vector<Case> cases;
  auto base = [] {
    v1::InspectRequest r;
    r.set_pool("p");
    r.set_layer(1);
    r.set_slot(0);
    return r;
  };
  v1::InspectRequest r = base();
  r.set_pool("q");
  cases.push_back({r, grpc::StatusCode::NOT_FOUND, "\"q\""});
  r = base();
  r.set_layer(2);
  cases.push_back(
      {r, grpc::StatusCode::INVALID_ARGUMENT, "layer = 2 is outside [0, 2)"});
  r = base();
  r.set_layer(-1);
  cases.push_back(
      {r, grpc::StatusCode::INVALID_ARGUMENT, "layer = -1 is outside [0, 2)"});
  r = base();
  r.set_slot(399);
  cases.push_back({r, grpc::StatusCode::INVALID_ARGUMENT,
                   "slot = 399 is outside [0, 399)"});
  r = base();
  r.set_block(3);
  cases.push_back(
      {r, grpc::StatusCode::INVALID_ARGUMENT, "block = 3 is outside [0, 3)"});
  r = base();
  r.clear_target();
  cases.push_back({r, grpc::StatusCode::INVALID_ARGUMENT,
                   "slot or block: one of them is required"});
  r = base();
  r.set_max_values(-5);
  cases.push_back(
      {r, grpc::StatusCode::INVALID_ARGUMENT, "max_values = -5 must be >= 0"});
  for (const Case& c : cases) {
    v1::InspectResponse out;
    grpc::Status s = Inspect(c.r, &out);
    EXPECT_EQ(s.error_code(), c.code) << c.message;
    EXPECT_THAT(s.error_message(), HasSubstr(c.message));
    EXPECT_EQ(out.records_size(), 0);
  }
}

TEST_F(OpsRpcTest, InspectDecodesStoredValues) {
  Store(1, 133, 3, 301);  // block 1, offsets 0..2
  v1::InspectRequest r;
  r.set_pool("p");
  r.set_layer(1);
  r.set_block(1);
  r.set_max_values(5);
  v1::InspectResponse out;
  ASSERT_TRUE(Inspect(r, &out).ok());
  ASSERT_EQ(out.records_size(), 133);
  EXPECT_EQ(out.records(0).slot(), 133);
  EXPECT_EQ(out.records(132).slot(), 265);
  EXPECT_FALSE(out.records(2).all_zero());
  EXPECT_TRUE(out.records(3).all_zero());
  ASSERT_EQ(out.records(0).values_size(), 5);
  ASSERT_EQ(out.records(0).scales_size(), 1);  // 128 elements / 128 per scale
  EXPECT_GT(out.records(0).scales(0), 0.0f);
  EXPECT_EQ(out.records(0).scale_hex().size(), 8u);
  bool nonzero = false;
  for (float v : out.records(0).values()) nonzero |= v != 0.0f;
  EXPECT_TRUE(nonzero);
  r.set_all_values(true);
  ASSERT_TRUE(Inspect(r, &out).ok());
  EXPECT_EQ(out.records(0).values_size(), 128);
}

TEST_F(OpsRpcTest, VerifyValidation) {
  struct Case {
    std::vector<int64_t> layers;
    int64_t every;
    const char* message;
  };
  const Case cases[] = {
      {{0, 2}, 0, "layers[1] = 2 is outside [0, 2)"},
      {{-1}, 0, "layers[0] = -1 is outside [0, 2)"},
      {{1, 0, 1}, 0, "layers[2] = 1 repeats layers[0]"},
      {{}, -1, "progress_every = -1 must be in [0, 16384]"},
      {{}, 16385, "progress_every = 16385 must be in [0, 16384]"},
  };
  for (const Case& c : cases) {
    v1::VerifyRequest r;
    r.set_pool("p");
    for (int64_t l : c.layers) r.add_layers(l);
    r.set_progress_every(c.every);
    std::vector<v1::VerifyProgress> msgs;
    grpc::Status s = Verify(r, &msgs);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.message;
    EXPECT_THAT(s.error_message(), HasSubstr(c.message));
    EXPECT_TRUE(msgs.empty());
  }
}

TEST_F(OpsRpcTest, VerifyStreamsProgressAndChecksumsAreStable) {
  Store(0, 0, 7, 301);
  v1::VerifyRequest r;
  r.set_pool("p");
  r.set_progress_every(1);
  std::vector<v1::VerifyProgress> a, b;
  ASSERT_TRUE(Verify(r, &a).ok());
  ASSERT_EQ(a.size(), 6u);  // 2 layers x 3 blocks, one message each
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].blocks_done(), static_cast<int64_t>(i) + 1);
    EXPECT_EQ(a[i].blocks_total(), 6);
    EXPECT_EQ(a[i].done(), i + 1 == a.size());
    ASSERT_EQ(a[i].checksums_size(), 1);
  }
  EXPECT_EQ(a.back().blocks_with_issues(), 0);
  ASSERT_TRUE(Verify(r, &b).ok());
  EXPECT_EQ(a.back().pool_xxh3(), b.back().pool_xxh3());
  // Untouched zero blocks share a checksum; the written one differs.
  EXPECT_NE(a[0].checksums(0).xxh3(), a[1].checksums(0).xxh3());
  EXPECT_EQ(a[1].checksums(0).xxh3(), a[2].checksums(0).xxh3());
  Store(1, 266, 1, 7);  // layer 1 block 2
  std::vector<v1::VerifyProgress> c;
  ASSERT_TRUE(Verify(r, &c).ok());
  for (size_t i = 0; i < c.size(); ++i) {
    EXPECT_EQ(c[i].checksums(0).xxh3() != a[i].checksums(0).xxh3(), i == 5)
        << i;
  }
  r.add_layers(1);
  r.set_progress_every(0);
  std::vector<v1::VerifyProgress> one;
  ASSERT_TRUE(Verify(r, &one).ok());
  EXPECT_EQ(one.back().blocks_total(), 3);
}

TEST_F(OpsRpcTest, DrainRefusesNewWorkKeepsReads) {
  grpc::ClientContext ctx;
  v1::DrainResponse d;
  ASSERT_TRUE(client_->stub()->Drain(&ctx, {}, &d).ok());
  EXPECT_TRUE(d.started());
  EXPECT_EQ(d.in_flight(), 0);
  EXPECT_EQ(d.sessions(), 1);
  grpc::ClientContext ctx2;
  ASSERT_TRUE(client_->stub()->Drain(&ctx2, {}, &d).ok());
  EXPECT_FALSE(d.started());
  v1::CreatePoolRequest r;
  r.set_name("later");
  r.set_format("V41");
  r.set_block_size(1);
  r.set_num_blocks(1);
  r.set_num_layers(1);
  absl::StatusOr<v1::PoolInfo> p = client_->CreatePool(r);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(p.status().message(), HasSubstr("draining"));
  EXPECT_TRUE(client_->ListPools().ok());
  absl::StatusOr<v1::StatsResponse> s = client_->Stats();
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->draining());
  ASSERT_GE(s->rejections_size(), 1);
  EXPECT_EQ(s->rejections(0).reason(), "draining");
  EXPECT_TRUE(client_->KeepAlive().ok());
}

// Without a session the operations and the destructive calls are refused
// (a second uid is tests/e2e_access_test).
TEST_F(OpsRpcTest, CallsWithoutASessionAreRefused) {
  ClientOptions co;
  co.address = daemon_->target();
  co.open_session = false;
  absl::StatusOr<std::unique_ptr<KVCacheClient>> anon =
      KVCacheClient::Connect(co);
  ASSERT_TRUE(anon.ok()) << anon.status();
  grpc::ClientContext c1;
  v1::DrainResponse d;
  EXPECT_EQ((*anon)->stub()->Drain(&c1, {}, &d).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ((*anon)->DeletePool("p").code(),
            absl::StatusCode::kUnauthenticated);
  v1::InspectRequest ir;
  ir.set_pool("p");
  grpc::ClientContext c2;
  v1::InspectResponse iout;
  EXPECT_EQ((*anon)->stub()->Inspect(&c2, ir, &iout).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  v1::StoreRequest sr;
  sr.set_pool("p");
  EXPECT_EQ((*anon)->Store(sr).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ((*anon)->CreatePool(v1::CreatePoolRequest()).status().code(),
            absl::StatusCode::kUnauthenticated);
  // Reading layouts and stats needs no session; no handle is ever returned.
  absl::StatusOr<v1::PoolInfo> info = (*anon)->GetPool("p");
  ASSERT_TRUE(info.ok());
  EXPECT_FALSE(info->has_handle());
  EXPECT_TRUE((*anon)->Stats().ok());
}

TEST(MetricsAddressTest, MalformedAddressFailsStart) {
  for (const char* bad : {"9400", "host:", "host:70000", ":x"}) {
    DaemonOptions o;
    o.listen = "127.0.0.1:0";
    o.backend = "cpu";
    o.metrics_address = bad;
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(d.status().message(),
                HasSubstr(absl::StrCat("--metrics_address = \"", bad, "\"")));
  }
}

TEST(MetricsAddressTest, PortZeroBindsAFreePort) {
  DaemonOptions o;
  o.listen = "127.0.0.1:0";
  o.backend = "cpu";
  o.metrics_address = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_THAT((*d)->metrics_address(), ::testing::StartsWith("127.0.0.1:"));
  EXPECT_NE((*d)->metrics_address(), "127.0.0.1:0");
}

}  // namespace
}  // namespace kvdepot
