// Inspect and Verify read pools a chunk at a time
// (ServiceOptions::scan_chunk_bytes) and bound Inspect's reply before
// building it. Each chunk size must give what the pool's bytes say: pools
// filled with random bytes through their mapping (impossible scales, NaN
// and Inf included), Verify's checksums against XXH3 of the mapped blocks
// and its issues against CheckRecord on them, Inspect's records likewise;
// one interleaved and one split format, awkward block sizes. Then the
// reply's bounds: the inline limit (INVALID_ARGUMENT before any work) and
// the reply budget (RESOURCE_EXHAUSTED, counted).
#include <grpc/grpc.h>
#include <xxhash.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/kvdepot_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/in_process_daemon.h"
#include "server/record_check.h"
#include "tests/e2e_util.h"

namespace kvdepot {
namespace {

using ::kvdepot::testing::PoolRequest;
using ::kvdepot::testing::Rejections;
using ::testing::HasSubstr;

// A reply counts until its call is done, which may be just after the
// client has it: the budget leaves room for two of the scans' replies.
constexpr int64_t kInlineLimit = int64_t{4} << 20;
constexpr int64_t kReplyPerClient = int64_t{1} << 20;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// The pool layout the daemon reported, rebuilt here.
PoolLayout LayoutOf(const v1::PoolInfo& info) {
  return ::kvdepot::testing::LocalPool::FromInfo(info).layout;
}

// Param: scan_chunk_bytes.
class OpsScanTest : public ::testing::TestWithParam<int64_t> {
 protected:
  // One gRPC library reference for the whole process: otherwise each
  // daemon's destruction, the last reference once the client is gone,
  // shuts gRPC down, and gRPC 1.51 then joins an executor thread that may
  // sit in a 10 s poll (seen here: tests of 15 ms taking 10 s). kvdepotd
  // itself exits in its drain grace (measured: 0.21 s over 6 SIGTERMs).
  static void SetUpTestSuite() { grpc_init(); }

  void SetUp() override {
    DaemonOptions o = InProcessDaemonOptions("scan");
    o.service.scan_chunk_bytes = GetParam();
    o.service.max_inline_bytes = kInlineLimit;
    o.max_reply_bytes_per_client = kReplyPerClient;
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    absl::StatusOr<std::unique_ptr<KVCacheClient>> c =
        ConnectInProcess(*daemon_);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }

  // Creates the pool and fills it with random bytes through its mapping.
  const PoolMapping* RandomPool(const v1::CreatePoolRequest& r, int seed) {
    EXPECT_TRUE(client_->CreatePool(r).ok());
    absl::StatusOr<const PoolMapping*> m = client_->MapPool(r.name());
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return nullptr;
    std::mt19937 rng(seed);
    const v1::PoolLayout& l = (*m)->layout();
    for (int64_t i = 0; i < l.num_layers() * l.layer_stride(); ++i) {
      (*m)->data()[i] = static_cast<uint8_t>(rng());
    }
    // Block 0 of layer 0 stays all zero (a never-written block).
    std::memset((*m)->data(), 0, static_cast<size_t>(l.block_stride()));
    return *m;
  }

  grpc::Status Inspect(const v1::InspectRequest& r, v1::InspectResponse* out) {
    grpc::ClientContext ctx;
    return client_->stub()->Inspect(&ctx, r, out);
  }

  std::vector<v1::VerifyProgress> Verify(const std::string& pool) {
    grpc::ClientContext ctx;
    v1::VerifyRequest r;
    r.set_pool(pool);
    r.set_progress_every(1);
    auto reader = client_->stub()->Verify(&ctx, r);
    std::vector<v1::VerifyProgress> msgs;
    v1::VerifyProgress m;
    while (reader->Read(&m)) msgs.push_back(m);
    grpc::Status s = reader->Finish();
    EXPECT_TRUE(s.ok()) << s.error_message();
    return msgs;
  }

  // Verify and Inspect of every block of `pool` against its mapped bytes.
  void CheckScans(const std::string& pool) {
    absl::StatusOr<const PoolMapping*> m = client_->MapPool(pool);
    ASSERT_TRUE(m.ok()) << m.status();
    const PoolLayout l = LayoutOf((*m)->info());
    std::vector<float> values(static_cast<size_t>(l.format.elements()));
    std::vector<v1::VerifyProgress> msgs = Verify(pool);
    ASSERT_EQ(static_cast<int64_t>(msgs.size()), l.num_layers * l.num_blocks);
    int64_t blocks_with_issues = 0;
    for (int64_t layer = 0; layer < l.num_layers; ++layer) {
      for (int64_t block = 0; block < l.num_blocks; ++block) {
        SCOPED_TRACE(absl::StrCat(pool, " layer ", layer, " block ", block));
        const uint8_t* bytes = (*m)->layer(layer) + l.block_offset(block);
        const v1::VerifyProgress& p = msgs[layer * l.num_blocks + block];
        ASSERT_EQ(p.checksums_size(), 1);
        EXPECT_EQ(p.checksums(0).xxh3(),
                  XXH3_64bits(bytes, static_cast<size_t>(l.block_stride)));
        // The expected issue: the first bad record and the counts.
        int64_t first_bad = -1, bad_scales = 0, nan = 0, inf = 0;
        v1::InspectRequest ir;
        ir.set_pool(pool);
        ir.set_layer(layer);
        ir.set_block(block);
        ir.set_all_values(true);
        v1::InspectResponse out;
        grpc::Status s = Inspect(ir, &out);
        ASSERT_TRUE(s.ok()) << s.error_message();
        ASSERT_EQ(out.records_size(), l.block_size);
        for (int64_t t = 0; t < l.block_size; ++t) {
          const RecordHealth h = CheckRecord(l, bytes, t, values.data());
          if (!h.ok() && first_bad < 0) first_bad = t;
          bad_scales += h.bad_scales;
          nan += h.nan_values;
          inf += h.inf_values;
          const v1::InspectRecord& rec = out.records(static_cast<int>(t));
          EXPECT_EQ(rec.slot(), block * l.block_size + t);
          EXPECT_EQ(rec.nan_count(), h.nan_values);
          EXPECT_EQ(rec.inf_count(), h.inf_values);
          EXPECT_EQ(rec.bad_scales(), h.bad_scales);
          EXPECT_EQ(rec.all_zero(), h.all_zero);
          std::string hex;
          const uint8_t* sf = bytes + l.scale_offset(0, t);
          for (int i = 0; i < l.format.sf_bytes(); ++i) {
            absl::StrAppendFormat(&hex, "%02x", sf[i]);
          }
          EXPECT_EQ(rec.scale_hex(), hex);
          ASSERT_EQ(rec.values_size(), l.format.elements());
          for (int i = 0; i < l.format.elements(); ++i) {
            ASSERT_EQ(Bits(rec.values(i)), Bits(values[i]))
                << "record " << t << " value " << i;
          }
        }
        if (first_bad < 0) {
          EXPECT_EQ(p.issues_size(), 0);
          continue;
        }
        ++blocks_with_issues;
        ASSERT_EQ(p.issues_size(), 1);
        EXPECT_EQ(p.issues(0).slot(), block * l.block_size + first_bad);
        EXPECT_EQ(p.issues(0).bad_scales(), bad_scales);
        EXPECT_EQ(p.issues(0).nan_values(), nan);
        EXPECT_EQ(p.issues(0).inf_values(), inf);
      }
    }
    EXPECT_EQ(msgs.back().blocks_with_issues(), blocks_with_issues);
    std::vector<uint64_t> sums;
    for (const v1::VerifyProgress& p : msgs)
      sums.push_back(p.checksums(0).xxh3());
    EXPECT_EQ(msgs.back().pool_xxh3(),
              XXH3_64bits(sums.data(), sums.size() * sizeof(uint64_t)));
    EXPECT_GT(blocks_with_issues, 0);  // random bytes: impossible scales
  }

  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<KVCacheClient> client_;
};

TEST_P(OpsScanTest, InterleavedRecordsMatchThePoolBytes) {
  // V41: 656-byte records back to back, blocks of 7 and of 133.
  ASSERT_NE(RandomPool(PoolRequest("v7", "V41", 0, 7, 3, 2), 11), nullptr);
  CheckScans("v7");
  ASSERT_NE(RandomPool(PoolRequest("v133", "V41", 0, 133, 2, 1), 12), nullptr);
  CheckScans("v133");
}

TEST_P(OpsScanTest, SplitRecordsMatchThePoolBytes) {
  // Data rows, then scale rows: blocks of 1 and 133.
  ASSERT_NE(RandomPool(PoolRequest("i1", "FP8_FP32SF_INDEX", 0, 1, 5, 2), 13),
            nullptr);
  CheckScans("i1");
  ASSERT_NE(RandomPool(PoolRequest("i133", "MXFP8_INDEX", 0, 133, 2, 2), 14),
            nullptr);
  CheckScans("i133");
}

TEST_P(OpsScanTest, InspectSlotReadsOneRecord) {
  const PoolMapping* m =
      RandomPool(PoolRequest("s", "FP8_FP32SF_INDEX", 0, 133, 2, 1), 15);
  ASSERT_NE(m, nullptr);
  const PoolLayout l = LayoutOf(m->info());
  std::vector<float> values(static_cast<size_t>(l.format.elements()));
  for (int64_t slot : {int64_t{0}, int64_t{132}, int64_t{133}, int64_t{265}}) {
    v1::InspectRequest r;
    r.set_pool("s");
    r.set_slot(slot);
    r.set_max_values(3);
    v1::InspectResponse out;
    ASSERT_TRUE(Inspect(r, &out).ok());
    ASSERT_EQ(out.records_size(), 1);
    const uint8_t* bytes = m->layer(0) + l.block_offset(slot / l.block_size);
    const RecordHealth h =
        CheckRecord(l, bytes, slot % l.block_size, values.data());
    EXPECT_EQ(out.records(0).slot(), slot);
    EXPECT_EQ(out.records(0).bad_scales(), h.bad_scales);
    ASSERT_EQ(out.records(0).values_size(), 3);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(Bits(out.records(0).values(i)), Bits(values[i]));
    }
  }
}

TEST_P(OpsScanTest, InspectReplyIsBoundedBeforeItIsBuilt) {
  // BF16(1024): 2 KiB records; a block of 1200 with every value would be a
  // reply of ~5.2 MB, over the 4 MiB inline limit.
  ASSERT_TRUE(
      client_->CreatePool(PoolRequest("bf", "BF16", 1024, 1200, 2, 1)).ok());
  v1::InspectRequest r;
  r.set_pool("bf");
  r.set_block(1);
  r.set_all_values(true);
  v1::InspectResponse out;
  grpc::Status s = Inspect(r, &out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(),
              HasSubstr("block: 1200 records of 1024 values each make a reply "
                        "of up to "));
  EXPECT_THAT(s.error_message(), HasSubstr("over the inline limit of 4194304"));
  EXPECT_EQ(out.records_size(), 0);
  // The same block with a few values per record, and one slot with all.
  r.set_all_values(false);
  r.set_max_values(8);
  ASSERT_TRUE(Inspect(r, &out).ok());
  EXPECT_EQ(out.records_size(), 1200);
  v1::InspectRequest one;
  one.set_pool("bf");
  one.set_slot(2399);
  one.set_all_values(true);
  ASSERT_TRUE(Inspect(one, &out).ok());
  ASSERT_EQ(out.records_size(), 1);
  EXPECT_EQ(out.records(0).values_size(), 1024);
  // What the reply takes stays within what was reserved for it (the
  // client's parsed copy, as the daemon's is built: exact capacities).
  r.set_max_values(32);
  ASSERT_TRUE(Inspect(r, &out).ok());
  EXPECT_LE(static_cast<int64_t>(out.SpaceUsedLong()),
            1024 + 1200 * (256 + 4 * 32));
  EXPECT_LE(static_cast<int64_t>(out.ByteSizeLong()),
            1024 + 1200 * (256 + 4 * 32));
}

TEST_P(OpsScanTest, InspectReplyCountsAgainstTheReplyBudget) {
  // 400 records of 1024 values: ~1.7 MB, under the inline limit but over
  // the client's 1 MiB of reply budget.
  ASSERT_TRUE(
      client_->CreatePool(PoolRequest("bf", "BF16", 1024, 400, 1, 1)).ok());
  v1::InspectRequest r;
  r.set_pool("bf");
  r.set_block(0);
  r.set_all_values(true);
  v1::InspectResponse out;
  grpc::Status s = Inspect(r, &out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("Inspect reply"));
  EXPECT_EQ(out.records_size(), 0);
  EXPECT_EQ(Rejections(*client_, "limit_reply_bytes_per_client"), 1);
  r.set_all_values(false);
  r.set_max_values(64);
  ASSERT_TRUE(Inspect(r, &out).ok());
  EXPECT_EQ(out.records_size(), 400);
}

// Independent of the chunk size: run at the default only.
using VerifyBoundTest = OpsScanTest;

TEST_P(VerifyBoundTest, MessagesStayBounded) {
  // 900000 blocks of one 4-byte record: the daemon's choice of 1/50 of
  // them per message would be 18000, capped at 16384.
  ASSERT_TRUE(
      client_->CreatePool(PoolRequest("many", "BF16", 2, 1, 900000, 1)).ok());
  grpc::ClientContext ctx;
  v1::VerifyRequest r;
  r.set_pool("many");
  auto reader = client_->stub()->Verify(&ctx, r);
  v1::VerifyProgress m;
  int64_t blocks = 0, messages = 0;
  while (reader->Read(&m)) {
    EXPECT_LE(m.checksums_size(), 16384);
    blocks += m.checksums_size();
    ++messages;
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(blocks, 900000);
  EXPECT_EQ(messages, 55);  // 54 full messages and the rest
  EXPECT_EQ(m.blocks_done(), 900000);
}

// 4 MiB (every block in one copy), 1500 bytes (a few records per copy),
// 1 byte (one record per copy; hashing a byte at a time).
INSTANTIATE_TEST_SUITE_P(ChunkBytes, OpsScanTest,
                         ::testing::Values(int64_t{4} << 20, 1500, 1));
INSTANTIATE_TEST_SUITE_P(DefaultChunk, VerifyBoundTest,
                         ::testing::Values(int64_t{4} << 20));

TEST(OpsScanOptionsTest, ChunkBytesMustBePositive) {
  for (int64_t bad : {int64_t{0}, int64_t{-4096}}) {
    DaemonOptions o;
    o.listen = "127.0.0.1:0";
    o.backend = "cpu";
    o.service.scan_chunk_bytes = bad;
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(d.status().message(),
                HasSubstr(absl::StrCat("scan_chunk_bytes = ", bad)));
  }
}

}  // namespace
}  // namespace kvdepot
