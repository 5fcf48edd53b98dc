// A step-path registration resolved on the host (SPEC §10,
// docs/STEP_PATH.md): the request's pools, layers and buffers looked up,
// access-checked and bounds-checked once, holding references so that none
// of them is freed while the registration lives.
#ifndef KVDEPOT_SERVER_STEP_STEP_CONFIG_H_
#define KVDEPOT_SERVER_STEP_STEP_CONFIG_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/format.h"
#include "kernels/fused.h"
#include "kvdepot/v1/step.pb.h"
#include "server/access.h"
#include "server/pools.h"
#include "server/sessions.h"

namespace kvdepot::step {

// Bounds of a registration's per-step sizes.
inline constexpr int32_t kMaxTokens = 1 << 16;
inline constexpr int32_t kMaxSeqs = 1 << 14;
inline constexpr int32_t kMaxTopK = 1 << 14;
inline constexpr int32_t kMaxBlocksPerSeq = 1 << 16;
// Block-table entries a step may send inline (16 MiB): the staging areas
// are sized for this many at most, so a registration's largest maxima
// (kMaxSeqs x kMaxBlocksPerSeq: 4 GiB) cost no more. Larger tables come
// from the registered block-table buffer (block_tables_in_buffer).
inline constexpr int64_t kMaxInlineTableCells = int64_t{1} << 22;
inline constexpr int64_t kMaxNameBytes = 64;
// Distinct ratios > 1 among a registration's compressed main and index
// caches (each one compressed slot mapping per step).
inline constexpr int kMaxCompressedRatios = 8;

// [offset, ...) of a buffer, rows of row_stride bytes; device address base.
struct BufferSpan {
  std::shared_ptr<Buffer> buffer;  // null = unset
  int64_t offset = 0;
  int64_t row_stride = 0;

  bool set() const { return buffer != nullptr; }
  uint8_t* data() const;  // buffer base + offset
};

// A cache's fused-store parameters (SPEC §8), checked at registration.
// `params` has its ranges set and its arrays pointing at the host copies
// below (the engine keeps device copies; positions come per step).
struct FusedCacheConfig {
  FusedParams params;
  std::vector<uint16_t> norm_weight;  // BF16 [norm_end - norm_begin]
  std::vector<float> cos_sin;         // [max_position][rope_dim]
};

struct CacheConfig {
  std::shared_ptr<Pool> pool;  // null = the layer has no such cache
  PoolLayout layout;
  int64_t layer = 0;
  uint8_t* layer_base = nullptr;  // the pool's layer in device memory
  BufferSpan input;               // BF16 [tokens][elements], packed rows
  // Set: phase A stores with the fused kernel. Shared: configs are copied.
  std::shared_ptr<const FusedCacheConfig> fused;

  bool set() const { return pool != nullptr; }
};

struct LayerConfig {
  CacheConfig main;
  CacheConfig swa;
  CacheConfig index;
  int32_t ratio = 1;
  // Index of `ratio` in RegistrationConfig.compressed_ratios when the
  // layer's main or index cache is compressed (ratio > 1), else -1: which
  // of the step's compressed slot sections stores them.
  int32_t compressed = -1;
  int32_t window = 0;
  BufferSpan topk;       // int32 [tokens][top_k], row_stride bytes apart
  BufferSpan index_out;  // int32 [tokens][top_k]

  bool has_phase_b() const { return topk.set(); }
};

struct SwaIndexConfig {
  std::shared_ptr<Pool> pool;  // null = none
  int32_t ring_size = 0;
  int32_t num_states = 0;
  int32_t window = 0;
  BufferSpan out;  // int32 [tokens][window], row_stride bytes apart

  bool set() const { return pool != nullptr; }
};

struct RegistrationConfig {
  std::string name;
  std::string device;  // of every pool and buffer ("cuda:0", "cpu")
  std::shared_ptr<Buffer> doorbell;
  int64_t doorbell_bytes = 0;  // used part (doorbell::RegionBytes)
  std::vector<LayerConfig> layers;
  SwaIndexConfig swa_index;
  int32_t max_tokens = 0;
  int32_t max_seqs = 0;
  int32_t max_top_k = 0;
  int32_t max_blocks_per_seq = 0;
  // Derived: what a step must carry.
  bool needs_swa_states = false;  // SWA caches or the SWA index
  // The distinct ratios > 1 of the layers with a main or index cache,
  // ascending (at most kMaxCompressedRatios): a step carries one compressed
  // slot mapping per entry (StepRequest.compressed, or
  // compressed_slot_mapping when there is one).
  std::vector<int32_t> compressed_ratios;
  bool needs_block_tables = false;  // a layer with phase B
  // Optional: the worker's int32 block tables in device memory, max_seqs
  // rows of >= max_blocks_per_seq entries, row_stride bytes apart (a
  // multiple of 4). Steps with block_tables_in_buffer read them there.
  BufferSpan block_tables;
  // Optional: the worker's int32 slot mappings in device memory, 1 +
  // compressed_ratios.size() rows (row 0 = slot_mapping, row 1 + k = the
  // compressed mapping of compressed_ratios[k]) of >= max_tokens entries,
  // row_stride bytes apart (a multiple of 4). Steps with
  // slot_mappings_in_buffer read them there.
  BufferSpan slot_mappings;
  int32_t swa_ring_size = 0;   // shared by every SWA cache
  int32_t swa_num_states = 0;  // the smallest SWA pool's blocks
  // The smallest max_position of the fused caches with RoPE; 0 = none (a
  // step then carries no positions).
  int64_t max_position = 0;
};

// Bounds of the fused-store parameters: at most 2^24 cos/sin entries
// (64 MiB, the message limit) per cache.
inline constexpr int64_t kMaxCosSinEntries = int64_t{1} << 24;

// Looks everything up for `caller` and checks it: the doorbell is a buffer
// of the caller's own session, large enough; every pool usable by the
// caller, every buffer owned or granted; layers in range; inputs packed
// BF16 rows of the pool's element count, 16-byte aligned; every buffer
// range inside its buffer for the registration's bounds (the block-table
// buffer: max_seqs rows of max_blocks_per_seq int32, 4-byte aligned, only
// with a phase-B layer; the slot-mapping buffer: 1 + ratios rows of
// max_tokens int32, 4-byte aligned); everything on one device. INVALID_ARGUMENT
// naming the field and index; NOT_FOUND / PERMISSION_DENIED from the pool and
// buffer lookups.
absl::StatusOr<RegistrationConfig> ResolveRegistration(
    const v1::RegisterWorkerRequest& request, const Caller& caller,
    const PoolRegistry& pools, const SessionManager& sessions);

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_STEP_CONFIG_H_
