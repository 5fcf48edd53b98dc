// End to end: inline reply bytes are admitted against --max_reply_bytes and
// --max_reply_bytes_per_client until the reply is sent
// (server/reply_scope.h). A client that asks for a 4 MiB inline Load and
// never reads the reply (raw HTTP/2 announcing a stream window of 0) holds
// 4 MiB of the budget for as long as its connection lives;
// meanwhile a call that does not fit gets RESOURCE_EXHAUSTED naming the
// limit, counted under its reason, smaller ones still run; cancelling the
// stuck call gives the bytes back. Replies that are read give theirs back
// as they are sent, so calls in a row never run out. A Store whose fused
// cast_back does not fit is refused before it writes anything. And
// requests that never finish arriving are bounded by --grpc_memory_bytes.
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/kvdepot_client.h"
#include "gtest/gtest.h"
#include "kvdepot/v1/kvdepot.pb.h"
#include "proto/wire.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"
#include "tests/raw_http2.h"

namespace kvdepot::testing {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int32_t kBlockSize = 64;
constexpr int64_t kRowBytes = 1024;  // V41 loads BF16 rows of 512 values

// Load calls the daemon has handled (whatever their status).
int64_t LoadCalls(KVCacheClient& c) {
  absl::StatusOr<v1::StatsResponse> s = c.Stats();
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return -1;
  for (const v1::RpcStats& r : s->rpcs()) {
    if (r.rpc() == "Load") return r.calls();
  }
  return 0;
}

// A Load of `bytes` of inline rows: block 0's rows over and over.
v1::LoadRequest InlineLoad(const std::string& pool, int64_t bytes) {
  const int32_t rows = static_cast<int32_t>(bytes / kRowBytes);
  std::vector<int32_t> segs;
  for (int32_t row = 0; row < rows; row += kBlockSize) {
    segs.insert(segs.end(), {0, 0, kBlockSize, row});
  }
  v1::LoadRequest r;
  r.set_pool(pool);
  *r.mutable_segments() = SegmentsProto(segs, rows);
  *r.mutable_data() = InlineOutput();
  return r;
}

// Sends an inline Load over a raw HTTP/2 connection of its own that
// announces a stream window of 0 and never reads: the daemon can send the
// reply's headers but none of its data, as from a client that stops
// reading. Closing the connection ends the call. (gRPC 1.51 then keeps
// something of that connection until the daemon exits, where its shutdown
// may wait its 10 s deadline for it: the test can take 10 s longer.)
std::optional<RawHttp2> SendUnreadLoad(const std::string& socket,
                                       const std::string& session,
                                       v1::LoadRequest request) {
  absl::StatusOr<RawHttp2> c = RawHttp2::Connect(socket, 0);
  if (!c.ok()) {
    ADD_FAILURE() << c.status();
    return std::nullopt;
  }
  request.set_session_id(session);
  absl::Status s = c->OpenStream(1, "/kvdepot.v1.KVCache/Load");
  if (s.ok()) s = c->SendMessage(1, request.SerializeAsString());
  if (!s.ok()) {
    ADD_FAILURE() << s;
    return std::nullopt;
  }
  return *std::move(c);
}

// Retries `call` until its status satisfies `want` or 10 s pass.
template <typename Call, typename Want>
absl::Status Until(Call call, Want want) {
  const absl::Time end = absl::Now() + absl::Seconds(10);
  absl::Status s = call();
  while (!want(s) && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(20));
    s = call();
  }
  return s;
}

struct Budgets {
  const char* name;
  std::vector<std::string> flags;
  const char* reason;  // the limit a refusal is counted under
  const char* says;    // in its message
};

class ReplyBudgetTest : public ::testing::TestWithParam<Budgets> {};

TEST_P(ReplyBudgetTest, AnUnreadReplyHoldsItsBytesUntilItsCallEnds) {
  const Budgets& b = GetParam();
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
      DaemonProcess::Start(b.flags);
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<KVCacheClient> c = ConnectOrDie((*d)->socket_path());
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->CreatePool(PoolRequest("p", "V41", 0, kBlockSize, 4, 1)).ok());
  const v1::LoadRequest four = InlineLoad("p", 4 * kMiB);
  const v1::LoadRequest one = InlineLoad("p", 1 * kMiB);

  // Replies that are read are given back when their call is done, which
  // can be just after the client has the reply and sends the next call:
  // calls in a row never run out while two of them fit.
  const v1::LoadRequest two = InlineLoad("p", 2 * kMiB);
  for (int i = 0; i < 20; ++i) {
    absl::StatusOr<v1::LoadResponse> r = c->Load(two);
    ASSERT_TRUE(r.ok()) << "call " << i << ": " << r.status();
    ASSERT_EQ(static_cast<int64_t>(r->data().size()), 2 * kMiB);
  }
  EXPECT_EQ(Rejections(*c, b.reason), 0);

  {
    const int64_t loads = LoadCalls(*c);
    std::optional<RawHttp2> stuck =
        SendUnreadLoad((*d)->socket_path(), c->session_id(), four);
    ASSERT_TRUE(stuck.has_value());
    // Once the daemon has run the stuck call (and nothing else runs), it
    // holds 4 of the 6 MiB.
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (LoadCalls(*c) == loads && absl::Now() < end) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_EQ(LoadCalls(*c), loads + 1);
    const absl::Status refused = c->Load(four).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
    EXPECT_TRUE(absl::StrContains(refused.message(), "data.inline_output"))
        << refused;
    EXPECT_TRUE(absl::StrContains(refused.message(), b.says)) << refused;
    EXPECT_GE(Rejections(*c, b.reason), 1);
    // What is left still serves a smaller reply.
    absl::StatusOr<v1::LoadResponse> small = c->Load(one);
    EXPECT_TRUE(small.ok()) << small.status();
  }
  // The call ended with its connection and gave its bytes back.
  const absl::Status again =
      Until([&] { return c->Load(four).status(); },
            [](const absl::Status& s) { return s.ok(); });
  EXPECT_TRUE(again.ok()) << again;
}

INSTANTIATE_TEST_SUITE_P(
    Limits, ReplyBudgetTest,
    ::testing::Values(
        Budgets{"PerClient",
                {"--max_reply_bytes_per_client=6291456"},
                "limit_reply_bytes_per_client",
                "exceeds this client's budget for replies not yet sent"},
        Budgets{"Global",
                {"--max_reply_bytes=6291456", "--max_reply_bytes_per_client=0"},
                "limit_reply_bytes",
                "does not fit the budget for replies not yet sent"}),
    [](const ::testing::TestParamInfo<Budgets>& i) { return i.param.name; });

TEST(ReplyBudgetRefusal, AStoreWhoseCastBackDoesNotFitWritesNothing) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
      DaemonProcess::Start({"--max_reply_bytes_per_client=65536"});
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<KVCacheClient> c = ConnectOrDie((*d)->socket_path());
  ASSERT_NE(c, nullptr);
  absl::StatusOr<v1::PoolInfo> info =
      c->CreatePool(PoolRequest("p", "V41", 0, kBlockSize, 4, 1));
  ASSERT_TRUE(info.ok()) << info.status();
  absl::StatusOr<const PoolMapping*> mapped = c->MapPool("p");
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  const LocalPool local = LocalPool::FromInfo(*info);
  const int64_t pool_bytes = local.layout.total_bytes;
  const std::vector<uint8_t> before((*mapped)->data(),
                                    (*mapped)->data() + pool_bytes);

  // 100 tokens: a cast_back of 100 KiB against a 64 KiB budget.
  std::mt19937 rng(7);
  std::vector<int32_t> slots(100);
  for (int32_t i = 0; i < 100; ++i) slots[i] = i * 2;
  const std::vector<float> kv = RandomKv(100, 512, rng);
  v1::StoreRequest s = StoreRequest("p", 0, slots, v1::INPUT_DTYPE_BF16);
  *s.mutable_kv() = InlineData(Bf16Bytes(kv));
  s.mutable_fused()->mutable_cast_back()->set_inline_output(true);
  absl::StatusOr<v1::StoreResponse> r = c->Store(s);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted)
      << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "fused.cast_back"))
      << r.status();
  EXPECT_EQ(0, std::memcmp((*mapped)->data(), before.data(), before.size()));
  EXPECT_EQ(Rejections(*c, "limit_reply_bytes_per_client"), 1);

  // 50 tokens (50 KiB) fit, and are stored.
  slots.resize(50);
  s = StoreRequest("p", 0, slots, v1::INPUT_DTYPE_BF16);
  *s.mutable_kv() = InlineData(
      Bf16Bytes(std::vector<float>(kv.begin(), kv.begin() + 50 * 512)));
  s.mutable_fused()->mutable_cast_back()->set_inline_output(true);
  r = c->Store(s);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cast_back().size(), size_t{50 * 512 * 2});
  EXPECT_NE(0, std::memcmp((*mapped)->data(), before.data(), before.size()));
}

int64_t RssBytes(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line)) {
    int64_t kb = 0;
    if (line.rfind("VmRSS:", 0) == 0) {
      std::istringstream(line.substr(6)) >> kb;
      return kb * 1024;
    }
  }
  return -1;
}

// Requests that never finish arriving: one raw connection opens 16 Store
// streams, each announcing a 60 MiB message, and sends as much of each as
// the daemon's flow control lets it, then stops. Without a bound the daemon
// grants window for all 960 MiB and holds them (measured with 8 streams:
// 22 -> 505 MB RSS) for as long as the connection lives, and more
// connections hold more;
// with --grpc_memory_bytes = 64 MiB gRPC stops granting window near it.
// What the daemon let the client send is what it holds; its RSS is not
// asserted on (a sanitizer's allocator keeps freed memory too).
TEST(RequestMemory, PartlySentRequestsAreBoundedByGrpcMemory) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
      DaemonProcess::Start({"--grpc_memory_bytes=67108864"});
  ASSERT_TRUE(d.ok()) << d.status();
  const int64_t before = RssBytes((*d)->pid());
  constexpr int64_t kMessage = 60 * kMiB;
  constexpr int kStreams = 16;
  int64_t sent = 0;
  {
    absl::StatusOr<RawHttp2> raw = RawHttp2::Connect((*d)->socket_path(), -1);
    ASSERT_TRUE(raw.ok()) << raw.status();
    for (int i = 0; i < kStreams; ++i) {
      ASSERT_TRUE(raw->OpenStream(1 + 2 * i, "/kvdepot.v1.KVCache/Store").ok());
    }
    absl::Time progress = absl::Now();
    const absl::Time end = absl::Now() + absl::Seconds(20);
    // gRPC may also end the connection under memory pressure (its quota's
    // reclaimer): that bounds what it holds too.
    bool closed = false;
    while (!closed && absl::Now() < end &&
           absl::Now() - progress < absl::Seconds(1)) {
      for (int i = 0; i < kStreams; ++i) {
        absl::StatusOr<int64_t> n = raw->SendBody(1 + 2 * i, kMessage, kMiB);
        if (absl::IsUnavailable(n.status())) {
          closed = true;
          break;
        }
        ASSERT_TRUE(n.ok()) << n.status();
        if (*n > 0) progress = absl::Now();
        sent += *n;
      }
      if (absl::Now() - progress > absl::Milliseconds(5)) {
        absl::SleepFor(absl::Milliseconds(5));
      }
    }
    if (closed) {
      std::cerr << "the daemon closed the raw connection after " << sent
                << " bytes\n";
    }
    EXPECT_LT(sent, 480 * kMiB)
        << "the daemon kept granting window; its RSS grew by "
        << (RssBytes((*d)->pid()) - before) / kMiB << " MiB";
    // Small calls still get through meanwhile.
    std::unique_ptr<KVCacheClient> c = ConnectOrDie((*d)->socket_path());
    ASSERT_NE(c, nullptr);
    EXPECT_TRUE(c->Ping().ok());
  }
  // The connection gone, large requests arrive again.
  std::unique_ptr<KVCacheClient> c = ConnectOrDie((*d)->socket_path());
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(
      c->CreatePool(PoolRequest("p", "V41", 0, kBlockSize, 64, 1)).ok());
  std::vector<int32_t> slots(2048);
  for (int32_t i = 0; i < 2048; ++i) slots[i] = i;
  std::mt19937 rng(3);
  v1::StoreRequest s = StoreRequest("p", 0, slots, v1::INPUT_DTYPE_BF16);
  *s.mutable_kv() = InlineData(Bf16Bytes(RandomKv(2048, 512, rng)));
  absl::StatusOr<v1::StoreResponse> r = c->Store(s);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens_written(), 2048);
}

}  // namespace
}  // namespace kvdepot::testing
