#include "tests/shared_prefill_util.h"

#include <algorithm>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "tests/e2e_util.h"

namespace kvdepot::testing {

SharedGroup SharedGroup::Make(const SharedCase& c, uint32_t seed) {
  SharedGroup g;
  g.c = c;
  const int32_t w = c.window, r = c.ratio;
  g.seqlen_k = {3 * w + 17, 1, w + c.ring + 9};
  g.seqlen_q = {5, 1, c.ring + 3};
  g.state_ids = {2, 0, 1};
  g.valid_start = {0, 0, 2};
  g.states = 3;
  std::vector<int64_t> blocks(3);
  for (size_t b = 0; b < 3; ++b) {
    const int64_t n = g.seqlen_k[b] / r;
    blocks[b] = std::max<int64_t>((n + c.block - 1) / c.block, 1);
    g.max_blocks = std::max(g.max_blocks, blocks[b] + 1);
  }
  const int64_t used = blocks[0] + blocks[1] + blocks[2];
  g.main_blocks = used + 5;
  std::vector<int32_t> physical(static_cast<size_t>(g.main_blocks));
  std::iota(physical.begin(), physical.end(), 0);
  std::mt19937 rng(seed);
  std::shuffle(physical.begin(), physical.end(), rng);
  g.block_table.assign(static_cast<size_t>(3 * g.max_blocks), 0);
  size_t next = 0;
  for (size_t b = 0; b < 3; ++b) {
    for (int64_t i = 0; i < blocks[b]; ++i) {
      g.block_table[b * g.max_blocks + i] = physical[next++];
    }
  }
  int64_t compressed = 0;
  for (size_t b = 0; b < 3; ++b) {
    g.chunk_rows += g.seqlen_q[b];
    compressed += std::max<int64_t>(g.seqlen_k[b] / r, 1);
  }
  g.main_kv_offset = 3 * int64_t{w} + g.chunk_rows;
  g.total_rows = g.main_kv_offset + compressed;
  return g;
}

v1::CreatePoolRequest SharedGroup::SwaPool(const std::string& name) const {
  return PoolRequest(name, c.swa_format,
                     c.swa_format == "BF16" ? c.elements : 0, c.ring, states,
                     swa_layers());
}

v1::CreatePoolRequest SharedGroup::MainPool(const std::string& name) const {
  return PoolRequest(name, c.main_format,
                     c.main_format == "BF16" ? c.elements : 0, c.block,
                     main_blocks, 2);
}

v1::PrefillLoadRequest SharedGroup::Full(const std::string& swa_pool,
                                         const std::string& main_pool,
                                         int64_t swa_layer) const {
  v1::PrefillLoadRequest r = Consumer(swa_pool, main_pool, swa_layer);
  r.set_shared_compressed(false);
  r.set_max_blocks_per_seq(max_blocks);
  r.set_block_table(Pack(block_table));
  return r;
}

v1::PrefillLoadRequest SharedGroup::Consumer(const std::string& swa_pool,
                                             const std::string& main_pool,
                                             int64_t swa_layer) const {
  v1::PrefillLoadRequest r;
  r.set_swa_pool(swa_pool);
  r.set_swa_layer(swa_layer);
  r.set_main_pool(main_pool);
  r.set_main_layer(1);
  r.set_num_seqs(num_seqs());
  r.set_seqlen_k(Pack(seqlen_k));
  r.set_seqlen_q(Pack(seqlen_q));
  r.set_swa_state_id(Pack(state_ids));
  r.set_swa_valid_start(Pack(valid_start));
  r.set_window(c.window);
  r.set_compress_ratio(c.ratio);
  r.set_dtype(v1::INPUT_DTYPE_BF16);
  r.set_shared_compressed(true);
  return r;
}

namespace {

absl::Status StoreAll(KVCacheClient& client, const std::string& pool,
                      int64_t layer, int64_t slots, const std::string& bf16) {
  std::vector<int32_t> all(static_cast<size_t>(slots));
  std::iota(all.begin(), all.end(), 0);
  v1::StoreRequest r = StoreRequest(pool, layer, all, v1::INPUT_DTYPE_BF16);
  r.mutable_kv()->set_inline_data(bf16);
  absl::StatusOr<v1::StoreResponse> s = client.Store(r);
  if (!s.ok()) {
    return absl::Status(s.status().code(),
                        absl::StrCat("storing ", pool, " layer ", layer, ": ",
                                     s.status().message()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status FillGroupPools(KVCacheClient& client, const SharedGroup& g,
                            const std::string& swa_pool,
                            const std::string& main_pool, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t ring_slots = g.states * g.c.ring;
  for (int64_t l = 0; l <= g.c.consumers; ++l) {
    const std::string kv = Bf16Bytes(RandomKv(ring_slots, g.c.elements, rng));
    for (int64_t layer : {l, g.mirror(l)}) {
      absl::Status s = StoreAll(client, swa_pool, layer, ring_slots, kv);
      if (!s.ok()) return s;
    }
  }
  const int64_t main_slots = g.main_blocks * g.c.block;
  return StoreAll(client, main_pool, 1, main_slots,
                  Bf16Bytes(RandomKv(main_slots, g.c.elements, rng)));
}

std::vector<std::string> GroupChunks(const SharedGroup& g, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::string> out;
  for (int64_t l = 0; l <= g.c.consumers; ++l) {
    out.push_back(Bf16Bytes(RandomKv(g.chunk_rows, g.c.elements, rng)));
  }
  return out;
}

}  // namespace kvdepot::testing
