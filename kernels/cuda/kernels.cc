#include "kernels/cuda/kernels.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_status.h"
#include "common/status_macros.h"
#include "kernels/cuda/launch_internal.h"
#include "kernels/format_host.h"
#include "kernels/named_formats.h"
#include "kernels/store_load.h"
#include "kernels/store_load_host.h"

namespace kvdepot::gpu {
namespace {

internal::Launch ToLaunch(const LaunchOptions& options) {
  return {static_cast<cudaStream_t>(options.stream), options.pdl};
}

absl::StatusOr<FormatId> FormatIdOf(const KVCacheFormat& format) {
  const std::optional<FormatId> id = IdentifyFormat(format);
  if (!id.has_value()) {
    return absl::InvalidArgumentError(
        "format is not one of the supported formats (SPEC §2)");
  }
  return *id;
}

absl::Status CheckLayout(const PoolLayout& layout) {
  if (layout.block_size <= 0 || layout.num_blocks <= 0 ||
      layout.num_slots() > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout: block_size = ", layout.block_size, ", num_blocks = ",
        layout.num_blocks, " must be positive with slots fitting int32"));
  }
  return absl::OkStatus();
}

absl::Status CheckPointer(const void* p, absl::string_view name,
                          uintptr_t alignment) {
  if (p == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is null"));
  }
  if (reinterpret_cast<uintptr_t>(p) % alignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " is not ", alignment, "-byte aligned"));
  }
  return absl::OkStatus();
}

absl::Status CheckCount(int64_t n, absl::string_view name) {
  if (n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " = ", n, " is negative"));
  }
  return absl::OkStatus();
}

// Index kernels run one CTA row per output row and 256-column tiles.
absl::Status CheckGrid(int64_t rows, int64_t width, absl::string_view what) {
  if (rows > INT32_MAX || width > int64_t{65535} * 256) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", rows, " rows of width ", width,
                     " exceed the launch limits (", INT32_MAX, " rows, ",
                     int64_t{65535} * 256, " columns)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateStore(const PoolLayout& layout,
                           absl::Span<const int32_t> slot_mapping) {
  return ValidateSlotMapping(layout, slot_mapping);
}

absl::Status ValidateLoad(const PoolLayout& layout,
                          absl::Span<const int32_t> segments, int64_t total_k) {
  return ValidateSegments(layout, segments, total_k);
}

absl::Status Store(const PoolLayout& layout, void* layer, const void* kv,
                   InputDtype dtype, const int32_t* slot_mapping,
                   int64_t num_tokens, const LaunchOptions& options) {
  const absl::StatusOr<FormatId> id = FormatIdOf(layout.format);
  if (!id.ok()) return id.status();
  RETURN_IF_ERROR(CheckLayout(layout));
  RETURN_IF_ERROR(CheckCount(num_tokens, "num_tokens"));
  RETURN_IF_ERROR(ValidateInputDtype(layout.format, dtype));
  if (num_tokens == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckPointer(layer, "layer", 16));
  RETURN_IF_ERROR(CheckPointer(kv, "kv", 16));
  RETURN_IF_ERROR(CheckPointer(slot_mapping, "slot_mapping", 4));
  RETURN_IF_CUDA_ERROR(
      internal::LaunchStore(*id, layout, static_cast<uint8_t*>(layer), kv,
                            dtype == InputDtype::kFP32, slot_mapping,
                            num_tokens, options.hw_e4m3, ToLaunch(options)),
      "launching the store kernel");
  return absl::OkStatus();
}

absl::Status LoadSegments(const PoolLayout& layout, const void* layer,
                          const int32_t* segments, int64_t num_segments,
                          void* data, void* scales,
                          const LaunchOptions& options) {
  const absl::StatusOr<FormatId> id = FormatIdOf(layout.format);
  if (!id.ok()) return id.status();
  RETURN_IF_ERROR(CheckLayout(layout));
  RETURN_IF_ERROR(CheckCount(num_segments, "num_segments"));
  if (num_segments == 0) return absl::OkStatus();
  if (num_segments > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_segments = ", num_segments, " exceeds ", INT32_MAX));
  }
  RETURN_IF_ERROR(CheckPointer(layer, "layer", 16));
  RETURN_IF_ERROR(CheckPointer(segments, "segments", 4));
  RETURN_IF_ERROR(CheckPointer(data, "data", 16));
  if (!layout.format.do_cast) {
    RETURN_IF_ERROR(CheckPointer(scales, "scales", 4));
  }
  RETURN_IF_CUDA_ERROR(
      internal::LaunchLoad(*id, layout, static_cast<const uint8_t*>(layer),
                           segments, num_segments, data, scales,
                           ToLaunch(options)),
      "launching the segment-load kernel");
  return absl::OkStatus();
}

absl::Status ConvertTopk(int32_t* topk, int64_t num_seqs, int32_t k,
                         const int32_t* valid_count, const int32_t* num_tokens,
                         const int32_t* block_table, const int32_t* row_lens,
                         int32_t num_cols, int64_t row_stride,
                         int32_t block_size, int32_t num_blocks,
                         unsigned long long* invalid_count,
                         const LaunchOptions& options) {
  RETURN_IF_ERROR(CheckCount(num_seqs, "num_seqs"));
  RETURN_IF_ERROR(CheckCount(k, "k"));
  if (block_size <= 0 || num_blocks <= 0 || num_cols < 0 ||
      row_stride < num_cols) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_size = ", block_size, ", num_blocks = ", num_blocks,
                     ", num_cols = ", num_cols, ", row_stride = ", row_stride,
                     ": need positive sizes and row_stride >= num_cols"));
  }
  if (num_seqs == 0 || k == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckGrid(num_seqs, k, "convert_topk"));
  RETURN_IF_ERROR(CheckPointer(topk, "topk", 4));
  RETURN_IF_ERROR(CheckPointer(valid_count, "valid_count", 4));
  RETURN_IF_ERROR(CheckPointer(num_tokens, "num_tokens", 4));
  if (num_cols > 0) {
    RETURN_IF_ERROR(CheckPointer(block_table, "block_table", 4));
  }
  RETURN_IF_CUDA_ERROR(
      internal::LaunchConvertTopk(topk, num_seqs, k, valid_count, num_tokens,
                                  block_table, row_lens, num_cols, row_stride,
                                  block_size, num_blocks, invalid_count,
                                  ToLaunch(options)),
      "launching convert_topk");
  return absl::OkStatus();
}

absl::Status SwaDecodeIndex(const int32_t* state_ids, const int32_t* starts,
                            const int32_t* valid_lens, int64_t n,
                            int32_t window, int32_t ring_size, int32_t* out,
                            const LaunchOptions& options) {
  RETURN_IF_ERROR(CheckCount(n, "n"));
  if (window <= 0 || ring_size < window) {
    return absl::InvalidArgumentError(
        absl::StrCat("window = ", window, ", ring_size = ", ring_size,
                     ": need 0 < window <= ring_size"));
  }
  if (n == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckGrid(n, window, "swa_decode_index"));
  RETURN_IF_ERROR(CheckPointer(state_ids, "state_ids", 4));
  RETURN_IF_ERROR(CheckPointer(starts, "starts", 4));
  RETURN_IF_ERROR(CheckPointer(valid_lens, "valid_lens", 4));
  RETURN_IF_ERROR(CheckPointer(out, "out", 4));
  RETURN_IF_CUDA_ERROR(
      internal::LaunchSwaDecodeIndex(state_ids, starts, valid_lens, n, window,
                                     ring_size, out, ToLaunch(options)),
      "launching the SWA decode index");
  return absl::OkStatus();
}

absl::Status ExpandSwaIndex(const int32_t* pivots, int64_t rows, int32_t width,
                            int32_t* out, const LaunchOptions& options) {
  RETURN_IF_ERROR(CheckCount(rows, "rows"));
  RETURN_IF_ERROR(CheckCount(width, "width"));
  if (rows == 0 || width == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckGrid(rows, width, "expand_swa_index"));
  RETURN_IF_ERROR(CheckPointer(pivots, "pivots", 16));
  RETURN_IF_ERROR(CheckPointer(out, "out", 4));
  RETURN_IF_CUDA_ERROR(internal::LaunchExpandSwaIndex(pivots, rows, width, out,
                                                      ToLaunch(options)),
                       "launching expand_swa_index");
  return absl::OkStatus();
}

absl::Status KvIndexCat(const int32_t* swa, int32_t swa_width,
                        const int32_t* compressed, int32_t compressed_width,
                        int64_t rows, int32_t main_kv_offset, int32_t* out,
                        const LaunchOptions& options) {
  RETURN_IF_ERROR(CheckCount(rows, "rows"));
  RETURN_IF_ERROR(CheckCount(swa_width, "swa_width"));
  RETURN_IF_ERROR(CheckCount(compressed_width, "compressed_width"));
  if (rows == 0 || swa_width + compressed_width == 0) {
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(
      CheckGrid(rows, int64_t{swa_width} + compressed_width, "kv_index_cat"));
  if (swa_width > 0) RETURN_IF_ERROR(CheckPointer(swa, "swa", 4));
  if (compressed_width > 0) {
    RETURN_IF_ERROR(CheckPointer(compressed, "compressed", 4));
  }
  RETURN_IF_ERROR(CheckPointer(out, "out", 4));
  RETURN_IF_CUDA_ERROR(
      internal::LaunchKvIndexCat(swa, swa_width, compressed, compressed_width,
                                 rows, main_kv_offset, out, ToLaunch(options)),
      "launching kv_index_cat");
  return absl::OkStatus();
}

absl::Status KvIndexCatChecked(const int32_t* swa, int32_t swa_width,
                               const int32_t* compressed,
                               int32_t compressed_width, int64_t rows,
                               int32_t main_kv_offset, int32_t compressed_rows,
                               int32_t* out, unsigned long long* invalid_count,
                               const LaunchOptions& options) {
  RETURN_IF_ERROR(CheckCount(rows, "rows"));
  RETURN_IF_ERROR(CheckCount(swa_width, "swa_width"));
  RETURN_IF_ERROR(CheckCount(compressed_width, "compressed_width"));
  RETURN_IF_ERROR(CheckCount(compressed_rows, "compressed_rows"));
  if (main_kv_offset < 0 ||
      int64_t{main_kv_offset} + compressed_rows > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "main_kv_offset = ", main_kv_offset,
        " + compressed_rows = ", compressed_rows, " must be in [0, 2^31)"));
  }
  if (rows == 0 || swa_width + compressed_width == 0) {
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(
      CheckGrid(rows, int64_t{swa_width} + compressed_width, "kv_index_cat"));
  if (swa_width > 0) RETURN_IF_ERROR(CheckPointer(swa, "swa", 4));
  if (compressed_width > 0) {
    RETURN_IF_ERROR(CheckPointer(compressed, "compressed", 4));
  }
  RETURN_IF_ERROR(CheckPointer(out, "out", 4));
  RETURN_IF_ERROR(CheckPointer(invalid_count, "invalid_count", 8));
  RETURN_IF_CUDA_ERROR(
      internal::LaunchKvIndexCatChecked(
          swa, swa_width, compressed, compressed_width, rows, main_kv_offset,
          compressed_rows, out, invalid_count, ToLaunch(options)),
      "launching kv_index_cat (checked)");
  return absl::OkStatus();
}

}  // namespace kvdepot::gpu
