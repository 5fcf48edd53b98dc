// PrefillLoad (SPEC §6), apart from the gRPC handler: one prefill chunk's
// KV buffer of BF16 rows
//
//   [SWA history: num_seqs * W rows | this chunk: sum seqlen_q rows |
//    compressed: sum max(seqlen_k / R, 1) rows]
//
// PlanPrefillLoad builds and validates every plan against both pools'
// layouts (nothing is touched); RunPrefillLoad executes one on a backend, in
// the order the contract needs: load the SWA history, load the compressed
// rows, write the chunk rows (each token quantized and dequantized exactly
// as a store then a load would), and only then store the chunk into the SWA
// rings (the store may overwrite ring slots the history load read).
#ifndef KVDEPOT_SERVER_PREFILL_LOAD_H_
#define KVDEPOT_SERVER_PREFILL_LOAD_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/format.h"
#include "kernels/store_load.h"
#include "planner/batch.h"
#include "planner/plan_builder.h"
#include "planner/prefill_layout.h"
#include "server/backend/backend.h"

namespace kvdepot {

// The plans of one chunk. Reused between calls (its vectors keep their
// capacity), so a handler can keep one per thread.
struct PrefillLoadPlan {
  PrefillLayout layout;
  std::vector<int32_t> swa_segments;   // [S][4] into the history rows
  std::vector<int32_t> main_segments;  // [S][4] into the compressed rows
  std::vector<int32_t> store_slots;    // [chunk_rows] SWA ring slots or -1
  std::vector<int32_t> cu_compressed;  // [num_seqs + 1]
  BlockLoadPlanBuilder builder{1, 1};  // scratch
};

// Plans one chunk of `batch` (block_table: compressed blocks of the main
// pool) for window W >= 1 and compress ratio R >= 1. Every error is
// INVALID_ARGUMENT naming the field; on error `plan` is unspecified.
absl::Status PlanPrefillLoad(const PoolLayout& swa, const PoolLayout& main,
                             const SequenceBatch& batch, int32_t window,
                             int32_t ratio, PrefillLoadPlan* plan);

// A consumer layer of a shared compressed cache (SPEC §6, docs/SPEC.md):
// the same layout and SWA plan and store slots as PlanPrefillLoad, no
// compressed plan (main_segments and cu_compressed stay empty; the block
// table is not read). `ratio` only sizes the compressed rows.
absl::Status PlanSharedPrefillLoad(const PoolLayout& swa,
                                   const SequenceBatch& batch, int32_t window,
                                   int32_t ratio, PrefillLoadPlan* plan);

// One pool layer as the backend sees it.
struct LayerRef {
  const PoolLayout* layout = nullptr;
  const Memory* memory = nullptr;
  int64_t layer = 0;
};

// Host copies for the cast-back of the chunk rows (reused between calls).
struct PrefillHostScratch {
  std::vector<uint8_t> chunk_in, chunk_out, record;
  std::vector<float> token, decoded;
};

// Runs `plan` (from PlanPrefillLoad with the same layouts). chunk_kv:
// [chunk_rows][elements] of `dtype`; output: [total_rows][elements] BF16.
// Both may be device memory (the backend's CopyBytes moves them). REQUIRES:
// the caller holds both pools' locks; chunk_kv and output are disjoint;
// ordering.wait_event empty (the caller awaited it). main.memory ==
// nullptr: a consumer layer (PlanSharedPrefillLoad); rows
// [main_kv_offset, total_rows) are neither read nor written.
// Every backend call gets `ordering` (the caller's session stream). With
// ordering.record_event each is queued without waiting (inline host
// operands excepted) and *recorded_event is set to the handle the last one
// returned: the session stream's event, recorded after all of them.
absl::Status RunPrefillLoad(Backend& backend, const LayerRef& swa,
                            const LayerRef& main, const PrefillLoadPlan& plan,
                            const uint8_t* chunk_kv, InputDtype dtype,
                            uint8_t* output, const GpuOrdering& ordering,
                            std::string* recorded_event,
                            PrefillHostScratch* scratch);

// The BF16 rows a store and then a load of n tokens of `format` return.
//   kv: [n][elements] of dtype; out: [n][elements] BF16 (any alignment).
void CastBackRows(const KVCacheFormat& format, const uint8_t* kv,
                  InputDtype dtype, int64_t n, uint8_t* out,
                  PrefillHostScratch* scratch);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_PREFILL_LOAD_H_
