#include "server/step/plan_export.h"

#include <algorithm>
#include <cstdint>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/wire.h"

namespace kvdepot::step {
namespace {

int64_t RoundUp4(int64_t n) { return (n + 3) / 4 * 4; }

// Appends `n` int32 (rounded up to 4: every section 16-byte aligned) to
// the blob; the new section's offset.
int64_t Append(std::vector<int32_t>* blob, int64_t n) {
  const int64_t at = static_cast<int64_t>(blob->size());
  blob->resize(static_cast<size_t>(at + RoundUp4(n)), 0);
  return at;
}

}  // namespace

absl::StatusOr<v1::PlanStepResponse> ExportStepPlan(
    const RegistrationConfig& config, StepPlan plan) {
  const StepSections& sec = plan.sections;
  if (plan.block_tables_in_buffer && plan.num_tokens != plan.num_seqs) {
    // The daemon reads no device memory here, so it cannot repeat a
    // sequence's table row per query token; with one token per sequence
    // row r is sequence r and the worker's own tables serve as they are.
    return absl::InvalidArgumentError(absl::StrCat(
        "block_tables_in_buffer: PlanStep takes device-resident tables only "
        "when every sequence has one query token (here ",
        plan.num_tokens, " tokens in ", plan.num_seqs,
        " sequences); send this step's tables inline"));
  }
  const int32_t n = plan.num_tokens;
  std::vector<int32_t>& blob = plan.blob;
  v1::PlanStepResponse out;
  out.set_num_tokens(n);
  out.set_num_seqs(plan.num_seqs);
  out.set_top_k(plan.top_k);
  out.set_block_table_cols(plan.block_table_cols);
  // Device-resident mappings are the worker's own: nothing to return
  // (their sections in the blob were never filled).
  const bool own_slots = plan.slot_mappings_in_buffer;
  out.set_slots(own_slots ? -1 : sec.slots);
  for (int32_t k = 0; k < sec.compressed_count; ++k) {
    v1::PlannedSlots* c = out.add_compressed();
    c->set_ratio(config.compressed_ratios[static_cast<size_t>(k)]);
    c->set_slots(own_slots ? -1 : sec.compressed(k));
  }
  out.set_swa_slots(sec.swa_slots);
  out.set_swa_state_ids(sec.swa_state);
  out.set_swa_starts(sec.swa_start);
  out.set_swa_valid_lens(sec.swa_valid);
  out.set_row_seq(sec.row_seq);
  out.set_seq_lens(sec.seq_lens);
  out.set_positions(sec.positions);
  out.set_row_block_tables(-1);

  std::set<int32_t> ratios;
  for (const LayerConfig& l : config.layers) {
    if (l.has_phase_b()) ratios.insert(l.ratio);
  }
  if (sec.block_tables >= 0 || plan.block_tables_in_buffer) {
    // The table rows repeat a sequence's row per query token: bounded here,
    // before they are allocated (one sequence of 65536 tokens and 65536
    // columns would be 16 GiB).
    const bool inline_tables = sec.block_tables >= 0;
    const int64_t cols = plan.block_table_cols;
    const int64_t bytes =
        4 * (static_cast<int64_t>(blob.size()) +
             (inline_tables ? RoundUp4(int64_t{n} * cols) : 0) +
             2 * static_cast<int64_t>(ratios.size()) * RoundUp4(n));
    if (bytes > kMaxPlanStepMetadataBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("num_tokens: ", n, " query rows x block_table_cols ",
                       cols, " make a PlanStep reply of ", bytes,
                       " bytes, above its ", kMaxPlanStepMetadataBytes,
                       "; plan the step in parts or with fewer columns"));
    }
    if (inline_tables) {
      // Rows of the sequences' tables, one per query row (a sequence with
      // several query tokens repeats its row), so convert_topk runs per
      // row.
      const int64_t tables = Append(&blob, int64_t{n} * cols);
      for (int32_t r = 0; r < n; ++r) {
        const int64_t seq = blob[static_cast<size_t>(sec.row_seq + r)];
        std::copy_n(blob.begin() + sec.block_tables + seq * cols, cols,
                    blob.begin() + tables + r * cols);
      }
      out.set_row_block_tables(tables);
    }
    for (const int32_t ratio : ratios) {
      const int64_t valid = Append(&blob, n);
      const int64_t tokens = Append(&blob, n);
      for (int32_t r = 0; r < n; ++r) {
        const int64_t seq = blob[static_cast<size_t>(sec.row_seq + r)];
        const int32_t count =
            blob[static_cast<size_t>(sec.seq_lens + seq)] / std::max(ratio, 1);
        blob[static_cast<size_t>(tokens + r)] = count;
        blob[static_cast<size_t>(valid + r)] = std::min(count, plan.top_k);
      }
      v1::PlannedTopk* t = out.add_topk_inputs();
      t->set_ratio(ratio);
      t->set_valid_count(valid);
      t->set_num_tokens(tokens);
    }
  }
  // The daemon's phase gate is not the caller's: zero it.
  if (sec.gate >= 0) std::fill_n(blob.begin() + sec.gate, 4, 0);
  EncodeInt32s(blob, out.mutable_metadata());
  return out;
}

}  // namespace kvdepot::step
