// Limits that hold whatever clients do: 100 clients each open a Verify
// stream and never read it (every stream pins a handler thread once its flow
// control window fills). The daemon's threads stay within --max_threads plus
// its fixed ones (the excess calls wait for a thread), and once the clients
// go away a new client is served.
#include <grpcpp/grpcpp.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/kvdepot_client.h"
#include "gtest/gtest.h"
#include "kvdepot/v1/kvdepot.grpc.pb.h"
#include "tests/daemon_process.h"

namespace kvdepot {
namespace {

int Threads(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line)) {
    int n = 0;
    if (line.rfind("Threads:", 0) == 0 &&
        absl::SimpleAtoi(line.substr(8), &n)) {
      return n;
    }
  }
  return -1;
}

TEST(LimitsTest, UnreadStreamsCannotTakeMoreThreadsThanTheQuota) {
  constexpr int kMaxThreads = 16;
  absl::StatusOr<std::unique_ptr<testing::DaemonProcess>> d =
      testing::DaemonProcess::Start(
          {"--backend=cpu", absl::StrCat("--max_threads=", kMaxThreads)});
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string target = "unix:" + (*d)->socket_path();
  const int idle_threads = Threads((*d)->pid());
  ASSERT_GT(idle_threads, 0);
  {
    ClientOptions co;
    co.address = target;
    absl::StatusOr<std::unique_ptr<KVCacheClient>> c =
        KVCacheClient::Connect(co);
    ASSERT_TRUE(c.ok()) << c.status();
    v1::CreatePoolRequest r;  // 1M blocks of 1 token: 1M progress messages
    r.set_name("wide");
    r.set_format("BF16");
    r.set_elements(2);
    r.set_block_size(1);
    r.set_num_blocks(1 << 20);
    r.set_num_layers(1);
    ASSERT_TRUE((*c)->CreatePool(r).ok());
  }

  struct Stream {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::KVCache::Stub> stub;
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::VerifyProgress>> reader;
  };
  std::vector<std::unique_ptr<Stream>> streams;
  int peak = 0;
  for (int i = 0; i < 100; ++i) {
    auto s = std::make_unique<Stream>();
    grpc::ChannelArguments args;
    args.SetInt("kvdepot.test.connection", i);  // one connection each
    s->channel = grpc::CreateCustomChannel(
        target, grpc::InsecureChannelCredentials(), args);
    s->stub = v1::KVCache::NewStub(s->channel);
    v1::VerifyRequest req;
    req.set_pool("wide");
    req.set_progress_every(1);
    s->reader = s->stub->Verify(&s->ctx, req);
    streams.push_back(std::move(s));
    peak = std::max(peak, Threads((*d)->pid()));
  }
  const absl::Time until = absl::Now() + absl::Seconds(3);
  while (absl::Now() < until) {
    peak = std::max(peak, Threads((*d)->pid()));
    absl::SleepFor(absl::Milliseconds(20));
  }
  // The quota counts the server's pollers and handlers; gRPC adds a few
  // executor threads of its own under load (seen: up to 5). Without the
  // quota the 100 streams took 100 handler threads.
  EXPECT_LE(peak, idle_threads + kMaxThreads + 8)
      << "100 unread streams took " << peak << " threads (idle " << idle_threads
      << ", quota " << kMaxThreads << ")";
  // The calls beyond the quota wait for a thread; cancelling them all
  // frees the daemon.
  for (auto& s : streams) {
    s->ctx.TryCancel();
    s->reader->Finish();
  }
  streams.clear();

  ClientOptions co;
  co.address = target;
  absl::StatusOr<std::unique_ptr<KVCacheClient>> c = KVCacheClient::Connect(co);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::Status ping;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  do {
    ping = (*c)->Ping();
  } while (!ping.ok() && absl::Now() < deadline);
  EXPECT_TRUE(ping.ok()) << "the daemon did not recover: " << ping;
}

}  // namespace
}  // namespace kvdepot
