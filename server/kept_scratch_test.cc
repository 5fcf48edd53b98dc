// The request handlers keep their per-thread scratch through ThreadScratch
// (server/thread_scratch.h): small calls leave it counted, calls that grew
// it past a thread's share leave nothing behind. In process, so the test
// reads the daemon's count.
#include <grpc/grpc.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "client/kvdepot_client.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "server/in_process_daemon.h"
#include "server/thread_scratch.h"
#include "tests/e2e_util.h"

namespace kvdepot {
namespace {

using ::kvdepot::testing::Pack;
using ::kvdepot::testing::PoolRequest;

class KeptScratchTest : public ::testing::Test {
 protected:
  // ops_scan_test.cc says why: one gRPC reference for the process.
  static void SetUpTestSuite() { grpc_init(); }

  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Daemon>> d =
        Daemon::Start(InProcessDaemonOptions("scratch"));
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    absl::StatusOr<std::unique_ptr<KVCacheClient>> c =
        ConnectInProcess(*daemon_);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    // Blocks of 4 tokens, 6 of them.
    ASSERT_TRUE(client_->CreatePool(PoolRequest("p", "V41", 0, 4, 6, 1)).ok());
  }

  v1::ConvertTopkRequest SmallTopk() {
    v1::ConvertTopkRequest t;
    t.set_pool("p");
    t.set_batch(1);
    t.set_k(3);
    t.set_topk(Pack({0, 5, 7}));
    t.set_valid_count(Pack({3}));
    t.set_num_tokens(Pack({8}));
    t.set_max_blocks_per_seq(2);
    t.set_block_table(Pack({4, 1}));
    return t;
  }

  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<KVCacheClient> client_;
};

TEST_F(KeptScratchTest, SmallCallsKeepTheirScratchLargeOnesDoNot) {
  const int64_t before = ScratchKeptBytes();
  absl::StatusOr<v1::ConvertTopkResponse> small =
      client_->ConvertTopk(SmallTopk());
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(ReadInt32s(small->slots()), (std::vector<int32_t>{16, 5, 7}));
  const int64_t after_small = ScratchKeptBytes();
  EXPECT_GT(after_small, before);  // the handler's scratch is counted
  EXPECT_LT(after_small, int64_t{1} << 20);

  // 2^24 top-k entries in a buffer, converted in place: the handler's
  // snapshot alone is 64 MiB, its whole scratch past a thread's share.
  constexpr int64_t kEntries = int64_t{1} << 24;
  absl::StatusOr<BufferMapping> buf = client_->AllocateBuffer(kEntries * 4);
  ASSERT_TRUE(buf.ok()) << buf.status();
  auto* topk = reinterpret_cast<int32_t*>(buf->data());
  v1::ConvertTopkRequest big = SmallTopk();
  big.clear_topk();
  big.set_k(kEntries);
  big.set_valid_count(Pack({static_cast<int32_t>(kEntries)}));
  *big.mutable_topk_buffer() = buf->Slice(0, kEntries * 4).slice();
  *big.mutable_slots_buffer() = big.topk_buffer();
  for (int i = 0; i < 3; ++i) {
    for (int64_t e = 0; e < kEntries; ++e) {
      topk[e] = static_cast<int32_t>(e % 9);
    }
    absl::StatusOr<v1::ConvertTopkResponse> r = client_->ConvertTopk(big);
    ASSERT_TRUE(r.ok()) << r.status();
    // Index 8 lies past num_tokens = 8: -1; the rest map through the table.
    EXPECT_EQ(r->invalid_count(), kEntries / 9) << i;
    EXPECT_EQ(topk[0], 16);
    EXPECT_EQ(topk[5], 5);
    EXPECT_EQ(topk[8], -1);
    EXPECT_LE(ScratchKeptBytes(), after_small) << i;
  }
}

}  // namespace
}  // namespace kvdepot
