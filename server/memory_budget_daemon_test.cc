// The memory budget wired into the daemon (SPEC §11): pools, allocated and
// imported buffers are admitted at creation, RESOURCE_EXHAUSTED says what
// is available, deleting gives the bytes back, one client is capped, and
// the default total comes from the cgroup files the daemon is pointed at.
#include <stdlib.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/kvdepot_client.h"
#include "common/memfd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/daemon.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

std::string TempSocket(const char* tag) {
  std::string tmpl = absl::StrCat("/tmp/kvdepot-mb-", tag, "-XXXXXX");
  if (mkdtemp(tmpl.data()) == nullptr) return "";
  return tmpl + "/kv.sock";
}

// BF16(64) with 16-token blocks: 2 KiB a block, one layer.
v1::CreatePoolRequest PoolOf(const std::string& name, int64_t blocks) {
  v1::CreatePoolRequest r;
  r.set_name(name);
  r.set_format("BF16");
  r.set_elements(64);
  r.set_block_size(16);
  r.set_num_blocks(blocks);
  r.set_num_layers(1);
  return r;
}

std::unique_ptr<KVCacheClient> ConnectTo(const Daemon& d) {
  ClientOptions co;
  co.address = d.target();
  absl::StatusOr<std::unique_ptr<KVCacheClient>> c = KVCacheClient::Connect(co);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

TEST(MemoryBudgetDaemonTest, PoolsBeyondTheBudgetFailAndDeleteFreesIt) {
  DaemonOptions o;
  o.listen = TempSocket("pools");
  o.backend = "cpu";
  o.memory_budget_bytes = 1 << 20;
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<KVCacheClient> c = ConnectTo(**d);
  ASSERT_NE(c, nullptr);
  absl::StatusOr<v1::PoolInfo> a = c->CreatePool(PoolOf("a", 300));
  ASSERT_TRUE(a.ok()) << a.status();
  const int64_t a_bytes = a->layout().total_bytes();
  ASSERT_GT(a_bytes, (1 << 20) / 2);
  absl::StatusOr<v1::PoolInfo> b = c->CreatePool(PoolOf("b", 300));
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(b.status().message()),
              HasSubstr(absl::StrCat("pool \"b\": ")));
  EXPECT_THAT(std::string(b.status().message()),
              HasSubstr(absl::StrCat(
                  "(", a_bytes, " bytes) does not fit the memory budget")));
  EXPECT_THAT(std::string(b.status().message()),
              HasSubstr("of 1.0 MiB available (--memory_budget_bytes)"));
  absl::StatusOr<v1::StatsResponse> stats = c->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->memory_budget_bytes(), 1 << 20);
  EXPECT_EQ(stats->memory_budget_used_bytes(), a_bytes);
  EXPECT_EQ(stats->memory_budget_source(), "--memory_budget_bytes");
  EXPECT_EQ(stats->pools(), 1);  // the refused pool left nothing behind

  ASSERT_TRUE(c->DeletePool("a").ok());
  stats = c->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->memory_budget_used_bytes(), 0);
  b = c->CreatePool(PoolOf("b", 300));
  EXPECT_TRUE(b.ok()) << b.status();
  c.reset();
  (*d)->Shutdown();
}

TEST(MemoryBudgetDaemonTest, BuffersOwnAndImportedAreCappedPerClient) {
  DaemonOptions o;
  o.listen = TempSocket("bufs");
  o.backend = "cpu";
  o.memory_budget_bytes = 64 << 20;
  o.memory_budget_per_client_bytes = 1 << 20;
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<KVCacheClient> c = ConnectTo(**d);
  ASSERT_NE(c, nullptr);
  absl::StatusOr<BufferMapping> own = c->AllocateBuffer(768 << 10);
  ASSERT_TRUE(own.ok()) << own.status();
  // Imported memory counts too: 768 KiB + 512 KiB > 1 MiB for this uid.
  absl::StatusOr<MemfdRegion> region = MemfdRegion::Create("imp", 512 << 10);
  ASSERT_TRUE(region.ok()) << region.status();
  absl::StatusOr<v1::BufferInfo> imported = c->ImportBuffer(*region);
  EXPECT_EQ(imported.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(imported.status().message()),
              HasSubstr("import_buffer.size: 512.0 KiB (524288 bytes) exceeds "
                        "this client's memory budget: 256.0 KiB of 1.0 MiB "
                        "left"));
  // A second session of the same uid is the same client.
  std::unique_ptr<KVCacheClient> c2 = ConnectTo(**d);
  ASSERT_NE(c2, nullptr);
  absl::StatusOr<BufferMapping> more = c2->AllocateBuffer(512 << 10);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(more.status().message()),
              HasSubstr("allocate_buffer.size"));
  // Releasing gives the bytes back; then the import fits.
  ASSERT_TRUE(c->ReleaseBuffer(own->id()).ok());
  imported = c->ImportBuffer(*region);
  EXPECT_TRUE(imported.ok()) << imported.status();
  absl::StatusOr<v1::StatsResponse> stats = c->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->memory_budget_used_bytes(), 512 << 10);
  // A closed session gives back its buffers' bytes (the daemon learns of
  // the closed companion connection asynchronously: wait with a deadline).
  c.reset();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    stats = c2->Stats();
    ASSERT_TRUE(stats.ok());
  } while (stats->memory_budget_used_bytes() != 0 && absl::Now() < deadline);
  EXPECT_EQ(stats->memory_budget_used_bytes(), 0);
  c2.reset();
  (*d)->Shutdown();
}

TEST(MemoryBudgetDaemonTest, DefaultTotalComesFromTheCgroupFiles) {
  const std::string root = absl::StrCat(std::getenv("TEST_TMPDIR"), "/sys");
  std::filesystem::create_directories(root + "/cgroup/pod/c");
  std::ofstream(root + "/cgroup.self") << "0::/pod/c\n";
  std::ofstream(root + "/cgroup/pod/memory.max") << (40 << 20) << "\n";
  std::ofstream(root + "/cgroup/pod/memory.current") << (8 << 20) << "\n";
  std::ofstream(root + "/cgroup/pod/c/memory.max") << "max\n";
  std::ofstream(root + "/cgroup/pod/c/memory.current") << "0\n";
  std::ofstream(root + "/meminfo") << "MemAvailable: 99999999 kB\n";
  DaemonOptions o;
  o.listen = TempSocket("cg");
  o.backend = "cpu";
  o.memory_files.cgroup_root = root + "/cgroup";
  o.memory_files.self_cgroup = root + "/cgroup.self";
  o.memory_files.meminfo = root + "/meminfo";
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<KVCacheClient> c = ConnectTo(**d);
  ASSERT_NE(c, nullptr);
  absl::StatusOr<v1::StatsResponse> stats = c->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->memory_budget_bytes(), 32 << 20);
  EXPECT_THAT(stats->memory_budget_source(), HasSubstr("cgroup v2"));
  // 40 MiB of pools do not fit the 32 MiB the cgroup leaves.
  absl::StatusOr<v1::PoolInfo> big = c->CreatePool(PoolOf("big", 20 << 10));
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(big.status().message()),
              HasSubstr("32.0 MiB of 32.0 MiB available (cgroup v2"));
  c.reset();
  (*d)->Shutdown();
}

}  // namespace
}  // namespace kvdepot
