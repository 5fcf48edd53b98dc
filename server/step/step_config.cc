#include "server/step/step_config.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kernels/fused_host.h"
#include "kernels/store_load_host.h"
#include "proto/step_doorbell.h"

namespace kvdepot::step {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

absl::Status CheckBound(absl::string_view field, int64_t value, int64_t lo,
                        int64_t hi) {
  if (value < lo || value > hi) {
    return Invalid(field,
                   absl::StrCat(value, " is outside [", lo, ", ", hi, "]"));
  }
  return absl::OkStatus();
}

// Everything must live on one device.
absl::Status SameDevice(absl::string_view field, const std::string& device,
                        const std::string& expected) {
  if (device != expected) {
    return Invalid(field, absl::StrCat("lives on ", device,
                                       " but the doorbell on ", expected));
  }
  return absl::OkStatus();
}

// Resolves a buffer range of `rows` rows of `row_bytes` bytes each.
// row_stride 0 = packed (row_bytes). `packed_only`: the stride must be
// row_bytes (the store kernels read packed rows).
absl::StatusOr<BufferSpan> ResolveSpan(absl::string_view field,
                                       const v1::StepBufferRef& ref,
                                       int64_t rows, int64_t row_bytes,
                                       int64_t alignment, bool packed_only,
                                       const Caller& caller,
                                       const SessionManager& sessions,
                                       const std::string& device) {
  BufferSpan span;
  ASSIGN_OR_RETURN(span.buffer,
                   sessions.GetBuffer(caller, absl::StrCat(field, ".buffer_id"),
                                      ref.buffer_id()));
  const int64_t size = span.buffer->memory->size();
  RETURN_IF_ERROR(SameDevice(field, span.buffer->memory->device(), device));
  span.offset = ref.offset();
  span.row_stride = ref.row_stride() == 0 ? row_bytes : ref.row_stride();
  if (span.offset < 0 || span.offset > size) {
    return Invalid(
        absl::StrCat(field, ".offset"),
        absl::StrCat(span.offset, " is outside the buffer's ", size, " bytes"));
  }
  if (span.offset % alignment != 0) {
    return Invalid(
        absl::StrCat(field, ".offset"),
        absl::StrCat(span.offset, " is not a multiple of ", alignment));
  }
  if (packed_only && span.row_stride != row_bytes) {
    return Invalid(absl::StrCat(field, ".row_stride"),
                   absl::StrCat(span.row_stride, " must be 0 or ", row_bytes,
                                " (packed rows)"));
  }
  if (span.row_stride < row_bytes || span.row_stride > (int64_t{1} << 30) ||
      span.row_stride % alignment != 0) {
    return Invalid(absl::StrCat(field, ".row_stride"),
                   absl::StrCat(span.row_stride, " must be a multiple of ",
                                alignment, " in [", row_bytes, ", 2^30]"));
  }
  // rows <= 2^16, stride <= 2^30: no overflow.
  const int64_t need = (rows - 1) * span.row_stride + row_bytes;
  if (need > size - span.offset) {
    return Invalid(field,
                   absl::StrCat(rows, " rows of ", row_bytes, " bytes every ",
                                span.row_stride, " from offset ", span.offset,
                                " pass the buffer's ", size, " bytes"));
  }
  return span;
}

absl::StatusOr<std::shared_ptr<const FusedCacheConfig>> ResolveFused(
    absl::string_view field, const v1::StepFused& in, const PoolLayout& layout);

absl::StatusOr<CacheConfig> ResolveCache(absl::string_view field,
                                         const v1::StepCache& c,
                                         const RegistrationConfig& config,
                                         const Caller& caller,
                                         const PoolRegistry& pools,
                                         const SessionManager& sessions) {
  CacheConfig cache;
  ASSIGN_OR_RETURN(cache.pool,
                   pools.Get(absl::StrCat(field, ".pool"), c.pool()));
  RETURN_IF_ERROR(cache.pool->CheckUse(caller, absl::StrCat(field, ".pool")));
  RETURN_IF_ERROR(SameDevice(absl::StrCat(field, ".pool"), cache.pool->device,
                             config.device));
  cache.layout = cache.pool->layout;
  RETURN_IF_ERROR(CheckBound(absl::StrCat(field, ".layer"), c.layer(), 0,
                             cache.layout.num_layers - 1));
  cache.layer = c.layer();
  if (absl::Status s =
          ValidateInputDtype(cache.layout.format, InputDtype::kBF16);
      !s.ok()) {
    return Invalid(absl::StrCat(field, ".pool"), s.message());
  }
  {
    absl::ReaderMutexLock lock(&cache.pool->mu);
    cache.layer_base =
        cache.pool->memory->data() + cache.layout.layer_offset(cache.layer);
  }
  const int64_t row_bytes = int64_t{2} * cache.layout.format.elements();
  ASSIGN_OR_RETURN(
      cache.input,
      ResolveSpan(absl::StrCat(field, ".input"), c.input(), config.max_tokens,
                  row_bytes, 16,
                  /*packed_only=*/true, caller, sessions, config.device));
  if (c.has_fused()) {
    ASSIGN_OR_RETURN(cache.fused, ResolveFused(absl::StrCat(field, ".fused"),
                                               c.fused(), cache.layout));
  }
  return cache;
}

// The fused-store parameters of cache `field` (SPEC §8), on the host.
absl::StatusOr<std::shared_ptr<const FusedCacheConfig>> ResolveFused(
    absl::string_view field, const v1::StepFused& in,
    const PoolLayout& layout) {
  auto out = std::make_shared<FusedCacheConfig>();
  FusedParams& p = out->params;
  p.norm_begin = in.norm_begin();
  p.norm_end = in.norm_end();
  p.eps = in.eps();
  p.rope_offset = in.rope_offset();
  p.rope_dim = in.rope_dim();
  p.hadamard_begin = in.hadamard_begin();
  p.hadamard_len = in.hadamard_len();
  switch (in.rope_style()) {
    case 0:
      p.rope = RopeStyle::kNone;
      break;
    case 1:
      p.rope = RopeStyle::kNeox;
      break;
    case 2:
      p.rope = RopeStyle::kInterleaved;
      break;
    default:
      return Invalid(absl::StrCat(field, ".rope_style"),
                     absl::StrCat(in.rope_style(),
                                  " is not 0 (none), 1 (NeoX) or 2 "
                                  "(interleaved)"));
  }
  if (absl::Status s = ValidateQuantization(layout.format); !s.ok()) {
    return Invalid(absl::StrCat(field, " (pool format)"), s.message());
  }
  // Array sizes before ValidateFused reads the ranges through them.
  const int64_t norm_len = int64_t{p.norm_end} - p.norm_begin;
  const int64_t weight_bytes = p.norm_end > p.norm_begin ? 2 * norm_len : 0;
  if (static_cast<int64_t>(in.norm_weight().size()) != weight_bytes) {
    return Invalid(
        absl::StrCat(field, ".norm_weight"),
        absl::StrCat(in.norm_weight().size(), " bytes; the norm range needs ",
                     weight_bytes, " (BF16 [norm_end - norm_begin])"));
  }
  out->norm_weight.resize(static_cast<size_t>(weight_bytes / 2));
  if (weight_bytes > 0) {
    std::memcpy(out->norm_weight.data(), in.norm_weight().data(),
                static_cast<size_t>(weight_bytes));
  }
  p.norm_weight = out->norm_weight.data();
  if (p.rope != RopeStyle::kNone) {
    if (p.rope_dim < 2 || p.rope_dim > kFusedMaxElements) {
      return Invalid(
          absl::StrCat(field, ".rope_dim"),
          absl::StrCat(p.rope_dim, " is outside [2, ", kFusedMaxElements, "]"));
    }
    const int64_t row = int64_t{4} * p.rope_dim;
    const int64_t bytes = static_cast<int64_t>(in.cos_sin().size());
    if (bytes == 0 || bytes % row != 0 || bytes / 4 > kMaxCosSinEntries) {
      return Invalid(
          absl::StrCat(field, ".cos_sin"),
          absl::StrCat(bytes, " bytes; need a positive multiple of ", row,
                       " (fp32 [max_position][rope_dim]) of at most ",
                       kMaxCosSinEntries, " values"));
    }
    p.max_position = bytes / row;
    out->cos_sin.resize(static_cast<size_t>(bytes / 4));
    std::memcpy(out->cos_sin.data(), in.cos_sin().data(),
                static_cast<size_t>(bytes));
    p.cos_sin = out->cos_sin.data();
  } else if (!in.cos_sin().empty()) {
    return Invalid(absl::StrCat(field, ".cos_sin"),
                   "set without RoPE (rope_style 0)");
  }
  if (absl::Status s = ValidateFused(layout.format, p, {}); !s.ok()) {
    return Invalid(field, s.message());
  }
  return std::shared_ptr<const FusedCacheConfig>(std::move(out));
}

}  // namespace

uint8_t* BufferSpan::data() const { return buffer->memory->data() + offset; }

absl::StatusOr<RegistrationConfig> ResolveRegistration(
    const v1::RegisterWorkerRequest& r, const Caller& caller,
    const PoolRegistry& pools, const SessionManager& sessions) {
  RETURN_IF_ERROR(RequireSession(caller));
  RegistrationConfig config;
  if (r.name().size() > kMaxNameBytes) {
    return Invalid("name", absl::StrCat(r.name().size(), " bytes; at most ",
                                        kMaxNameBytes));
  }
  config.name = r.name();
  RETURN_IF_ERROR(
      CheckBound("layers size", r.layers_size(), 1, doorbell::kMaxLayers));
  RETURN_IF_ERROR(CheckBound("max_tokens", r.max_tokens(), 1, kMaxTokens));
  RETURN_IF_ERROR(CheckBound("max_seqs", r.max_seqs(), 1,
                             std::min(kMaxSeqs, r.max_tokens())));
  RETURN_IF_ERROR(CheckBound("max_top_k", r.max_top_k(), 0, kMaxTopK));
  RETURN_IF_ERROR(CheckBound("max_blocks_per_seq", r.max_blocks_per_seq(), 0,
                             kMaxBlocksPerSeq));
  config.max_tokens = r.max_tokens();
  config.max_seqs = r.max_seqs();
  config.max_top_k = r.max_top_k();
  config.max_blocks_per_seq = r.max_blocks_per_seq();

  // The doorbell: a buffer of the caller's own session.
  ASSIGN_OR_RETURN(
      config.doorbell,
      sessions.GetBuffer(caller, "doorbell_buffer_id", r.doorbell_buffer_id()));
  if (config.doorbell->owner_session != caller.session) {
    return absl::PermissionDeniedError(
        "doorbell_buffer_id: the doorbell must be a buffer of the "
        "registering session");
  }
  config.device = config.doorbell->memory->device();
  config.doorbell_bytes = doorbell::RegionBytes(r.layers_size());
  if (config.doorbell->memory->size() < config.doorbell_bytes) {
    return Invalid(
        "doorbell_buffer_id",
        absl::StrCat("the buffer has ", config.doorbell->memory->size(),
                     " bytes; ", r.layers_size(), " layers need ",
                     config.doorbell_bytes));
  }

  for (int i = 0; i < r.layers_size(); ++i) {
    const v1::StepLayer& in = r.layers(i);
    const std::string f = absl::StrCat("layers[", i, "]");
    LayerConfig layer;
    RETURN_IF_ERROR(CheckBound(absl::StrCat(f, ".ratio"),
                               in.ratio() == 0 ? 1 : in.ratio(), 1, 1 << 16));
    layer.ratio = in.ratio() == 0 ? 1 : in.ratio();
    RETURN_IF_ERROR(
        CheckBound(absl::StrCat(f, ".window"), in.window(), 0, 1 << 20));
    layer.window = in.window();
    if (in.has_main()) {
      ASSIGN_OR_RETURN(layer.main,
                       ResolveCache(absl::StrCat(f, ".main"), in.main(), config,
                                    caller, pools, sessions));
    }
    if (in.has_swa()) {
      ASSIGN_OR_RETURN(layer.swa,
                       ResolveCache(absl::StrCat(f, ".swa"), in.swa(), config,
                                    caller, pools, sessions));
      const int32_t ring = static_cast<int32_t>(layer.swa.layout.block_size);
      const int32_t states = static_cast<int32_t>(layer.swa.layout.num_blocks);
      // window 0 = the layer has no SWA part (SPEC §6, as PrefillLoad).
      if (layer.window < 1 || layer.window > ring) {
        return Invalid(absl::StrCat(f, ".window"),
                       absl::StrCat(layer.window, " is outside [1, ", ring,
                                    "] (the SWA ring); a layer without an "
                                    "SWA part (window 0) has no swa cache"));
      }
      if (config.swa_ring_size != 0 && config.swa_ring_size != ring) {
        return Invalid(absl::StrCat(f, ".swa.pool"),
                       absl::StrCat("ring size (block_size) ", ring,
                                    " differs from the other SWA caches' ",
                                    config.swa_ring_size));
      }
      config.swa_ring_size = ring;
      config.swa_num_states = config.swa_num_states == 0
                                  ? states
                                  : std::min(config.swa_num_states, states);
      config.needs_swa_states = true;
    }
    if (in.has_index()) {
      ASSIGN_OR_RETURN(layer.index,
                       ResolveCache(absl::StrCat(f, ".index"), in.index(),
                                    config, caller, pools, sessions));
    }
    // Main and index caches of a layer of ratio > 1 store compressed rows
    // from the step's compressed slot mapping of that ratio: a token that
    // completes no row has -1 there. Which tokens complete a row depends
    // on the ratio, so each distinct ratio has its own mapping.
    if (layer.ratio > 1 && (layer.main.set() || layer.index.set())) {
      std::vector<int32_t>& ratios = config.compressed_ratios;
      if (std::find(ratios.begin(), ratios.end(), layer.ratio) ==
          ratios.end()) {
        if (static_cast<int>(ratios.size()) >= kMaxCompressedRatios) {
          return Invalid(
              absl::StrCat(f, ".ratio"),
              absl::StrCat(layer.ratio, " would be distinct compressed ratio ",
                           kMaxCompressedRatios + 1, " (earlier layers have ",
                           absl::StrJoin(ratios, ", "), "); at most ",
                           kMaxCompressedRatios,
                           " ratios > 1 with a main or index cache"));
        }
        ratios.push_back(layer.ratio);
      }
    }
    if (in.has_topk() != in.has_index_out()) {
      return Invalid(f, "topk and index_out are set together or not at all");
    }
    if (in.has_topk()) {
      if (!layer.index.set()) {
        return Invalid(absl::StrCat(f, ".topk"),
                       "phase B converts into the layer's index cache; set "
                       "index");
      }
      if (config.max_top_k < 1 || config.max_blocks_per_seq < 1) {
        return Invalid(absl::StrCat(f, ".topk"),
                       "needs max_top_k >= 1 and max_blocks_per_seq >= 1");
      }
      const int64_t row = int64_t{4} * config.max_top_k;
      ASSIGN_OR_RETURN(
          layer.topk,
          ResolveSpan(absl::StrCat(f, ".topk"), in.topk(), config.max_tokens,
                      row, 4, false, caller, sessions, config.device));
      ASSIGN_OR_RETURN(layer.index_out,
                       ResolveSpan(absl::StrCat(f, ".index_out"),
                                   in.index_out(), config.max_tokens, row, 4,
                                   false, caller, sessions, config.device));
      config.needs_block_tables = true;
    }
    for (const CacheConfig* c : {&layer.main, &layer.swa, &layer.index}) {
      if (c->fused == nullptr || c->fused->params.rope == RopeStyle::kNone) {
        continue;
      }
      const int64_t m = c->fused->params.max_position;
      config.max_position =
          config.max_position == 0 ? m : std::min(config.max_position, m);
    }
    config.layers.push_back(std::move(layer));
  }
  // Ascending ratios; each compressed layer names its ratio's index.
  std::sort(config.compressed_ratios.begin(), config.compressed_ratios.end());
  for (LayerConfig& l : config.layers) {
    if (l.ratio > 1 && (l.main.set() || l.index.set())) {
      l.compressed = static_cast<int32_t>(
          std::lower_bound(config.compressed_ratios.begin(),
                           config.compressed_ratios.end(), l.ratio) -
          config.compressed_ratios.begin());
    }
  }

  if (r.has_block_tables()) {
    // Device-resident block tables: the kernel reads rows [0, num_seqs),
    // columns [0, block_table_cols) of them, so max_seqs rows of
    // max_blocks_per_seq entries must lie inside the buffer.
    if (!config.needs_block_tables) {
      return Invalid("block_tables",
                     "set, but no layer of this registration has phase B "
                     "(topk), the only reader of block tables");
    }
    ASSIGN_OR_RETURN(
        config.block_tables,
        ResolveSpan("block_tables", r.block_tables(), config.max_seqs,
                    int64_t{4} * config.max_blocks_per_seq, 4,
                    /*packed_only=*/false, caller, sessions, config.device));
  }

  if (r.has_slot_mappings()) {
    // Device-resident slot mappings: the import kernel reads entries [0,
    // num_tokens) of row 0 (slot_mapping) and of row 1 + k (compressed
    // ratio k), so that many rows of max_tokens entries must fit.
    const int64_t rows =
        1 + static_cast<int64_t>(config.compressed_ratios.size());
    ASSIGN_OR_RETURN(
        config.slot_mappings,
        ResolveSpan("slot_mappings", r.slot_mappings(), rows,
                    int64_t{4} * config.max_tokens, 4,
                    /*packed_only=*/false, caller, sessions, config.device));
  }

  if (r.has_swa_index()) {
    const v1::StepSwaIndex& s = r.swa_index();
    SwaIndexConfig& out = config.swa_index;
    ASSIGN_OR_RETURN(out.pool, pools.Get("swa_index.pool", s.pool()));
    RETURN_IF_ERROR(out.pool->CheckUse(caller, "swa_index.pool"));
    out.ring_size = static_cast<int32_t>(out.pool->layout.block_size);
    out.num_states = static_cast<int32_t>(out.pool->layout.num_blocks);
    RETURN_IF_ERROR(
        CheckBound("swa_index.window", s.window(), 1, out.ring_size));
    out.window = s.window();
    if (config.swa_ring_size != 0 && config.swa_ring_size != out.ring_size) {
      return Invalid(
          "swa_index.pool",
          absl::StrCat("ring size ", out.ring_size,
                       " differs from the SWA caches' ", config.swa_ring_size));
    }
    config.swa_ring_size = out.ring_size;
    config.swa_num_states =
        config.swa_num_states == 0
            ? out.num_states
            : std::min(config.swa_num_states, out.num_states);
    ASSIGN_OR_RETURN(out.out,
                     ResolveSpan("swa_index.out", s.out(), config.max_tokens,
                                 int64_t{4} * out.window, 4, false, caller,
                                 sessions, config.device));
    config.needs_swa_states = true;
  }
  return config;
}

}  // namespace kvdepot::step
