// The records of full PrefillLoads and the consumer check: a consumer
// finds exactly its (buffer, offset), every field that decides the
// compressed rows is compared (each one changed in turn must fail, naming
// it), overlapping loads and released buffers drop records, and the
// bounds hold.
#include "server/prefill_sources.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvdepot {
namespace {

std::shared_ptr<Buffer> NewBuffer(uint64_t id) {
  auto b = std::make_shared<Buffer>();
  b->id = id;
  return b;
}

std::shared_ptr<Pool> NewPool(const std::string& name) {
  auto p = std::make_shared<Pool>();
  p->name = name;
  return p;
}

PrefillSourceKey Key(const std::shared_ptr<Pool>& pool) {
  PrefillSourceKey k;
  k.main_pool = pool;
  k.main_layer = 1;
  k.window = 8;
  k.ratio = 4;
  k.seqlen_k = {100, 37};
  k.seqlen_q = {10, 37};
  k.swa_valid_start = {0, 5};
  k.layout.window = 8;
  k.layout.swa_history_rows = 16;
  k.layout.chunk_rows = 47;
  k.layout.compressed_rows = 25 + 9;
  k.layout.main_kv_offset = 63;
  k.layout.total_rows = 97;
  return k;
}

absl::Status Check(const PrefillSource& s, const std::shared_ptr<Pool>& pool,
                   const PrefillSourceKey& c) {
  return CheckConsumer(s, pool, c.main_layer, c.window, c.ratio, c.seqlen_k,
                       c.seqlen_q, c.swa_valid_start, c.layout);
}

TEST(PrefillSourcesTest, ConsumerFindsItsSliceAndMatches) {
  PrefillSources sources;
  auto buf = NewBuffer(7);
  auto pool = NewPool("main");
  sources.Record(buf, 4096, 1000, Key(pool));
  EXPECT_EQ(sources.size(), 1);
  EXPECT_EQ(sources.array_bytes(), 6 * 4);
  absl::StatusOr<std::shared_ptr<const PrefillSource>> s =
      sources.Find(7, 4096);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(Check(**s, pool, Key(pool)).ok());
  // An empty swa_valid_start means zeros: it matches a source of zeros.
  PrefillSourceKey zeros = Key(pool);
  zeros.swa_valid_start = {0, 0};
  sources.Record(buf, 0, 1000, zeros);
  s = sources.Find(7, 0);
  ASSERT_TRUE(s.ok()) << s.status();
  PrefillSourceKey empty = zeros;
  empty.swa_valid_start.clear();
  EXPECT_TRUE(Check(**s, pool, empty).ok());
  EXPECT_FALSE(Check(**s, pool, Key(pool)).ok());
}

TEST(PrefillSourcesTest, MissingSliceIsFailedPrecondition) {
  PrefillSources sources;
  auto buf = NewBuffer(7);
  sources.Record(buf, 4096, 1000, Key(NewPool("main")));
  for (auto [id, offset] :
       {std::pair<uint64_t, int64_t>{7, 0}, {7, 4097}, {8, 4096}}) {
    absl::StatusOr<std::shared_ptr<const PrefillSource>> s =
        sources.Find(id, offset);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(s.status().message().find("no full PrefillLoad"),
              std::string::npos)
        << s.status();
  }
}

TEST(PrefillSourcesTest, EveryFieldIsCompared) {
  PrefillSources sources;
  auto buf = NewBuffer(3);
  auto pool = NewPool("main");
  sources.Record(buf, 0, 1000, Key(pool));
  const std::shared_ptr<const PrefillSource> s = *sources.Find(3, 0);
  struct Case {
    std::string field;
    void (*change)(PrefillSourceKey&);
  };
  const Case cases[] = {
      {"main_layer", [](PrefillSourceKey& k) { k.main_layer = 0; }},
      {"window", [](PrefillSourceKey& k) { k.window = 7; }},
      {"compress_ratio", [](PrefillSourceKey& k) { k.ratio = 2; }},
      {"num_seqs", [](PrefillSourceKey& k) { k.seqlen_k.push_back(1); }},
      {"seqlen_k[1]", [](PrefillSourceKey& k) { k.seqlen_k[1] = 38; }},
      {"seqlen_q[0]", [](PrefillSourceKey& k) { k.seqlen_q[0] = 11; }},
      {"swa_valid_start[1]",
       [](PrefillSourceKey& k) { k.swa_valid_start[1] = 0; }},
      {"main_kv_offset/total_rows",
       [](PrefillSourceKey& k) { k.layout.total_rows = 98; }},
  };
  for (const Case& c : cases) {
    PrefillSourceKey k = Key(pool);
    c.change(k);
    const absl::Status st = Check(*s, pool, k);
    ASSERT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << c.field;
    EXPECT_NE(st.message().find(c.field + " = "), std::string::npos)
        << c.field << ": " << st;
  }
  // Another pool object of the same name (deleted and re-created).
  const absl::Status other = Check(*s, NewPool("main"), Key(pool));
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(other.message().find("main_pool"), std::string::npos) << other;
  // The source's pool deleted.
  pool.reset();
  auto again = NewPool("main");
  const absl::Status gone = Check(*s, again, Key(again));
  EXPECT_NE(gone.message().find("since deleted"), std::string::npos) << gone;
}

TEST(PrefillSourcesTest, OverlappingLoadsAndReleasedBuffersDropRecords) {
  PrefillSources sources;
  auto buf = NewBuffer(1);
  auto pool = NewPool("main");
  sources.Record(buf, 0, 100, Key(pool));
  sources.Record(buf, 100, 100, Key(pool));  // touching: both stay
  EXPECT_TRUE(sources.Find(1, 0).ok());
  EXPECT_TRUE(sources.Find(1, 100).ok());
  sources.Forget(1, 99, 1);  // overlaps the first only
  EXPECT_FALSE(sources.Find(1, 0).ok());
  EXPECT_TRUE(sources.Find(1, 100).ok());
  sources.Record(buf, 150, 100, Key(pool));  // replaces [100, 200)
  EXPECT_FALSE(sources.Find(1, 100).ok());
  EXPECT_TRUE(sources.Find(1, 150).ok());
  EXPECT_EQ(sources.size(), 1);
  buf.reset();  // released: its record is not found any more
  EXPECT_FALSE(sources.Find(1, 150).ok());
}

TEST(PrefillSourcesTest, BoundsPerBufferAndInAll) {
  PrefillSources sources;
  auto buf = NewBuffer(1);
  auto pool = NewPool("main");
  for (int i = 0; i <= kMaxSourcesPerBuffer; ++i) {
    sources.Record(buf, i * 1000, 1000, Key(pool));
  }
  EXPECT_EQ(sources.size(), kMaxSourcesPerBuffer);
  EXPECT_FALSE(sources.Find(1, 0).ok()) << "the oldest goes first";
  EXPECT_TRUE(sources.Find(1, kMaxSourcesPerBuffer * 1000).ok());
  // Large records: the total stays within kMaxSourceBytes.
  PrefillSourceKey big = Key(pool);
  const size_t n = static_cast<size_t>(kMaxSourceBytes / 12 / 3);
  big.seqlen_k.assign(n, 1);
  big.seqlen_q.assign(n, 1);
  big.swa_valid_start.assign(n, 0);
  std::vector<std::shared_ptr<Buffer>> bufs;
  for (uint64_t id = 10; id < 16; ++id) {
    bufs.push_back(NewBuffer(id));
    sources.Record(bufs.back(), 0, 1000, big);
    EXPECT_LE(sources.array_bytes(), kMaxSourceBytes);
  }
  EXPECT_TRUE(sources.Find(15, 0).ok()) << "the newest is kept";
  EXPECT_FALSE(sources.Find(10, 0).ok()) << "the oldest went";
  // A record larger than the bound is never kept.
  PrefillSourceKey huge = Key(pool);
  huge.seqlen_k.assign(static_cast<size_t>(kMaxSourceBytes / 4) + 1, 1);
  auto b2 = NewBuffer(99);
  sources.Record(b2, 0, 1000, huge);
  EXPECT_FALSE(sources.Find(99, 0).ok());
  EXPECT_LE(sources.array_bytes(), kMaxSourceBytes);
}

}  // namespace
}  // namespace kvdepot
