// PrefillLoad (SPEC §6): one prefill chunk's KV buffer
//
//   [SWA history: num_seqs * W rows | this chunk: sum seqlen_q rows |
//    compressed: sum max(seqlen_k / R, 1) rows]
//
// of BF16 rows. Order of the work, under both pool locks: load the SWA
// history, load the compressed rows, write the chunk rows (each token
// quantized and dequantized exactly as a store then a load would), and only
// then store the chunk into the SWA rings (the store may overwrite ring
// slots the history load read).
#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/quant.h"
#include "kernels/reference/reference.h"
#include "kernels/store_load_host.h"
#include "proto/wire.h"
#include "server/data_refs.h"
#include "server/request_checks.h"
#include "server/service.h"

namespace kvdepot {
namespace {

struct PrefillScratch {
  std::vector<int32_t> seqlen_k, seqlen_q, state_ids, valid_start;
  std::vector<int32_t> block_table, cu_compressed, store_slots, swa_segments;
  std::vector<float> token, decoded;
  std::vector<uint8_t> record;
  std::vector<uint8_t> chunk_in, chunk_out;  // host copies (CastBack)
  BlockLoadPlanBuilder builder{1, 1};
};

PrefillScratch& ThreadPrefillScratch() {
  thread_local PrefillScratch scratch;
  return scratch;
}

// Writes the BF16 rows a store + load of `n` tokens of kv would produce.
//   kv:  [n][elements] of dtype
//   out: [n][elements] BF16 (any alignment)
void CastBack(const KVCacheFormat& f, const uint8_t* kv, InputDtype dtype,
              int64_t n, uint8_t* out, PrefillScratch& sc) {
  const int64_t e = f.elements();
  sc.token.resize(static_cast<size_t>(e));
  sc.decoded.resize(static_cast<size_t>(e));
  sc.record.resize(static_cast<size_t>(f.bytes_per_token()));
  std::vector<float>& decoded = sc.decoded;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < e; ++j) {
      if (dtype == InputDtype::kBF16) {
        uint16_t h;
        std::memcpy(&h, kv + (i * e + j) * 2, 2);
        sc.token[j] = Bf16ToFloat(h);
      } else {
        std::memcpy(&sc.token[j], kv + (i * e + j) * 4, 4);
      }
    }
    if (f.quantized()) {
      EncodeToken(f, sc.token.data(), sc.record.data(),
                  sc.record.data() + f.data_bytes());
      DecodeToken(f, sc.record.data(), sc.record.data() + f.data_bytes(),
                  decoded.data());
    } else {
      std::copy(sc.token.begin(), sc.token.end(), decoded.begin());
    }
    for (int64_t j = 0; j < e; ++j) {
      const uint16_t h = FloatToBf16(decoded[j]);
      std::memcpy(out + (i * e + j) * 2, &h, 2);
    }
  }
}

}  // namespace

absl::Status KVCacheService::DoPrefillLoad(Ctx* ctx,
                                           const v1::PrefillLoadRequest& r,
                                           v1::PrefillLoadResponse* out) {
  if (absl::Status s = TouchSession(r.session_id()); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<Pool>> swa =
      pools_->Get("swa_pool", r.swa_pool());
  if (!swa.ok()) return swa.status();
  absl::StatusOr<std::shared_ptr<Pool>> main =
      pools_->Get("main_pool", r.main_pool());
  if (!main.ok()) return main.status();
  const PoolLayout& sl = (*swa)->layout;
  const PoolLayout& ml = (*main)->layout;
  if (absl::Status s = CheckLayer("swa_layer", r.swa_layer(), sl); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckLayer("main_layer", r.main_layer(), ml); !s.ok()) {
    return s;
  }
  if (!sl.format.do_cast || !ml.format.do_cast ||
      sl.format.elements() != ml.format.elements()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "swa_pool and main_pool must be do_cast formats with the same "
        "elements (got ",
        sl.format.elements(), " and ", ml.format.elements(), ")"));
  }
  int64_t dtype_bytes = 0;
  absl::StatusOr<InputDtype> dtype =
      ToInputDtype("dtype", r.dtype(), &dtype_bytes);
  if (!dtype.ok()) return dtype.status();
  PrefillScratch& sc = ThreadPrefillScratch();
  const int64_t n = r.num_seqs();
  const int64_t max = options_.max_array_elements;
  if (n < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_seqs = ", n, " must be >= 1"));
  }
  absl::Status s =
      DecodeInt32s("seqlen_k", r.seqlen_k(), "num_seqs", n, max, &sc.seqlen_k);
  if (s.ok()) {
    s = DecodeInt32s("seqlen_q", r.seqlen_q(), "num_seqs", n, max,
                     &sc.seqlen_q);
  }
  if (s.ok()) {
    s = DecodeInt32s("swa_state_id", r.swa_state_id(), "num_seqs", n, max,
                     &sc.state_ids);
  }
  if (s.ok()) {
    s = DecodeInt32s("swa_valid_start", r.swa_valid_start(),
                     r.swa_valid_start().empty() ? "0 (empty)" : "num_seqs",
                     r.swa_valid_start().empty() ? 0 : n, max, &sc.valid_start);
  }
  if (s.ok() &&
      (r.max_blocks_per_seq() < 1 || r.max_blocks_per_seq() > INT32_MAX)) {
    s = absl::InvalidArgumentError(
        absl::StrCat("max_blocks_per_seq = ", r.max_blocks_per_seq(),
                     " is outside [1, 2^31)"));
  }
  if (s.ok()) {
    s = DecodeInt32s("block_table", r.block_table(),
                     "num_seqs * max_blocks_per_seq",
                     n * r.max_blocks_per_seq(), max, &sc.block_table);
  }
  if (!s.ok()) return s;
  absl::StatusOr<int32_t> ratio =
      CheckRatio("compress_ratio", r.compress_ratio(), ml);
  if (!ratio.ok()) return ratio.status();

  SequenceBatch batch;
  batch.seqlen_k = sc.seqlen_k;
  batch.seqlen_q = sc.seqlen_q;
  batch.state_ids = sc.state_ids;
  batch.swa_valid_start = sc.valid_start;
  batch.block_table = DenseTable(sc.block_table, n, r.max_blocks_per_seq());
  SwaParams swa_params;
  swa_params.window = r.window();
  swa_params.ring_size = static_cast<int32_t>(sl.block_size);
  swa_params.num_states = static_cast<int32_t>(sl.num_blocks);
  CompressedParams cparams;
  cparams.ratio = *ratio;
  cparams.block_size = static_cast<int32_t>(ml.block_size * *ratio);
  cparams.num_blocks = static_cast<int32_t>(ml.num_blocks);
  if (r.window() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("window = ", r.window(), " must be >= 1"));
  }
  if (s = ValidateSwaParams(swa_params); !s.ok()) return s;
  absl::StatusOr<PrefillLayout> pl =
      ComputePrefillLayout(batch, r.window(), *ratio);
  if (!pl.ok()) return pl.status();
  // The SWA plan, copied out: the builder is reused for the compressed plan.
  if (s = BuildSwaPlan(batch, swa_params, &sc.builder); !s.ok()) return s;
  const absl::Span<const int32_t> swa_plan = sc.builder.Finish();
  sc.swa_segments.assign(swa_plan.begin(), swa_plan.end());
  sc.store_slots.assign(static_cast<size_t>(pl->chunk_rows), -1);
  if (s = BuildSwaStoreSlots(batch, swa_params, absl::MakeSpan(sc.store_slots));
      !s.ok()) {
    return s;
  }
  if (s = ValidateSlotMapping(sl, sc.store_slots); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "swa_state_id: two sequences share a ring slot (SWA store ",
        s.message(), ")"));
  }
  sc.cu_compressed.assign(static_cast<size_t>(n + 1), 0);
  if (s = BuildCompressedPlan(batch, cparams, &sc.builder,
                              absl::MakeSpan(sc.cu_compressed));
      !s.ok()) {
    return s;
  }
  const absl::Span<const int32_t> main_plan = sc.builder.Finish();
  if (s = ValidateSegments(sl, sc.swa_segments, pl->swa_history_rows);
      !s.ok()) {
    return s;
  }
  if (s = ValidateSegments(ml, main_plan, pl->compressed_rows); !s.ok()) {
    return s;
  }
  const int64_t row_bytes = LoadDataRowBytes(ml.format);
  absl::StatusOr<ByteRange> kv = ResolveInput(
      *sessions_, "chunk_kv", r.chunk_kv(),
      int64_t{pl->chunk_rows} * ml.format.elements() * dtype_bytes);
  if (!kv.ok()) return kv.status();
  absl::StatusOr<ByteRange> output = ResolveOutput(
      *sessions_, "output", r.output(), int64_t{pl->total_rows} * row_bytes,
      options_.max_inline_bytes, out->mutable_output());
  if (!output.ok()) return output.status();
  if (s = CheckDisjoint("chunk_kv", *kv, "output", *output); !s.ok()) return s;
  out->set_total_k_swa(pl->swa_history_rows);
  out->set_chunk_offset(pl->swa_history_rows);
  out->set_main_kv_offset(pl->main_kv_offset);
  out->set_total_rows(pl->total_rows);
  out->set_swa_segments(static_cast<int64_t>(sc.swa_segments.size()) / 4);
  out->set_main_segments(static_cast<int64_t>(main_plan.size()) / 4);
  EncodeInt32s(sc.cu_compressed, out->mutable_cu_compressed());
  if (s = CheckAlive(ctx); !s.ok()) return s;

  // Lock both pools (once when they are the same), in address order.
  Pool* first = swa->get();
  Pool* second = main->get();
  const bool same = first == second;
  if (!same && second < first) std::swap(first, second);
  absl::MutexLock lock1(&first->mu);
  std::optional<absl::MutexLock> lock2;
  if (!same) lock2.emplace(&second->mu);

  uint8_t* base = output->data;
  if (s = backend_->Load(sl, *(*swa)->memory, r.swa_layer(), sc.swa_segments,
                         pl->swa_history_rows, base, nullptr);
      !s.ok()) {
    return s;
  }
  if (s = backend_->Load(
          ml, *(*main)->memory, r.main_layer(), main_plan, pl->compressed_rows,
          base + int64_t{pl->main_kv_offset} * row_bytes, nullptr);
      !s.ok()) {
    return s;
  }
  // CastBack runs on the host: the chunk and its output rows may be device
  // memory (CUDA backend), so it works on host copies.
  const int64_t chunk_out_bytes = int64_t{pl->chunk_rows} * row_bytes;
  sc.chunk_in.resize(static_cast<size_t>(kv->size));
  sc.chunk_out.resize(static_cast<size_t>(chunk_out_bytes));
  if (s = backend_->CopyBytes(sc.chunk_in.data(), kv->data, kv->size);
      !s.ok()) {
    return s;
  }
  CastBack(sl.format, sc.chunk_in.data(), *dtype, pl->chunk_rows,
           sc.chunk_out.data(), sc);
  if (s = backend_->CopyBytes(base + int64_t{pl->swa_history_rows} * row_bytes,
                              sc.chunk_out.data(), chunk_out_bytes);
      !s.ok()) {
    return s;
  }
  if (pl->chunk_rows == 0) return absl::OkStatus();
  return backend_->Store(sl, *(*swa)->memory, r.swa_layer(), kv->data, *dtype,
                         sc.store_slots);
}

}  // namespace kvdepot
