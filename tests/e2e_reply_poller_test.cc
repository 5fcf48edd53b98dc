// End to end: a client that polls for its replies (ClientOptions.reply_spin,
// client/reply_poller.h) against a kvdepotd process. Its calls must return
// exactly what a client sleeping on its replies gets: the same bytes, the
// same errors with the same details, each caller its own reply when many
// threads share the client, and the same results when the spin window is
// too short for the reply and the call sleeps after all.
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"

namespace kvdepot::testing {
namespace {

constexpr int64_t kBlockSize = 7;
constexpr int64_t kNumBlocks = 19;

class ReplyPollerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start();
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = d->release();
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }

  static std::unique_ptr<KVCacheClient> Polling(absl::Duration spin) {
    ClientOptions o;
    o.address = daemon_->socket_path();
    o.client_name = "polling";
    o.reply_spin = spin;
    absl::StatusOr<std::unique_ptr<KVCacheClient>> c =
        KVCacheClient::Connect(o);
    if (!c.ok()) {
      ADD_FAILURE() << c.status();
      return nullptr;
    }
    return *std::move(c);
  }

  // A V41 pool owned by `owner`, granted to `other`'s session, with every
  // slot stored from random K/V through `writer`; returns the reference
  // copy.
  static LocalPool FilledPool(const std::string& name, KVCacheClient* owner,
                              KVCacheClient* other, KVCacheClient* writer) {
    absl::StatusOr<v1::PoolInfo> info = owner->CreatePool(
        PoolRequest(name, "V41", 0, kBlockSize, kNumBlocks, 1));
    EXPECT_TRUE(info.ok()) << info.status();
    v1::GrantRequest g;
    g.set_pool(name);
    g.add_sessions(other->session_number());
    EXPECT_TRUE(owner->Grant(g).ok());
    LocalPool local = LocalPool::FromInfo(*info);
    std::mt19937 rng(1331);
    std::vector<int32_t> slots(static_cast<size_t>(kBlockSize * kNumBlocks));
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    const int64_t e = local.layout.format.elements();
    const std::vector<float> kv =
        RandomKv(static_cast<int64_t>(slots.size()), e, rng);
    v1::StoreRequest s = StoreRequest(name, 0, slots, v1::INPUT_DTYPE_FP32);
    *s.mutable_kv() = InlineData(Fp32Bytes(kv));
    absl::StatusOr<v1::StoreResponse> r = writer->Store(s);
    EXPECT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(
        Store(local.layout, local.layer(0), kv.data(), InputDtype::kFP32, slots)
            .ok());
    return local;
  }

  // Loads `segments` (block, begin, end, row) of layer 0 inline.
  static absl::StatusOr<std::string> LoadRows(
      KVCacheClient* c, const std::string& pool,
      const std::vector<int32_t>& segments, int64_t total_k) {
    v1::LoadRequest lr;
    lr.set_pool(pool);
    *lr.mutable_segments() = SegmentsProto(segments, total_k);
    *lr.mutable_data() = InlineOutput();  // V41 loads BF16 rows, no scales
    absl::StatusOr<v1::LoadResponse> r = c->Load(lr);
    if (!r.ok()) return r.status();
    return r->data();
  }

  static std::string Expected(LocalPool& local,
                              const std::vector<int32_t>& segments,
                              int64_t total_k) {
    const int64_t data_row = LoadDataRowBytes(local.layout.format);
    const int64_t scale_row = LoadScaleRowBytes(local.layout.format);
    std::string out(static_cast<size_t>(total_k * (data_row + scale_row)), 0);
    auto* p = reinterpret_cast<uint8_t*>(out.data());
    EXPECT_TRUE(LoadSegments(local.layout, local.layer(0), segments, total_k, p,
                             p + total_k * data_row)
                    .ok());
    return out;
  }

  static DaemonProcess* daemon_;
};

DaemonProcess* ReplyPollerTest::daemon_ = nullptr;

TEST_F(ReplyPollerTest, NegativeSpinIsRefusedAtConnect) {
  ClientOptions o;
  o.address = daemon_->socket_path();
  o.reply_spin = absl::Microseconds(-1);
  absl::StatusOr<std::unique_ptr<KVCacheClient>> c = KVCacheClient::Connect(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("reply_spin"), std::string::npos)
      << c.status();
}

TEST_F(ReplyPollerTest, RepliesEqualASleepingClientsByteForByte) {
  std::unique_ptr<KVCacheClient> sleeping =
      ConnectOrDie(daemon_->socket_path());
  std::unique_ptr<KVCacheClient> polling = Polling(absl::Seconds(1));
  ASSERT_NE(sleeping, nullptr);
  ASSERT_NE(polling, nullptr);
  ASSERT_TRUE(polling->Ping().ok());
  LocalPool local =
      FilledPool("polled", sleeping.get(), polling.get(), polling.get());
  // Every slot once, blocks in reverse, one row per token.
  std::vector<int32_t> segs;
  int32_t row = 0;
  for (int32_t b = kNumBlocks - 1; b >= 0; --b) {
    segs.insert(segs.end(), {b, 0, static_cast<int32_t>(kBlockSize), row});
    row += kBlockSize;
  }
  const std::string want = Expected(local, segs, row);
  absl::StatusOr<std::string> a = LoadRows(polling.get(), "polled", segs, row);
  absl::StatusOr<std::string> b = LoadRows(sleeping.get(), "polled", segs, row);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*a, want);
  EXPECT_EQ(*b, want);

  // Errors: the same code, message and details from both.
  v1::StoreRequest bad =
      StoreRequest("polled", 0, {0, 1000}, v1::INPUT_DTYPE_BF16);
  *bad.mutable_kv() = InlineData(std::string(
      static_cast<size_t>(2 * local.layout.format.elements() * 2), 'x'));
  absl::StatusOr<v1::StoreResponse> ep = polling->Store(bad);
  absl::StatusOr<v1::StoreResponse> es = sleeping->Store(bad);
  ASSERT_FALSE(ep.ok());
  EXPECT_EQ(ep.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ep.status().code(), es.status().code());
  EXPECT_EQ(ep.status().message(), es.status().message());
  EXPECT_NE(ep.status().message().find("slot_mapping"), std::string::npos)
      << ep.status();
  EXPECT_EQ(ep.status().GetPayload(kGrpcStatusDetailsUrl),
            es.status().GetPayload(kGrpcStatusDetailsUrl));
  EXPECT_TRUE(ep.status().GetPayload(kGrpcStatusDetailsUrl).has_value());
  // The refused call wrote nothing.
  absl::StatusOr<std::string> again =
      LoadRows(polling.get(), "polled", segs, row);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, want);
  absl::StatusOr<v1::LoadResponse> missing = [&] {
    v1::LoadRequest lr;
    lr.set_pool("no-such-pool");
    *lr.mutable_segments() = SegmentsProto(segs, row);
    *lr.mutable_data() = InlineOutput();
    return polling->Load(lr);
  }();
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound)
      << missing.status();
  ASSERT_TRUE(sleeping->DeletePool("polled").ok());
}

TEST_F(ReplyPollerTest, ManyThreadsEachGetTheirOwnReplies) {
  std::unique_ptr<KVCacheClient> owner = ConnectOrDie(daemon_->socket_path());
  std::unique_ptr<KVCacheClient> polling = Polling(absl::Milliseconds(50));
  ASSERT_NE(owner, nullptr);
  ASSERT_NE(polling, nullptr);
  LocalPool local =
      FilledPool("threads", owner.get(), polling.get(), owner.get());
  constexpr int kThreads = 8, kCalls = 40;
  std::vector<std::vector<int32_t>> segs(kThreads);
  std::vector<std::string> want(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    // Thread t reads block t's rows t.. in its own order and count.
    for (int32_t k = 0; k <= t % kBlockSize; ++k) {
      segs[t].insert(segs[t].end(), {t + 2, k, k + 1, k});
    }
    want[t] = Expected(local, segs[t], t % kBlockSize + 1);
  }
  std::vector<int> wrong(kThreads, 0), failed(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kCalls; ++i) {
        absl::StatusOr<std::string> got =
            LoadRows(polling.get(), "threads", segs[t], t % kBlockSize + 1);
        if (!got.ok()) {
          ++failed[t];
        } else if (*got != want[t]) {
          ++wrong[t];
        }
        if (!polling->Ping().ok()) ++failed[t];
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(failed[t], 0) << "thread " << t;
    EXPECT_EQ(wrong[t], 0) << "thread " << t;
  }
  ASSERT_TRUE(owner->DeletePool("threads").ok());
}

// A spin window far shorter than any reply: every call polls briefly, then
// sleeps, and still returns its own reply.
TEST_F(ReplyPollerTest, ASpinShorterThanTheReplyFallsBackToSleeping) {
  std::unique_ptr<KVCacheClient> owner = ConnectOrDie(daemon_->socket_path());
  std::unique_ptr<KVCacheClient> polling = Polling(absl::Nanoseconds(1));
  ASSERT_NE(owner, nullptr);
  ASSERT_NE(polling, nullptr);
  LocalPool local =
      FilledPool("short", owner.get(), polling.get(), polling.get());
  std::vector<int32_t> segs;
  for (int32_t b = 0; b < kNumBlocks; ++b) {
    segs.insert(segs.end(), {b, 1, static_cast<int32_t>(kBlockSize),
                             b * static_cast<int32_t>(kBlockSize - 1)});
  }
  const int64_t rows = kNumBlocks * (kBlockSize - 1);
  for (int i = 0; i < 20; ++i) {
    absl::StatusOr<std::string> got =
        LoadRows(polling.get(), "short", segs, rows);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(*got, Expected(local, segs, rows)) << "call " << i;
  }
  ASSERT_TRUE(owner->DeletePool("short").ok());
}

}  // namespace
}  // namespace kvdepot::testing
