// Helpers of the shared prefill load tests (CPU and CUDA): a cross-layer
// group of one source and C consumer layers over a SWA pool and a
// compressed pool, its sequences (a long one with a full window, a
// one-token one that is all zero padding, one whose chunk is longer than
// the ring: -1 store slots) and its requests.
//
// The SWA pool has 2 (C + 1) layers: layer l in [0, C] is layer l of the
// group, layer C + 1 + l its mirror with the same bytes, on which the test
// runs the full PrefillLoad that layer l's shared load must equal (both
// store their chunk into their own layer; the rings are compared after).
// The compressed cache is layer 1 of the main pool (layer 0 stays zero).
#ifndef KVDEPOT_TESTS_SHARED_PREFILL_UTIL_H_
#define KVDEPOT_TESTS_SHARED_PREFILL_UTIL_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/kvdepot_client.h"
#include "kvdepot/v1/kvdepot.pb.h"

namespace kvdepot::testing {

struct SharedCase {
  std::string name;
  std::string swa_format;   // "V41", "V41_FP4" or "BF16"
  std::string main_format;  // the same elements
  int32_t elements = 512;   // BF16 only (the others have 512)
  int32_t block = 1;        // compressed tokens per main-pool block
  int32_t ratio = 1;
  int32_t window = 1;
  int32_t ring = 1;  // SWA ring size (swa pool block_size), >= window
  int consumers = 1;
};

// gtest prints a case by its name.
inline void PrintTo(const SharedCase& c, std::ostream* os) { *os << c.name; }

struct SharedGroup {
  SharedCase c;
  std::vector<int32_t> seqlen_k, seqlen_q, state_ids, valid_start;
  int64_t max_blocks = 0;
  std::vector<int32_t> block_table;  // [num_seqs][max_blocks]
  int64_t main_blocks = 0;
  int64_t states = 0;
  int64_t chunk_rows = 0;
  int64_t total_rows = 0;      // of the prefill buffer
  int64_t main_kv_offset = 0;  // its first compressed row

  static SharedGroup Make(const SharedCase& c, uint32_t seed);

  int64_t num_seqs() const { return static_cast<int64_t>(seqlen_k.size()); }
  int64_t swa_layers() const { return 2 * (c.consumers + 1); }
  int64_t mirror(int64_t l) const { return c.consumers + 1 + l; }
  int64_t row_bytes() const { return int64_t{c.elements} * 2; }
  int64_t output_bytes() const { return total_rows * row_bytes(); }
  int64_t chunk_bytes() const { return chunk_rows * row_bytes(); }  // BF16

  v1::CreatePoolRequest SwaPool(const std::string& name) const;
  v1::CreatePoolRequest MainPool(const std::string& name) const;

  // A full PrefillLoad of SWA layer `swa_layer` and main layer 1 (chunk
  // and output left to the caller).
  v1::PrefillLoadRequest Full(const std::string& swa_pool,
                              const std::string& main_pool,
                              int64_t swa_layer) const;
  // The consumer's request: the same without block table, shared.
  v1::PrefillLoadRequest Consumer(const std::string& swa_pool,
                                  const std::string& main_pool,
                                  int64_t swa_layer) const;
};

// Fills every SWA layer l in [0, C] and its mirror with the same random
// K/V (different per layer), and main layer 1, by inline Stores.
absl::Status FillGroupPools(KVCacheClient& client, const SharedGroup& g,
                            const std::string& swa_pool,
                            const std::string& main_pool, uint32_t seed);

// BF16 bytes of one random chunk per group layer: [C + 1] strings.
std::vector<std::string> GroupChunks(const SharedGroup& g, uint32_t seed);

}  // namespace kvdepot::testing

#endif  // KVDEPOT_TESTS_SHARED_PREFILL_UTIL_H_
