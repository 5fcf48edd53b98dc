#include "server/serving_policy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

namespace kvdepot {
namespace {

// inline_max_rows = 1024 (the default): index calls stay inline up to
// 16384 entries per array read, Load by sequences up to 64 table entries,
// BuildPlan up to 4096.
constexpr OffloadPolicy kCpu{1024, false};
constexpr int64_t kIndexEntries = 1024 * 16;

std::string Int32s(int64_t n) { return std::string(4 * n, '\0'); }

TEST(OffloadPolicyTest, ConvertTopkCountsEveryArrayItReadsWhole) {
  v1::ConvertTopkRequest r;
  r.set_batch(4);
  r.set_k(kIndexEntries / 4);
  r.set_max_blocks_per_seq(kIndexEntries / 4);
  EXPECT_FALSE(kCpu.Offload(r));
  r.set_k(kIndexEntries / 4 + 1);  // top-k entries
  EXPECT_TRUE(kCpu.Offload(r));
  r.set_k(1);
  r.set_max_blocks_per_seq(kIndexEntries / 4 + 1);  // the block table
  EXPECT_TRUE(kCpu.Offload(r));
  r.set_max_blocks_per_seq(1);
  r.set_k(0);
  r.set_batch(kIndexEntries + 1);  // valid_count, num_tokens
  EXPECT_TRUE(kCpu.Offload(r));
  r.set_batch(kIndexEntries);
  EXPECT_FALSE(kCpu.Offload(r));
  // Negative sizes are refused by the handler at once: inline.
  r.set_batch(-5);
  r.set_k(-1 << 30);
  EXPECT_FALSE(kCpu.Offload(r));
}

TEST(OffloadPolicyTest, SwaDecodeIndexCountsQueriesAndOutput) {
  v1::SwaDecodeIndexRequest r;
  r.set_num_queries(kIndexEntries / 3);
  r.set_window(3);
  EXPECT_FALSE(kCpu.Offload(r));
  r.set_window(4);  // the output
  EXPECT_TRUE(kCpu.Offload(r));
  r.set_window(0);  // refused later, after the queries are decoded
  r.set_num_queries(kIndexEntries / 3 + 1);
  EXPECT_TRUE(kCpu.Offload(r));
}

TEST(OffloadPolicyTest, SequencePlansCountTheirTableAndLengths) {
  v1::BuildPlanRequest b;
  b.mutable_sequences()->set_block_table(Int32s(4096));
  b.mutable_sequences()->set_seqlen_k(Int32s(4096));
  EXPECT_FALSE(kCpu.Offload(b));
  b.mutable_sequences()->set_seqlen_k(Int32s(4097));
  EXPECT_TRUE(kCpu.Offload(b));
  b.mutable_sequences()->set_seqlen_k(Int32s(1));
  b.mutable_sequences()->set_block_table(Int32s(4097));
  EXPECT_TRUE(kCpu.Offload(b));

  v1::LoadRequest l;
  *l.mutable_sequences() = b.sequences();
  l.mutable_sequences()->set_block_table(Int32s(64));
  EXPECT_FALSE(kCpu.Offload(l));
  l.mutable_sequences()->set_seqlen_k(Int32s(65));
  EXPECT_TRUE(kCpu.Offload(l));
  l.mutable_segments()->set_total_k(1024);
  EXPECT_FALSE(kCpu.Offload(l));
  l.mutable_segments()->set_total_k(1025);
  EXPECT_TRUE(kCpu.Offload(l));
}

TEST(OffloadPolicyTest, OnADeviceOnlyCallsThatCannotWaitStay) {
  constexpr OffloadPolicy gpu{1024, true};
  v1::ConvertTopkRequest t;
  t.set_batch(1);
  t.set_k(1);
  EXPECT_TRUE(gpu.Offload(t));  // an inline reply waits for the GPU
  t.set_record_event(true);
  t.mutable_slots_buffer();
  EXPECT_FALSE(gpu.Offload(t));
  t.set_wait_event_ipc_handle("e");
  EXPECT_TRUE(gpu.Offload(t));

  v1::StoreRequest s;
  s.set_num_tokens(1);
  s.mutable_kv()->mutable_slice();
  EXPECT_TRUE(gpu.Offload(s));
  s.set_record_event(true);
  EXPECT_FALSE(gpu.Offload(s));
  s.mutable_kv()->set_inline_data("x");  // host data: copied, then waited
  EXPECT_TRUE(gpu.Offload(s));
  EXPECT_FALSE(kCpu.Offload(s));
  s.set_num_tokens(1025);
  EXPECT_TRUE(kCpu.Offload(s));
}

}  // namespace
}  // namespace kvdepot
