#include "server/prefill_load.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/quant.h"
#include "kernels/reference/reference.h"
#include "kernels/store_load_host.h"
#include "planner/sequence_plans.h"

namespace kvdepot {

void CastBackRows(const KVCacheFormat& f, const uint8_t* kv, InputDtype dtype,
                  int64_t n, uint8_t* out, PrefillHostScratch* sc) {
  const int64_t e = f.elements();
  sc->token.resize(static_cast<size_t>(e));
  sc->decoded.resize(static_cast<size_t>(e));
  sc->record.resize(static_cast<size_t>(f.bytes_per_token()));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < e; ++j) {
      if (dtype == InputDtype::kBF16) {
        uint16_t h;
        std::memcpy(&h, kv + (i * e + j) * 2, 2);
        sc->token[j] = Bf16ToFloat(h);
      } else {
        std::memcpy(&sc->token[j], kv + (i * e + j) * 4, 4);
      }
    }
    if (f.quantized()) {
      EncodeToken(f, sc->token.data(), sc->record.data(),
                  sc->record.data() + f.data_bytes());
      DecodeToken(f, sc->record.data(), sc->record.data() + f.data_bytes(),
                  sc->decoded.data());
    } else {
      std::copy(sc->token.begin(), sc->token.end(), sc->decoded.begin());
    }
    for (int64_t j = 0; j < e; ++j) {
      const uint16_t h = FloatToBf16(sc->decoded[j]);
      std::memcpy(out + (i * e + j) * 2, &h, 2);
    }
  }
}

namespace {

// The layout, the SWA plan and the store slots (everything but the
// compressed plan).
absl::Status PlanSwaPart(const PoolLayout& sl, const SequenceBatch& batch,
                         int32_t window, int32_t ratio, PrefillLoadPlan* plan) {
  // window 0: no SWA part (nothing loaded from or stored into the ring);
  // ratio 0: no compressed part. Not both (the service refuses that).
  if (window < 0 || ratio < 0 || (window == 0 && ratio == 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("window = ", window, " and ratio = ", ratio,
                     ": need both >= 0 and not both 0"));
  }
  SwaParams swa_params;
  swa_params.window = window;
  swa_params.ring_size = static_cast<int32_t>(sl.block_size);
  swa_params.num_states = static_cast<int32_t>(sl.num_blocks);
  if (window > 0) RETURN_IF_ERROR(ValidateSwaParams(swa_params));
  ASSIGN_OR_RETURN(plan->layout, ComputePrefillLayout(batch, window, ratio));
  const PrefillLayout& pl = plan->layout;
  plan->swa_segments.clear();
  plan->store_slots.assign(static_cast<size_t>(pl.chunk_rows), -1);
  if (window > 0) {
    // The SWA plan, copied out: the builder is reused for the compressed
    // plan.
    RETURN_IF_ERROR(BuildSwaPlan(batch, swa_params, &plan->builder));
    const absl::Span<const int32_t> swa_plan = plan->builder.Finish();
    plan->swa_segments.assign(swa_plan.begin(), swa_plan.end());
    RETURN_IF_ERROR(BuildSwaStoreSlots(batch, swa_params,
                                       absl::MakeSpan(plan->store_slots)));
    if (absl::Status s = ValidateSlotMapping(sl, plan->store_slots); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "swa_state_id: two sequences share a ring slot (SWA store ",
          s.message(), ")"));
    }
  }
  return ValidateSegments(sl, plan->swa_segments, pl.swa_history_rows);
}

}  // namespace

absl::Status PlanSharedPrefillLoad(const PoolLayout& sl,
                                   const SequenceBatch& batch, int32_t window,
                                   int32_t ratio, PrefillLoadPlan* plan) {
  if (!sl.format.do_cast) {
    return absl::InvalidArgumentError(
        "swa_pool must be a do_cast format (its rows are loaded as BF16)");
  }
  // A consumer shares a compressed part and loads its own SWA part.
  if (window < 1 || ratio < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("window = ", window, ", compress_ratio = ", ratio,
                     ": a shared_compressed (consumer) load needs both >= 1"));
  }
  RETURN_IF_ERROR(PlanSwaPart(sl, batch, window, ratio, plan));
  plan->main_segments.clear();
  plan->cu_compressed.clear();
  return absl::OkStatus();
}

absl::Status PlanPrefillLoad(const PoolLayout& sl, const PoolLayout& ml,
                             const SequenceBatch& batch, int32_t window,
                             int32_t ratio, PrefillLoadPlan* plan) {
  if (!sl.format.do_cast || !ml.format.do_cast ||
      sl.format.elements() != ml.format.elements()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "swa_pool and main_pool must be do_cast formats with the same "
        "elements (got ",
        sl.format.elements(), " and ", ml.format.elements(), ")"));
  }
  CompressedParams cparams;
  cparams.ratio = ratio;
  cparams.block_size = static_cast<int32_t>(ml.block_size * ratio);
  cparams.num_blocks = static_cast<int32_t>(ml.num_blocks);
  RETURN_IF_ERROR(PlanSwaPart(sl, batch, window, ratio, plan));
  const PrefillLayout& pl = plan->layout;
  plan->cu_compressed.assign(static_cast<size_t>(batch.num_seqs() + 1), 0);
  plan->main_segments.clear();
  if (ratio > 0) {
    RETURN_IF_ERROR(BuildCompressedPlan(batch, cparams, &plan->builder,
                                        absl::MakeSpan(plan->cu_compressed)));
    const absl::Span<const int32_t> main_plan = plan->builder.Finish();
    plan->main_segments.assign(main_plan.begin(), main_plan.end());
  }
  return ValidateSegments(ml, plan->main_segments, pl.compressed_rows);
}

absl::Status RunPrefillLoad(Backend& backend, const LayerRef& swa,
                            const LayerRef& main, const PrefillLoadPlan& plan,
                            const uint8_t* chunk_kv, InputDtype dtype,
                            uint8_t* output, const GpuOrdering& ordering,
                            std::string* recorded_event,
                            PrefillHostScratch* sc) {
  std::string ignored;
  std::string* event = recorded_event != nullptr ? recorded_event : &ignored;
  event->clear();
  const PrefillLayout& pl = plan.layout;
  const PoolLayout& sl = *swa.layout;
  const int64_t row_bytes = LoadDataRowBytes(sl.format);  // = main's
  RETURN_IF_ERROR(backend.LoadOrdered(sl, *swa.memory, swa.layer,
                                      plan.swa_segments, pl.swa_history_rows,
                                      output, nullptr, ordering, event));
  if (main.memory != nullptr) {  // else a consumer: the rows stay in place
    RETURN_IF_ERROR(backend.LoadOrdered(
        *main.layout, *main.memory, main.layer, plan.main_segments,
        pl.compressed_rows, output + int64_t{pl.main_kv_offset} * row_bytes,
        nullptr, ordering, event));
  }
  if (pl.chunk_rows == 0) return absl::OkStatus();
  // The cast-back on the backend's engine (the GPU: no bounce through host
  // memory), else on the host: the chunk and its output rows may be
  // device memory, so the host path works on copies.
  uint8_t* chunk_out = output + int64_t{pl.swa_history_rows} * row_bytes;
  absl::Status on_backend = backend.CastBack(
      sl.format, chunk_kv, dtype, pl.chunk_rows, chunk_out, ordering);
  if (on_backend.ok()) {
    return backend.StoreOrdered(sl, *swa.memory, swa.layer, chunk_kv, dtype,
                                plan.store_slots, ordering, event);
  }
  if (on_backend.code() != absl::StatusCode::kUnimplemented) return on_backend;
  // Host memory on both sides: CopyBytes waits for the loads above.
  const int64_t in_bytes = int64_t{pl.chunk_rows} * sl.format.elements() *
                           (dtype == InputDtype::kBF16 ? 2 : 4);
  const int64_t out_bytes = int64_t{pl.chunk_rows} * row_bytes;
  sc->chunk_in.resize(static_cast<size_t>(in_bytes));
  sc->chunk_out.resize(static_cast<size_t>(out_bytes));
  RETURN_IF_ERROR(backend.CopyBytes(sc->chunk_in.data(), chunk_kv, in_bytes));
  CastBackRows(sl.format, sc->chunk_in.data(), dtype, pl.chunk_rows,
               sc->chunk_out.data(), sc);
  RETURN_IF_ERROR(
      backend.CopyBytes(output + int64_t{pl.swa_history_rows} * row_bytes,
                        sc->chunk_out.data(), out_bytes));
  return backend.StoreOrdered(sl, *swa.memory, swa.layer, chunk_kv, dtype,
                              plan.store_slots, ordering, event);
}

}  // namespace kvdepot
