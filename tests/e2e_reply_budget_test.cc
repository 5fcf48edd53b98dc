// End to end: inline reply bytes are admitted against --max_reply_bytes and
// --max_reply_bytes_per_client until the reply is sent
// (server/reply_scope.h). A client that asks for a 4 MiB inline Load and
// never reads the reply (raw HTTP/2 announcing a stream window of 0) holds
// 4 MiB of the budget for as long as its connection lives;
// meanwhile a call that does not fit gets RESOURCE_EXHAUSTED naming the
// limit, counted under its reason, smaller ones still run; cancelling the
// stuck call gives the bytes back. Replies that are read give theirs back
// as they are sent, so calls in a row never run out. A Store whose fused
// cast_back does not fit is refused before it writes anything.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
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

namespace kvdepot::testing {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int32_t kBlockSize = 64;
constexpr int64_t kRowBytes = 1024;  // V41 loads BF16 rows of 512 values

int64_t Rejections(KVCacheClient& c, const std::string& reason) {
  absl::StatusOr<v1::StatsResponse> s = c.Stats();
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return -1;
  for (const v1::Rejection& r : s->rejections()) {
    if (r.reason() == reason) return r.count();
  }
  return 0;
}

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

// An inline Load sent over a raw HTTP/2 connection of its own that
// announces a stream window of 0 and never reads: the daemon can send the
// reply's headers but none of its data, as from a client that stops
// reading. Closing the connection ends the call. (gRPC 1.51 then keeps
// something of that connection until the daemon exits, where its shutdown
// may wait its 10 s deadline for it: the test can take 10 s longer.)
class UnreadReply {
 public:
  UnreadReply(const std::string& socket, const std::string& session,
              v1::LoadRequest request) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, socket.c_str(), sizeof(addr.sun_path) - 1);
    if (connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      ADD_FAILURE() << "connect: " << std::strerror(errno);
      return;
    }
    std::string out = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    // SETTINGS: INITIAL_WINDOW_SIZE (4) = 0.
    Frame(&out, 0x4, 0, 0, std::string("\x00\x04\x00\x00\x00\x00", 6));
    std::string headers;
    for (const auto& [name, value] :
         std::vector<std::pair<std::string, std::string>>{
             {":method", "POST"},
             {":scheme", "http"},
             {":path", "/kvdepot.v1.KVCache/Load"},
             {":authority", "localhost"},
             {"content-type", "application/grpc"},
             {"te", "trailers"}}) {
      // HPACK: a literal field without indexing, new name, no Huffman.
      headers += '\0';
      headers += static_cast<char>(name.size());
      headers += name;
      headers += static_cast<char>(value.size());
      headers += value;
    }
    Frame(&out, 0x1, 0x4, 1, headers);  // HEADERS, END_HEADERS
    request.set_session_id(session);
    const std::string message = request.SerializeAsString();
    std::string data(5, '\0');  // not compressed, 32-bit big-endian length
    for (int i = 0; i < 4; ++i) {
      data[1 + i] = static_cast<char>(message.size() >> (24 - 8 * i));
    }
    data += message;
    Frame(&out, 0x0, 0x1, 1, data);  // DATA, END_STREAM
    if (write(fd_, out.data(), out.size()) !=
        static_cast<ssize_t>(out.size())) {
      ADD_FAILURE() << "write: " << std::strerror(errno);
    }
  }
  ~UnreadReply() {
    if (fd_ >= 0) close(fd_);
  }

 private:
  static void Frame(std::string* out, uint8_t type, uint8_t flags,
                    uint32_t stream, const std::string& payload) {
    const uint32_t n = static_cast<uint32_t>(payload.size());
    const char header[9] = {static_cast<char>(n >> 16),
                            static_cast<char>(n >> 8),
                            static_cast<char>(n),
                            static_cast<char>(type),
                            static_cast<char>(flags),
                            static_cast<char>(stream >> 24),
                            static_cast<char>(stream >> 16),
                            static_cast<char>(stream >> 8),
                            static_cast<char>(stream)};
    out->append(header, 9);
    *out += payload;
  }

  int fd_ = -1;
};

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

  // Replies that are read are given back as they are sent.
  for (int i = 0; i < 5; ++i) {
    absl::StatusOr<v1::LoadResponse> r = c->Load(four);
    ASSERT_TRUE(r.ok()) << "call " << i << ": " << r.status();
    ASSERT_EQ(static_cast<int64_t>(r->data().size()), 4 * kMiB);
  }
  EXPECT_EQ(Rejections(*c, b.reason), 0);

  {
    const int64_t loads = LoadCalls(*c);
    UnreadReply stuck((*d)->socket_path(), c->session_id(), four);
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

}  // namespace
}  // namespace kvdepot::testing
