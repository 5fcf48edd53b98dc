// The layout handle and the CPU half of libkvdepot_kernels: the daemon's
// CPU engine (kernels/reference: Store, LoadSegments, FusedStore, exactly
// what server/cpu/cpu_backend.cc calls) and its planner (planner/: the
// index RPCs of server/service_index.cc and the plans of
// server/request_checks.cc), on the caller's host memory.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <exception>
#include <new>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "kernels/format_host.h"
#include "kernels/fused.h"
#include "kernels/reference/fused.h"
#include "kernels/reference/reference.h"
#include "kernels/store_load_host.h"
#include "libkvdepot/capi_internal.h"
#include "planner/plan.h"

namespace kvdepot::capi {
namespace {

absl::StatusOr<kvdk_layout*> NewLayout(absl::StatusOr<KVCacheFormat> format,
                                       int64_t block_size, int64_t num_blocks,
                                       int64_t num_layers) {
  if (!format.ok()) return format.status();
  RETURN_IF_ERROR(ValidateQuantization(*format));
  ASSIGN_OR_RETURN(PoolLayout layout,
                   MakePoolLayout(*format, block_size, num_blocks, num_layers));
  ASSIGN_OR_RETURN(std::string name, FormatName(*format));
  auto* out = new (std::nothrow) kvdk_layout{layout, std::move(name)};
  if (out == nullptr) return absl::ResourceExhaustedError("out of memory");
  return out;
}

absl::StatusOr<KVCacheFormat> FormatFromDesc(const kvdk_format_desc* d) {
  if (d == nullptr) return absl::InvalidArgumentError("desc is null");
  if (d->quantized_dtype < KVDK_QUANT_NONE ||
      d->quantized_dtype > KVDK_QUANT_E2M1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "desc.quantized_dtype = ", d->quantized_dtype, " is outside [0, 2]"));
  }
  if (d->sf_format < KVDK_SF_NONE || d->sf_format > KVDK_SF_FP32) {
    return absl::InvalidArgumentError(
        absl::StrCat("desc.sf_format = ", d->sf_format, " is outside [0, 3]"));
  }
  if (d->scale_rounding != KVDK_ROUNDING_NONE &&
      d->scale_rounding != KVDK_ROUNDING_POW2_CEIL) {
    return absl::InvalidArgumentError(absl::StrCat(
        "desc.scale_rounding = ", d->scale_rounding, " is outside [0, 1]"));
  }
  for (const auto& [name, v] :
       {std::pair<const char*, int32_t>{"do_cast", d->do_cast},
        {"token_interleaved", d->token_interleaved}}) {
    if (v != 0 && v != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("desc.", name, " = ", v, " is not 0 or 1"));
    }
  }
  return MakeFormat(static_cast<QuantDtype>(d->quantized_dtype),
                    d->quantized_elements, d->elements_per_sf, d->bf16_elements,
                    d->do_cast != 0, static_cast<ScaleFormat>(d->sf_format),
                    d->token_interleaved != 0,
                    static_cast<ScaleRounding>(d->scale_rounding));
}

absl::StatusOr<KVCacheFormat> FormatFromNameArg(const char* name,
                                                int32_t bf16_elements) {
  if (name == nullptr) return absl::InvalidArgumentError("format_name is null");
  std::string n(name);
  if (absl::EqualsIgnoreCase(n, "BF16")) {
    n = absl::StrCat("BF16(", bf16_elements, ")");
  } else if (bf16_elements != 0) {
    if (!absl::StartsWithIgnoreCase(n, "BF16(")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bf16_elements = ", bf16_elements,
          " is only allowed with format BF16 (got \"", n.substr(0, 64), "\")"));
    }
  }
  ASSIGN_OR_RETURN(KVCacheFormat f, FormatFromName(n));
  if (bf16_elements != 0 && f.bf16_elements != bf16_elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("bf16_elements = ", bf16_elements, " does not match \"",
                     n.substr(0, 64), "\""));
  }
  return f;
}

BlockTableView DenseTable(const int32_t* data, int64_t rows, int32_t cols,
                          int64_t stride) {
  BlockTableView v;
  if (cols == 0) stride = 0;  // nothing is read: data may be null
  // The last row needs only cols entries.
  v.data =
      absl::MakeConstSpan(data, rows == 0 ? 0 : (rows - 1) * stride + cols);
  v.num_rows = rows;
  v.num_cols = cols;
  v.row_stride = stride;
  return v;
}

absl::Status CopyPlan(const BlockLoadPlanBuilder& builder, int32_t* segments,
                      int64_t max_segments, int64_t* num_segments,
                      int64_t* total_k) {
  *num_segments = builder.num_segments();
  if (builder.num_segments() > max_segments) {
    return absl::OutOfRangeError(
        absl::StrCat("max_segments = ", max_segments, " is less than the ",
                     builder.num_segments(), " segments of the plan"));
  }
  *total_k = builder.total_k();
  const absl::Span<const int32_t> s = builder.segments();
  if (!s.empty()) std::memcpy(segments, s.data(), s.size() * sizeof(int32_t));
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvdepot::capi

using namespace kvdepot;        // NOLINT: the C entry points below
using namespace kvdepot::capi;  // NOLINT

extern "C" {

int kvdk_abi_version(void) { return KVDK_ABI_VERSION; }

const char* kvdk_last_error(void) { return LastError(); }

int kvdk_layout_create(const char* format_name, int32_t bf16_elements,
                       int64_t block_size, int64_t num_blocks,
                       int64_t num_layers, kvdk_layout** out) {
  return Guard("kvdk_layout_create", [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckNotNull(out, "out"));
    *out = nullptr;
    ASSIGN_OR_RETURN(kvdk_layout * l,
                     NewLayout(FormatFromNameArg(format_name, bf16_elements),
                               block_size, num_blocks, num_layers));
    *out = l;
    return absl::OkStatus();
  });
}

int kvdk_layout_create_desc(const kvdk_format_desc* desc, int64_t block_size,
                            int64_t num_blocks, int64_t num_layers,
                            kvdk_layout** out) {
  return Guard("kvdk_layout_create_desc", [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckNotNull(out, "out"));
    *out = nullptr;
    ASSIGN_OR_RETURN(
        kvdk_layout * l,
        NewLayout(FormatFromDesc(desc), block_size, num_blocks, num_layers));
    *out = l;
    return absl::OkStatus();
  });
}

void kvdk_layout_destroy(kvdk_layout* layout) { delete layout; }

static_assert(offsetof(kvdk_layout_info, tail_bytes) ==
              KVDK_LAYOUT_INFO_V1_BYTES);

int kvdk_layout_get_info(const kvdk_layout* layout, kvdk_layout_info* info,
                         int64_t info_size) {
  return Guard("kvdk_layout_get_info", [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckLayout(layout, "layout"));
    RETURN_IF_ERROR(CheckNotNull(info, "info"));
    if (info_size < KVDK_LAYOUT_INFO_V1_BYTES) {
      return absl::InvalidArgumentError(
          absl::StrCat("info_size = ", info_size, " is less than ",
                       KVDK_LAYOUT_INFO_V1_BYTES));
    }
    const PoolLayout& l = layout->layout;
    const KVCacheFormat& f = l.format;
    kvdk_layout_info o;
    o.quantized_dtype = static_cast<int64_t>(f.quantized_dtype);
    o.quantized_elements = f.quantized_elements;
    o.elements_per_sf = f.elements_per_sf;
    o.bf16_elements = f.bf16_elements;
    o.elements = f.elements();
    o.do_cast = f.do_cast ? 1 : 0;
    o.sf_format = static_cast<int64_t>(f.sf_format);
    o.token_interleaved = f.token_interleaved ? 1 : 0;
    o.scale_rounding = static_cast<int64_t>(f.scale_rounding);
    o.data_bytes = f.data_bytes();
    o.sf_bytes = f.sf_bytes();
    o.bytes_per_token = f.bytes_per_token();
    o.block_size = l.block_size;
    o.num_blocks = l.num_blocks;
    o.num_layers = l.num_layers;
    o.block_stride = l.block_stride;
    o.layer_bytes = l.layer_bytes;
    o.layer_stride = l.layer_stride;
    o.total_bytes = l.total_bytes;
    o.load_data_row_bytes = LoadDataRowBytes(f);
    o.load_scale_row_bytes = LoadScaleRowBytes(f);
    o.num_slots = l.num_slots();
    o.tail_bytes = f.tail_bytes();
    // A caller built against the shorter struct: its bytes only.
    std::memcpy(info, &o,
                static_cast<size_t>(std::min<int64_t>(info_size, sizeof(o))));
    return absl::OkStatus();
  });
}

int kvdk_layout_format_name(const kvdk_layout* layout, char* buf,
                            int64_t capacity) {
  return Guard("kvdk_layout_format_name", [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckLayout(layout, "layout"));
    RETURN_IF_ERROR(CheckNotNull(buf, "buf"));
    const std::string& n = layout->name;
    if (capacity < static_cast<int64_t>(n.size()) + 1) {
      return absl::OutOfRangeError(absl::StrCat(
          "capacity = ", capacity, " is less than ", n.size() + 1));
    }
    std::memcpy(buf, n.c_str(), n.size() + 1);
    return absl::OkStatus();
  });
}

int kvdk_store_cpu(const kvdk_layout* layout, void* pool, int64_t pool_bytes,
                   int64_t layer, const void* kv, int32_t dtype,
                   const int32_t* slot_mapping, int64_t num_tokens) {
  return Guard("kvdk_store_cpu", [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckLayout(layout, "layout"));
    const PoolLayout& l = layout->layout;
    RETURN_IF_ERROR(CheckPool(l, pool, pool_bytes, layer));
    RETURN_IF_ERROR(CheckDtype(l.format, dtype));
    RETURN_IF_ERROR(CheckCount(num_tokens, "num_tokens"));
    if (num_tokens > 0) {
      RETURN_IF_ERROR(CheckNotNull(kv, "kv"));
      RETURN_IF_ERROR(CheckNotNull(slot_mapping, "slot_mapping"));
    }
    // The engine validates the slots (range, duplicates) before writing.
    return Store(l, LayerBase(l, pool, layer), kv,
                 static_cast<InputDtype>(dtype),
                 absl::MakeConstSpan(slot_mapping, num_tokens));
  });
}

int kvdk_load_cpu(const kvdk_layout* layout, const void* pool,
                  int64_t pool_bytes, int64_t layer, const int32_t* segments,
                  int64_t num_segments, int64_t total_k, void* data,
                  int64_t data_bytes, void* scales, int64_t scales_bytes) {
  return Guard("kvdk_load_cpu", [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckLayout(layout, "layout"));
    const PoolLayout& l = layout->layout;
    RETURN_IF_ERROR(CheckPool(l, pool, pool_bytes, layer));
    RETURN_IF_ERROR(CheckCount(num_segments, "num_segments", INT32_MAX / 4));
    RETURN_IF_ERROR(CheckCount(total_k, "total_k"));
    if (num_segments > 0) RETURN_IF_ERROR(CheckNotNull(segments, "segments"));
    RETURN_IF_ERROR(CheckOutput(data, data_bytes, total_k,
                                LoadDataRowBytes(l.format), "data"));
    RETURN_IF_ERROR(CheckOutput(scales, scales_bytes, total_k,
                                LoadScaleRowBytes(l.format), "scales"));
    return LoadSegments(l, LayerBase(l, pool, layer),
                        absl::MakeConstSpan(segments, 4 * num_segments),
                        total_k, data, scales);
  });
}

int kvdk_fused_store_cpu(const kvdk_layout* layout, void* pool,
                         int64_t pool_bytes, int64_t layer, const uint16_t* kv,
                         const kvdk_fused_params* params,
                         const int32_t* slot_mapping, int64_t num_tokens,
                         uint16_t* cast_back) {
  return Guard("kvdk_fused_store_cpu", [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckLayout(layout, "layout"));
    const PoolLayout& l = layout->layout;
    RETURN_IF_ERROR(CheckPool(l, pool, pool_bytes, layer));
    FusedParams p;
    RETURN_IF_ERROR(ToFusedParams(params, &p));
    RETURN_IF_ERROR(CheckCount(num_tokens, "num_tokens"));
    if (num_tokens > 0) {
      RETURN_IF_ERROR(CheckNotNull(kv, "kv"));
      RETURN_IF_ERROR(CheckNotNull(slot_mapping, "slot_mapping"));
    }
    // The engine checks the parameters, positions and slots first.
    return FusedStore(l, LayerBase(l, pool, layer), kv, p,
                      absl::MakeConstSpan(slot_mapping, num_tokens), cast_back);
  });
}

int kvdk_build_compressed_plan(const kvdk_layout* layout, int32_t ratio,
                               const int32_t* seqlen_k, int64_t num_seqs,
                               const int32_t* block_table,
                               int32_t max_blocks_per_seq, int32_t* segments,
                               int64_t max_segments, int64_t* num_segments,
                               int64_t* total_k, int32_t* cu_rows) {
  return Guard("kvdk_build_compressed_plan", [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckLayout(layout, "layout"));
    const PoolLayout& l = layout->layout;
    RETURN_IF_ERROR(CheckNotNull(num_segments, "num_segments"));
    RETURN_IF_ERROR(CheckNotNull(total_k, "total_k"));
    *num_segments = 0;
    *total_k = 0;
    if (ratio < 1 || l.block_size * ratio > INT32_MAX ||
        l.num_blocks > INT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ratio = ", ratio, " must be >= 1 with block_size * ratio < 2^31"));
    }
    RETURN_IF_ERROR(CheckCount(num_seqs, "num_seqs"));
    RETURN_IF_ERROR(CheckCount(max_blocks_per_seq, "max_blocks_per_seq"));
    RETURN_IF_ERROR(CheckCount(max_segments, "max_segments", INT32_MAX / 4));
    if (num_seqs > 0) {
      RETURN_IF_ERROR(CheckNotNull(seqlen_k, "seqlen_k"));
      if (max_blocks_per_seq > 0) {
        RETURN_IF_ERROR(CheckNotNull(block_table, "block_table"));
      }
    }
    if (max_segments > 0) RETURN_IF_ERROR(CheckNotNull(segments, "segments"));
    CompressedParams params;
    params.ratio = ratio;
    params.block_size = static_cast<int32_t>(l.block_size * ratio);
    params.num_blocks = static_cast<int32_t>(l.num_blocks);
    SequenceBatch batch;
    batch.seqlen_k = absl::MakeConstSpan(seqlen_k, num_seqs);
    batch.block_table = DenseTable(block_table, num_seqs, max_blocks_per_seq,
                                   max_blocks_per_seq);
    std::vector<int32_t> cu(static_cast<size_t>(num_seqs) + 1, 0);
    BlockLoadPlanBuilder builder(static_cast<int32_t>(l.block_size),
                                 static_cast<int32_t>(l.num_blocks));
    RETURN_IF_ERROR(
        BuildCompressedPlan(batch, params, &builder, absl::MakeSpan(cu)));
    RETURN_IF_ERROR(
        CopyPlan(builder, segments, max_segments, num_segments, total_k));
    if (cu_rows != nullptr) {
      std::memcpy(cu_rows, cu.data(), cu.size() * sizeof(int32_t));
    }
    return absl::OkStatus();
  });
}

int kvdk_build_swa_plan(const kvdk_layout* ring, int32_t window,
                        const int32_t* seqlen_k, const int32_t* seqlen_q,
                        const int32_t* state_ids,
                        const int32_t* swa_valid_start, int64_t num_seqs,
                        int32_t* segments, int64_t max_segments,
                        int64_t* num_segments, int64_t* total_k) {
  return Guard("kvdk_build_swa_plan", [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckLayout(ring, "ring"));
    const PoolLayout& l = ring->layout;
    RETURN_IF_ERROR(CheckNotNull(num_segments, "num_segments"));
    RETURN_IF_ERROR(CheckNotNull(total_k, "total_k"));
    *num_segments = 0;
    *total_k = 0;
    if (l.block_size > INT32_MAX || l.num_blocks > INT32_MAX) {
      return absl::InvalidArgumentError(
          "ring: block_size and num_blocks must be < 2^31");
    }
    RETURN_IF_ERROR(CheckCount(num_seqs, "num_seqs"));
    RETURN_IF_ERROR(CheckCount(max_segments, "max_segments", INT32_MAX / 4));
    if (num_seqs > 0) {
      RETURN_IF_ERROR(CheckNotNull(seqlen_k, "seqlen_k"));
      RETURN_IF_ERROR(CheckNotNull(seqlen_q, "seqlen_q"));
      RETURN_IF_ERROR(CheckNotNull(state_ids, "state_ids"));
    }
    if (max_segments > 0) RETURN_IF_ERROR(CheckNotNull(segments, "segments"));
    SwaParams params;
    params.window = window;
    params.ring_size = static_cast<int32_t>(l.block_size);
    params.num_states = static_cast<int32_t>(l.num_blocks);
    RETURN_IF_ERROR(ValidateSwaParams(params));
    SequenceBatch batch;
    batch.seqlen_k = absl::MakeConstSpan(seqlen_k, num_seqs);
    batch.seqlen_q = absl::MakeConstSpan(seqlen_q, num_seqs);
    batch.state_ids = absl::MakeConstSpan(state_ids, num_seqs);
    if (swa_valid_start != nullptr) {
      batch.swa_valid_start = absl::MakeConstSpan(swa_valid_start, num_seqs);
    }
    BlockLoadPlanBuilder builder(params.ring_size, params.num_states);
    RETURN_IF_ERROR(BuildSwaPlan(batch, params, &builder));
    return CopyPlan(builder, segments, max_segments, num_segments, total_k);
  });
}

int kvdk_convert_topk_cpu(const kvdk_layout* layout, int32_t* topk,
                          int64_t num_seqs, int32_t k,
                          const int32_t* valid_count, const int32_t* num_tokens,
                          const int32_t* block_table,
                          int32_t max_blocks_per_seq, int64_t row_stride,
                          int64_t* invalid_count) {
  return Guard("kvdk_convert_topk_cpu", [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckLayout(layout, "layout"));
    const PoolLayout& l = layout->layout;
    if (l.block_size > INT32_MAX || l.num_blocks > INT32_MAX) {
      return absl::InvalidArgumentError(
          "layout: block_size and num_blocks must be < 2^31");
    }
    RETURN_IF_ERROR(CheckCount(num_seqs, "num_seqs"));
    RETURN_IF_ERROR(CheckCount(k, "k"));
    RETURN_IF_ERROR(CheckCount(max_blocks_per_seq, "max_blocks_per_seq"));
    if (row_stride < max_blocks_per_seq) {
      return absl::InvalidArgumentError(absl::StrCat(
          "row_stride = ", row_stride,
          " is less than max_blocks_per_seq = ", max_blocks_per_seq));
    }
    // (num_seqs - 1) * row_stride < 2^62: no overflow below.
    if (row_stride > INT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("row_stride = ", row_stride, " exceeds 2^31 - 1"));
    }
    if (num_seqs > 0) {
      if (k > 0) RETURN_IF_ERROR(CheckNotNull(topk, "topk"));
      RETURN_IF_ERROR(CheckNotNull(valid_count, "valid_count"));
      RETURN_IF_ERROR(CheckNotNull(num_tokens, "num_tokens"));
      if (max_blocks_per_seq > 0) {
        RETURN_IF_ERROR(CheckNotNull(block_table, "block_table"));
      }
    }
    if (invalid_count != nullptr) *invalid_count = 0;
    ASSIGN_OR_RETURN(int64_t invalid,
                     ConvertTopk(absl::MakeSpan(topk, num_seqs * k), k,
                                 absl::MakeConstSpan(valid_count, num_seqs),
                                 absl::MakeConstSpan(num_tokens, num_seqs),
                                 DenseTable(block_table, num_seqs,
                                            max_blocks_per_seq, row_stride),
                                 static_cast<int32_t>(l.block_size),
                                 static_cast<int32_t>(l.num_blocks)));
    if (invalid_count != nullptr) *invalid_count = invalid;
    return absl::OkStatus();
  });
}

int kvdk_swa_decode_index_cpu(const kvdk_layout* ring, const int32_t* state_ids,
                              const int32_t* starts, const int32_t* valid_lens,
                              int64_t n, int32_t window, int32_t* out) {
  return Guard("kvdk_swa_decode_index_cpu", [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckLayout(ring, "ring"));
    const PoolLayout& l = ring->layout;
    if (l.block_size > INT32_MAX || l.num_blocks > INT32_MAX) {
      return absl::InvalidArgumentError(
          "ring: block_size and num_blocks must be < 2^31");
    }
    RETURN_IF_ERROR(CheckCount(n, "n"));
    SwaParams params;
    params.window = window;
    params.ring_size = static_cast<int32_t>(l.block_size);
    params.num_states = static_cast<int32_t>(l.num_blocks);
    RETURN_IF_ERROR(ValidateSwaParams(params));
    if (n > INT32_MAX / window) {
      return absl::InvalidArgumentError(absl::StrCat(
          "n * window = ", n * window, " exceeds 2^31 - 1 entries"));
    }
    if (n > 0) {
      RETURN_IF_ERROR(CheckNotNull(state_ids, "state_ids"));
      RETURN_IF_ERROR(CheckNotNull(starts, "starts"));
      RETURN_IF_ERROR(CheckNotNull(valid_lens, "valid_lens"));
      RETURN_IF_ERROR(CheckNotNull(out, "out"));
    }
    return ExpandSwaDecodeIndex(absl::MakeConstSpan(state_ids, n),
                                absl::MakeConstSpan(starts, n),
                                absl::MakeConstSpan(valid_lens, n), params,
                                absl::MakeSpan(out, n * window));
  });
}

int kvdk_expand_swa_index_cpu(const int32_t* pivots, int64_t rows,
                              int32_t width, int32_t num_kv_rows,
                              int32_t* out) {
  return Guard("kvdk_expand_swa_index_cpu", [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckCount(rows, "rows"));
    RETURN_IF_ERROR(CheckCount(width, "width"));
    RETURN_IF_ERROR(CheckCount(num_kv_rows, "num_kv_rows"));
    if (width > 0 && rows > INT32_MAX / width) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rows * width = ", rows * width, " exceeds 2^31 - 1 entries"));
    }
    if (rows > 0) RETURN_IF_ERROR(CheckNotNull(pivots, "pivots"));
    if (rows > 0 && width > 0) RETURN_IF_ERROR(CheckNotNull(out, "out"));
    return ExpandSwaIndex(absl::MakeConstSpan(pivots, 4 * rows), width,
                          num_kv_rows, absl::MakeSpan(out, rows * width));
  });
}

int kvdk_kv_index_cat_cpu(const int32_t* swa, int32_t swa_width,
                          const int32_t* compressed, int32_t compressed_width,
                          int64_t rows, int32_t main_kv_offset,
                          int32_t compressed_rows, int32_t* out) {
  return Guard("kvdk_kv_index_cat_cpu", [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckCount(rows, "rows"));
    RETURN_IF_ERROR(CheckCount(swa_width, "swa_width"));
    RETURN_IF_ERROR(CheckCount(compressed_width, "compressed_width"));
    const int64_t width = int64_t{swa_width} + compressed_width;
    if (width > INT32_MAX || (width > 0 && rows > INT32_MAX / width)) {
      return absl::InvalidArgumentError(
          absl::StrCat("rows * (swa_width + compressed_width) = ", rows * width,
                       " exceeds 2^31 - 1 entries"));
    }
    if (rows > 0 && swa_width > 0) RETURN_IF_ERROR(CheckNotNull(swa, "swa"));
    if (rows > 0 && compressed_width > 0) {
      RETURN_IF_ERROR(CheckNotNull(compressed, "compressed"));
    }
    if (rows > 0 && width > 0) RETURN_IF_ERROR(CheckNotNull(out, "out"));
    return KvIndexCat(absl::MakeConstSpan(swa, rows * swa_width), swa_width,
                      absl::MakeConstSpan(compressed, rows * compressed_width),
                      compressed_width, rows, main_kv_offset, compressed_rows,
                      absl::MakeSpan(out, rows * width));
  });
}

}  // extern "C"
