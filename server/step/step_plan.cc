#include "server/step/step_plan.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "common/status_macros.h"
#include "kernels/store_load_host.h"
#include "planner/plan.h"
#include "proto/wire.h"

namespace kvdepot::step {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

int64_t RoundUp4(int64_t n) { return (n + 3) / 4 * 4; }

// Reserves `n` int32 in the blob; returns the section's offset.
int64_t Reserve(std::vector<int32_t>* blob, int64_t n) {
  const int64_t at = static_cast<int64_t>(blob->size());
  blob->resize(static_cast<size_t>(at + RoundUp4(n)), 0);
  return at;
}

absl::Span<int32_t> Section(std::vector<int32_t>* blob, int64_t at, int64_t n) {
  return absl::MakeSpan(blob->data() + at, static_cast<size_t>(n));
}

// ValidateSlotMapping against a pool of `num_slots` slots, its messages
// naming `field`[i] (both indices of a duplicate) after `prefix`.
absl::Status CheckSlots(absl::string_view field, int64_t num_slots,
                        absl::Span<const int32_t> slots,
                        absl::string_view prefix = "") {
  PoolLayout layout;
  layout.block_size = 1;
  layout.num_blocks = num_slots;
  absl::Status s = ValidateSlotMapping(layout, slots);
  if (s.ok()) return s;
  return absl::InvalidArgumentError(absl::StrCat(
      prefix, absl::StrReplaceAll(
                  s.message(), {{"slot_mapping[", absl::StrCat(field, "[")}})));
}

// The step's compressed slot mappings, one blob section per ratio of
// config.compressed_ratios: from compressed_slot_mapping (a registration
// with one ratio > 1) or from `compressed` (one entry per ratio, any
// order; required with several), each checked against its ratio's pools.
absl::Status AddCompressedSlots(const RegistrationConfig& config,
                                const v1::StepRequest& r,
                                std::vector<int32_t>* values,
                                std::vector<int32_t>* blob, StepSections* sec) {
  const std::vector<int32_t>& ratios = config.compressed_ratios;
  const int32_t count = static_cast<int32_t>(ratios.size());
  if (count == 0) {
    if (!r.compressed_slot_mapping().empty() || r.compressed_size() > 0) {
      return Invalid(
          r.compressed_size() > 0 ? "compressed" : "compressed_slot_mapping",
          "set, but no main or index cache of this registration "
          "has a ratio > 1");
    }
    return absl::OkStatus();
  }
  const std::string list = absl::StrJoin(ratios, ", ");
  const int32_t n = r.num_tokens();
  sec->compressed_count = count;
  sec->compressed_stride = RoundUp4(n);
  sec->compressed_slots = Reserve(blob, count * sec->compressed_stride);
  if (r.compressed_size() == 0) {
    if (count > 1) {
      return Invalid(
          r.compressed_slot_mapping().empty() ? "compressed"
                                              : "compressed_slot_mapping",
          absl::StrCat("this registration has ", count, " compressed ratios (",
                       list,
                       "): send one `compressed` entry per ratio "
                       "(compressed_slot_mapping serves a single ratio)"));
    }
    RETURN_IF_ERROR(DecodeInt32s("compressed_slot_mapping",
                                 r.compressed_slot_mapping(), "num_tokens", n,
                                 config.max_tokens, values));
    RETURN_IF_ERROR(
        CheckSlots("compressed_slot_mapping", MinSlots(config, 0), *values));
    std::memcpy(blob->data() + sec->compressed(0), values->data(),
                4 * values->size());
    return absl::OkStatus();
  }
  if (!r.compressed_slot_mapping().empty()) {
    return Invalid("compressed",
                   "set together with compressed_slot_mapping: send one "
                   "form");
  }
  // At most one entry per ratio: bounds the work before any is decoded.
  if (r.compressed_size() > count) {
    return Invalid("compressed", absl::StrCat(r.compressed_size(),
                                              " entries; this "
                                              "registration has ",
                                              count, " compressed ratio(s) (",
                                              list, "), one entry each"));
  }
  std::vector<int> entry_of(ratios.size(), -1);  // per ratio: its entry
  for (int i = 0; i < r.compressed_size(); ++i) {
    const v1::CompressedSlots& e = r.compressed(i);
    const std::string f = absl::StrCat("compressed[", i, "]");
    const auto it = std::lower_bound(ratios.begin(), ratios.end(), e.ratio());
    if (it == ratios.end() || *it != e.ratio()) {
      return Invalid(
          absl::StrCat(f, ".ratio"),
          absl::StrCat(e.ratio(), " is not a ratio of this registration (",
                       list, ")"));
    }
    const int32_t k = static_cast<int32_t>(it - ratios.begin());
    if (entry_of[k] >= 0) {
      return Invalid(absl::StrCat(f, ".ratio"),
                     absl::StrCat(e.ratio(), " duplicates compressed[",
                                  entry_of[k], "].ratio"));
    }
    entry_of[k] = i;
    const std::string field = absl::StrCat(f, ".slot_mapping");
    RETURN_IF_ERROR(DecodeInt32s(field, e.slot_mapping(), "num_tokens", n,
                                 config.max_tokens, values));
    RETURN_IF_ERROR(CheckSlots(field, MinSlots(config, k), *values));
    std::memcpy(blob->data() + sec->compressed(k), values->data(),
                4 * values->size());
  }
  for (int32_t k = 0; k < count; ++k) {
    if (entry_of[k] < 0) {
      return Invalid("compressed",
                     absl::StrCat("no entry for ratio ", ratios[k],
                                  " (this registration's compressed ratios: ",
                                  list, "; one entry each)"));
    }
  }
  return absl::OkStatus();
}

// A step with slot_mappings_in_buffer: a registered slot-mapping buffer
// and no inline mapping in any of the three fields.
absl::Status CheckSlotBufferStep(const RegistrationConfig& config,
                                 const v1::StepRequest& r) {
  if (!config.slot_mappings.set()) {
    return Invalid("slot_mappings_in_buffer",
                   "set, but the registration has no slot-mapping buffer "
                   "(RegisterWorkerRequest.slot_mappings)");
  }
  const char* inline_field = !r.slot_mapping().empty() ? "slot_mapping"
                             : !r.compressed_slot_mapping().empty()
                                 ? "compressed_slot_mapping"
                             : r.compressed_size() > 0 ? "compressed"
                                                       : nullptr;
  if (inline_field != nullptr) {
    return Invalid(inline_field,
                   "set, but slot_mappings_in_buffer is set (the mappings "
                   "are the registered buffer's rows): send it empty");
  }
  return absl::OkStatus();
}

// The blob's slot sections: from the request (checked against every pool
// each mapping is stored into), or, for slot_mappings_in_buffer, reserved
// for the device to fill from the worker's buffer (the import kernel
// checks each entry there).
absl::Status AddSlots(const RegistrationConfig& config,
                      const v1::StepRequest& r, StepPlan* plan) {
  std::vector<int32_t>& blob = plan->blob;
  StepSections& sec = plan->sections;
  const int32_t n = r.num_tokens();
  if (r.slot_mappings_in_buffer()) {
    RETURN_IF_ERROR(CheckSlotBufferStep(config, r));
    plan->slot_mappings_in_buffer = true;
    sec.slots = Reserve(&blob, n);
    const int32_t count = static_cast<int32_t>(config.compressed_ratios.size());
    if (count > 0) {
      sec.compressed_count = count;
      sec.compressed_stride = RoundUp4(n);
      sec.compressed_slots = Reserve(&blob, count * sec.compressed_stride);
    }
    return absl::OkStatus();
  }
  std::vector<int32_t> values;
  RETURN_IF_ERROR(DecodeInt32s("slot_mapping", r.slot_mapping(), "num_tokens",
                               n, config.max_tokens, &values));
  const int64_t slot_bound = MinSlots(config, -1);
  if (slot_bound > 0) {
    RETURN_IF_ERROR(CheckSlots("slot_mapping", slot_bound, values));
  }
  sec.slots = Reserve(&blob, n);
  std::memcpy(blob.data() + sec.slots, values.data(), 4 * values.size());
  return AddCompressedSlots(config, r, &values, &blob, &sec);
}

// The request's inline block tables [num_seqs][block_table_cols], every
// entry in [-1, num_blocks) of every phase-B index pool, into the blob.
// REQUIRES: num_seqs and block_table_cols checked against the bounds.
absl::Status AddInlineTables(const RegistrationConfig& config,
                             const v1::StepRequest& r,
                             std::vector<int32_t>* values,
                             std::vector<int32_t>* blob, StepSections* sec) {
  const int64_t cells = int64_t{r.num_seqs()} * r.block_table_cols();
  if (cells > kMaxInlineTableCells) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block_tables: num_seqs * block_table_cols = ", cells,
        " entries inline, more than ", kMaxInlineTableCells,
        "; write them to the registered block-table buffer and set "
        "block_tables_in_buffer"));
  }
  RETURN_IF_ERROR(DecodeInt32s(
      "block_tables", r.block_tables(), "num_seqs * block_table_cols", cells,
      int64_t{config.max_seqs} * config.max_blocks_per_seq, values));
  int64_t blocks = std::numeric_limits<int64_t>::max();
  for (const LayerConfig& l : config.layers) {
    if (l.has_phase_b()) blocks = std::min(blocks, l.index.layout.num_blocks);
  }
  for (int64_t i = 0; i < cells; ++i) {
    if ((*values)[i] < -1 || (*values)[i] >= blocks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block_tables[", i / r.block_table_cols(), "][",
          i % r.block_table_cols(), "] = ", (*values)[i], " is outside [-1, ",
          blocks, ") (the index pools' blocks)"));
    }
  }
  sec->block_tables = Reserve(blob, cells);
  std::memcpy(blob->data() + sec->block_tables, values->data(),
              4 * values->size());
  return absl::OkStatus();
}

}  // namespace

int64_t MinSlots(const RegistrationConfig& config, int32_t k) {
  int64_t best = 0;
  for (const LayerConfig& l : config.layers) {
    if (l.compressed != k) continue;
    for (const CacheConfig* c : {&l.main, &l.index}) {
      if (!c->set()) continue;
      const int64_t n = c->layout.num_slots();
      best = best == 0 ? n : std::min(best, n);
    }
  }
  return best;
}

int64_t MaxBlobElements(const RegistrationConfig& c) {
  const int64_t t = RoundUp4(c.max_tokens);
  return 6 * t + static_cast<int64_t>(c.compressed_ratios.size()) * t +
         RoundUp4(c.max_seqs) +
         RoundUp4(std::min(int64_t{c.max_seqs} * c.max_blocks_per_seq,
                           kMaxInlineTableCells)) +
         4 + (c.max_position > 0 ? 2 * t : 0);
}

absl::StatusOr<StepPlan> BuildStepPlan(const RegistrationConfig& config,
                                       const v1::StepRequest& r,
                                       absl::Duration default_deadline) {
  StepPlan plan;
  plan.step_id = r.step_id();
  if (r.num_tokens() < 1 || r.num_tokens() > config.max_tokens) {
    return Invalid("num_tokens",
                   absl::StrCat(r.num_tokens(), " is outside [1, ",
                                config.max_tokens, "] (max_tokens)"));
  }
  if (r.num_seqs() < 1 || r.num_seqs() > config.max_seqs) {
    return Invalid("num_seqs", absl::StrCat(r.num_seqs(), " is outside [1, ",
                                            config.max_seqs, "] (max_seqs)"));
  }
  const int32_t n = r.num_tokens();
  const int32_t seqs = r.num_seqs();
  plan.num_tokens = n;
  plan.num_seqs = seqs;
  plan.deadline = r.deadline_ms() == 0 ? default_deadline
                                       : absl::Milliseconds(r.deadline_ms());

  std::vector<int32_t>& blob = plan.blob;
  blob.reserve(static_cast<size_t>(MaxBlobElements(config)));
  StepSections& sec = plan.sections;

  // Slot mappings (main and compressed): every pool they are stored into.
  RETURN_IF_ERROR(AddSlots(config, r, &plan));

  // Positions (int64, two int32 each) of the fused caches with RoPE, each
  // checked against the shortest cos/sin cache.
  if (config.max_position > 0) {
    const std::string& bytes = r.positions();
    if (static_cast<int64_t>(bytes.size()) != int64_t{8} * n) {
      return Invalid("positions",
                     absl::StrCat(bytes.size(), " bytes; num_tokens = ", n,
                                  " needs ", int64_t{8} * n, " (int64 each)"));
    }
    sec.positions = Reserve(&blob, 2 * int64_t{n});
    for (int32_t i = 0; i < n; ++i) {
      int64_t p = 0;
      std::memcpy(&p, bytes.data() + 8 * i, 8);
      if (p < 0 || p >= config.max_position) {
        return Invalid(absl::StrCat("positions[", i, "]"),
                       absl::StrCat(p, " is outside [0, ", config.max_position,
                                    ") (the cos/sin cache length)"));
      }
      std::memcpy(blob.data() + sec.positions + 2 * int64_t{i}, &p, 8);
    }
  } else if (!r.positions().empty()) {
    return Invalid("positions",
                   "set, but no cache of this registration is stored with "
                   "RoPE");
  }

  // Lengths.
  std::vector<int32_t> values;
  std::vector<int32_t> seq_lens, query_lens, states, valid_starts;
  RETURN_IF_ERROR(DecodeInt32s("seq_lens", r.seq_lens(), "num_seqs", seqs,
                               config.max_seqs, &seq_lens));
  RETURN_IF_ERROR(DecodeInt32s("query_lens", r.query_lens(), "num_seqs", seqs,
                               config.max_seqs, &query_lens));
  int64_t total = 0;
  for (int32_t b = 0; b < seqs; ++b) {
    if (query_lens[b] < 1 || query_lens[b] > n) {
      return Invalid(absl::StrCat("query_lens[", b, "]"),
                     absl::StrCat(query_lens[b], " is outside [1, ", n, "]"));
    }
    if (seq_lens[b] < query_lens[b]) {
      return Invalid(absl::StrCat("seq_lens[", b, "]"),
                     absl::StrCat(seq_lens[b], " is below query_lens[", b,
                                  "] = ", query_lens[b]));
    }
    total += query_lens[b];
  }
  if (total != n) {
    return Invalid("query_lens",
                   absl::StrCat("sum ", total, " differs from num_tokens ", n));
  }
  sec.row_seq = Reserve(&blob, n);
  {
    int32_t row = 0;
    for (int32_t b = 0; b < seqs; ++b) {
      for (int32_t j = 0; j < query_lens[b]; ++j) {
        blob[sec.row_seq + row++] = b;
      }
    }
  }
  sec.seq_lens = Reserve(&blob, seqs);
  std::memcpy(blob.data() + sec.seq_lens, seq_lens.data(), 4 * seq_lens.size());

  SequenceBatch batch;
  batch.seqlen_k = seq_lens;
  batch.seqlen_q = query_lens;
  if (config.needs_swa_states) {
    RETURN_IF_ERROR(DecodeInt32s("swa_state_ids", r.swa_state_ids(), "num_seqs",
                                 seqs, config.max_seqs, &states));
    if (!r.swa_valid_starts().empty()) {
      RETURN_IF_ERROR(DecodeInt32s("swa_valid_starts", r.swa_valid_starts(),
                                   "num_seqs", seqs, config.max_seqs,
                                   &valid_starts));
    }
    batch.state_ids = states;
    batch.swa_valid_start = valid_starts;
    SwaParams store;
    store.ring_size = config.swa_ring_size;
    store.window = config.swa_ring_size;
    store.num_states = config.swa_num_states;
    RETURN_IF_ERROR(ValidateSwaBatch(batch, store.num_states).status());
    sec.swa_slots = Reserve(&blob, n);
    RETURN_IF_ERROR(
        BuildSwaStoreSlots(batch, store, Section(&blob, sec.swa_slots, n)));
    RETURN_IF_ERROR(CheckSlots(
        "slot_mapping", int64_t{store.num_states} * store.ring_size,
        Section(&blob, sec.swa_slots, n), "swa slots from swa_state_ids: "));
    if (config.swa_index.set()) {
      SwaParams window = store;
      window.window = config.swa_index.window;
      sec.swa_state = Reserve(&blob, n);
      sec.swa_start = Reserve(&blob, n);
      sec.swa_valid = Reserve(&blob, n);
      RETURN_IF_ERROR(ComputeSwaDecodeWindows(
          batch, window, Section(&blob, sec.swa_state, n),
          Section(&blob, sec.swa_start, n), Section(&blob, sec.swa_valid, n)));
    }
  } else if (!r.swa_state_ids().empty()) {
    return Invalid("swa_state_ids",
                   "set, but this registration has no SWA cache or index");
  }

  if (config.needs_block_tables) {
    if (r.top_k() < 1 || r.top_k() > config.max_top_k) {
      return Invalid("top_k", absl::StrCat(r.top_k(), " is outside [1, ",
                                           config.max_top_k, "] (max_top_k)"));
    }
    if (r.block_table_cols() < 1 ||
        r.block_table_cols() > config.max_blocks_per_seq) {
      return Invalid(
          "block_table_cols",
          absl::StrCat(r.block_table_cols(), " is outside [1, ",
                       config.max_blocks_per_seq, "] (max_blocks_per_seq)"));
    }
    plan.top_k = r.top_k();
    plan.block_table_cols = r.block_table_cols();
    if (r.block_tables_in_buffer()) {
      // Rows [0, num_seqs) of the registered buffer, written by the
      // worker's stream; each entry is checked by the kernel that reads it.
      if (!config.block_tables.set()) {
        return Invalid("block_tables_in_buffer",
                       "set, but the registration has no block-table buffer "
                       "(RegisterWorkerRequest.block_tables)");
      }
      if (!r.block_tables().empty()) {
        return Invalid(
            "block_tables",
            absl::StrCat(r.block_tables().size(),
                         " bytes, but block_tables_in_buffer is set (the "
                         "tables are the registered buffer's rows): send "
                         "them empty"));
      }
      plan.block_tables_in_buffer = true;
    } else {
      RETURN_IF_ERROR(AddInlineTables(config, r, &values, &blob, &sec));
    }
  } else if (!r.block_tables().empty() || r.top_k() != 0 ||
             r.block_tables_in_buffer()) {
    return Invalid(
        r.block_tables_in_buffer() ? "block_tables_in_buffer" : "block_tables",
        "set, but no layer of this registration has phase B "
        "(topk)");
  }
  sec.gate = Reserve(&blob, 4);
  return plan;
}

}  // namespace kvdepot::step
