// End to end, concurrency: 8 clients x 1000 mixed requests (stores through
// buffers and inline bytes, loads by segments and by block tables, plans,
// index ops, pings, stats) against one daemon, with no error; afterwards
// every client's blocks hold exactly what the reference computes.
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/daemon_process.h"
#include "tests/e2e_util.h"

namespace kvdepot::testing {
namespace {

constexpr int kClients = 8;
constexpr int kRequests = 1000;
constexpr int64_t kBlockSize = 7;
constexpr int64_t kBlocksPerClient = 4;
constexpr int64_t kElements = 512;

TEST(ConcurrencyTest, EightClientsThousandMixedRequests) {
  absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start();
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<KVCacheClient> admin = ConnectOrDie((*d)->socket_path());
  ASSERT_NE(admin, nullptr);
  absl::StatusOr<v1::PoolInfo> info = admin->CreatePool(PoolRequest(
      "shared", "V41", 0, kBlockSize, kClients * kBlocksPerClient, 1));
  ASSERT_TRUE(info.ok()) << info.status();
  // Per client: the last tokens written to each of its slots.
  std::vector<std::vector<float>> last(kClients);
  std::vector<std::string> failures(kClients);

  std::vector<std::thread> threads;
  for (int ci = 0; ci < kClients; ++ci) {
    threads.emplace_back([&, ci] {
      std::unique_ptr<KVCacheClient> c = ConnectOrDie((*d)->socket_path());
      if (c == nullptr) return;
      std::mt19937 rng(301 + ci);
      const int32_t first_block = static_cast<int32_t>(ci * kBlocksPerClient);
      const int32_t first_slot = static_cast<int32_t>(first_block * kBlockSize);
      const int32_t slots_per_client =
          static_cast<int32_t>(kBlocksPerClient * kBlockSize);
      std::vector<float>& mine = last[ci];
      mine.assign(static_cast<size_t>(slots_per_client * kElements), 0.0f);
      absl::StatusOr<BufferMapping> buf = c->AllocateBuffer(1 << 20);
      if (!buf.ok()) {
        failures[ci] = buf.status().ToString();
        return;
      }
      std::uniform_int_distribution<int> kind(0, 7);
      std::uniform_int_distribution<int32_t> slot(0, slots_per_client - 1);
      for (int i = 0; i < kRequests; ++i) {
        absl::Status s;
        switch (kind(rng)) {
          case 0:
          case 1: {  // store 3 distinct slots, buffer or inline
            std::vector<int32_t> local = {slot(rng), slot(rng), slot(rng)};
            if (local[1] == local[0]) local[1] = -1;
            if (local[2] == local[0] || local[2] == local[1]) local[2] = -1;
            const std::vector<float> kv = RandomKv(3, kElements, rng);
            std::vector<int32_t> global;
            for (int32_t l : local)
              global.push_back(l < 0 ? -1 : first_slot + l);
            v1::StoreRequest r =
                StoreRequest("shared", 0, global, v1::INPUT_DTYPE_FP32);
            if (i % 2 == 0) {
              std::memcpy(buf->data(), kv.data(), kv.size() * 4);
              *r.mutable_kv() =
                  buf->Slice(0, static_cast<int64_t>(kv.size()) * 4);
            } else {
              *r.mutable_kv() = InlineData(Fp32Bytes(kv));
            }
            s = c->Store(r).status();
            for (int t = 0; t < 3; ++t) {
              if (local[t] < 0) continue;
              std::memcpy(&mine[local[t] * kElements], &kv[t * kElements],
                          kElements * 4);
            }
            break;
          }
          case 2: {  // load own blocks by segments into the buffer
            std::vector<int32_t> segs;
            for (int32_t b = 0; b < kBlocksPerClient; ++b) {
              segs.insert(segs.end(),
                          {first_block + b, 0, static_cast<int32_t>(kBlockSize),
                           static_cast<int32_t>(b * kBlockSize)});
            }
            v1::LoadRequest r;
            r.set_pool("shared");
            *r.mutable_segments() = SegmentsProto(segs, slots_per_client);
            *r.mutable_data() =
                buf->Slice(4096, slots_per_client * kElements * 2);
            s = c->Load(r).status();
            break;
          }
          case 3: {  // load by block table, inline
            v1::LoadRequest r;
            r.set_pool("shared");
            v1::SequencePlan* sp = r.mutable_sequences();
            sp->set_num_seqs(1);
            sp->set_seqlen_k(
                Pack({static_cast<int32_t>(slots_per_client - 2)}));
            sp->set_max_blocks_per_seq(kBlocksPerClient);
            std::vector<int32_t> table;
            for (int32_t b = 0; b < kBlocksPerClient; ++b)
              table.push_back(first_block + b);
            sp->set_block_table(Pack(table));
            *r.mutable_data() = InlineOutput();
            s = c->Load(r).status();
            break;
          }
          case 4: {
            v1::SwaDecodeIndexRequest r;
            r.set_pool("shared");
            r.set_window(5);
            r.set_num_queries(2);
            r.set_queries(Pack({first_block, 3, 5, first_block + 1, 9, 2}));
            s = c->SwaDecodeIndex(r).status();
            break;
          }
          case 5:
            s = c->Stats().status();
            break;
          default:
            s = c->Ping();
            break;
        }
        if (!s.ok()) {
          failures[ci] = absl::StrCat("request ", i, ": ", s.ToString());
          return;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int ci = 0; ci < kClients; ++ci)
    EXPECT_EQ(failures[ci], "") << "client " << ci;

  // The pool holds, slot by slot, the last write of its owner.
  LocalPool local = LocalPool::FromInfo(*info);
  for (int ci = 0; ci < kClients; ++ci) {
    const int32_t n = static_cast<int32_t>(kBlocksPerClient * kBlockSize);
    std::vector<int32_t> slots;
    for (int32_t i = 0; i < n; ++i)
      slots.push_back(static_cast<int32_t>(ci * n + i));
    ASSERT_TRUE(Store(local.layout, local.layer(0), last[ci].data(),
                      InputDtype::kFP32, slots)
                    .ok());
  }
  ASSERT_FALSE(AllZero(local.bytes.data(), local.layout.total_bytes));
  absl::StatusOr<const PoolMapping*> mapped = admin->MapPool("shared");
  ASSERT_TRUE(mapped.ok());
  EXPECT_EQ(0, std::memcmp((*mapped)->data(), local.bytes.data(),
                           local.bytes.size()));
}

}  // namespace
}  // namespace kvdepot::testing
