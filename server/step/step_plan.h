// One step's metadata, checked and built on the host from a Step request
// (SPEC §10, docs/STEP_PATH.md): the slot mappings of every cache kind, the
// SWA decode windows and the per-row data of convert_topk, packed into one
// int32 blob so the daemon uploads it with a single copy.
#ifndef KVDEPOT_SERVER_STEP_STEP_PLAN_H_
#define KVDEPOT_SERVER_STEP_STEP_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvdepot/v1/step.pb.h"
#include "server/step/step_config.h"

namespace kvdepot::step {

// Offsets (in int32 elements) of the blob's sections; -1 = absent. Every
// section starts on a 16-byte boundary.
struct StepSections {
  int64_t slots = -1;  // [tokens] main/index caches of ratio 1
  // [compressed_count][compressed_stride]: section k (compressed(k)) is
  // the slots of RegistrationConfig.compressed_ratios[k] (main/index
  // caches of that ratio > 1). Contiguous, so the gate fills them at once.
  int64_t compressed_slots = -1;
  int64_t swa_slots = -1;         // [tokens] SWA ring slots
  int64_t swa_state = -1;         // [tokens] SWA decode windows
  int64_t swa_start = -1;         // [tokens]
  int64_t swa_valid = -1;         // [tokens]
  int64_t row_seq = -1;           // [tokens] sequence of each query row
  int64_t seq_lens = -1;          // [seqs] seqlen_k
  int64_t block_tables = -1;      // [seqs][cols]; -1 when in the buffer
  int64_t gate = -1;              // [4] the phase gate (device-written)
  int64_t positions = -1;         // int64 [tokens] for fused RoPE caches
  int32_t compressed_count = 0;   // = compressed_ratios.size()
  int64_t compressed_stride = 0;  // tokens rounded up to 4

  // The offset of compressed ratio k's section; -1 for k < 0 (a layer
  // without compressed caches) or no sections.
  int64_t compressed(int32_t k) const {
    return k < 0 || k >= compressed_count
               ? -1
               : compressed_slots + k * compressed_stride;
  }
};

struct StepPlan {
  uint64_t step_id = 0;
  int32_t num_tokens = 0;
  int32_t num_seqs = 0;
  int32_t top_k = 0;
  int32_t block_table_cols = 0;
  // The tables are the registration's block-table buffer (no blob
  // section; RegistrationConfig.block_tables).
  bool block_tables_in_buffer = false;
  // The slot sections (slots, compressed_slots) are reserved but filled on
  // the device from the registration's slot-mapping buffer
  // (RegistrationConfig.slot_mappings), range-checked there.
  bool slot_mappings_in_buffer = false;
  absl::Duration deadline;  // the watchdog's, from enqueue
  StepSections sections;
  std::vector<int32_t> blob;  // the single upload
};

// The smallest num_slots among the main and index caches of the layers
// whose compressed index is k (LayerConfig.compressed; -1 = ratio 1): the
// pools that slot_mapping (k = -1) or the compressed slot mapping of
// compressed_ratios[k] is stored into (0 = none).
int64_t MinSlots(const RegistrationConfig& config, int32_t k);

// Upper bound of a blob's size (int32 elements) for `config`, so the
// staging area is sized once at registration.
int64_t MaxBlobElements(const RegistrationConfig& config);

// Checks `request` against `config` and builds the plan. Everything named
// in SPEC §10 is checked: counts within the registration's bounds, packed
// arrays of the right sizes, every slot inside every pool it is stored
// into and no slot twice, lengths consistent (sum of query_lens =
// num_tokens), SWA state ids inside the rings, block tables inside the
// index pools (-1 allowed) -- inline tables and slot mappings only:
// device-resident ones (block_tables_in_buffer, slot_mappings_in_buffer)
// are checked entry by entry in the kernels (no duplicate check then).
// INVALID_ARGUMENT naming the field and index; the step id is not checked
// here (StepRegistry does).
absl::StatusOr<StepPlan> BuildStepPlan(const RegistrationConfig& config,
                                       const v1::StepRequest& request,
                                       absl::Duration default_deadline);

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_STEP_PLAN_H_
