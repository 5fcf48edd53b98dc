// The CUDA half of libkvdepot_kernels: host-side checks of every argument,
// the device-side checks of the device arrays (device_checks.h) into the
// caller's workspace, then the daemon's own launchers (kernels/cuda:
// kernels.h, fused_kernels.h), all on the caller's stream.
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_status.h"
#include "common/status_macros.h"
#include "kernels/cuda/fused_kernels.h"
#include "kernels/cuda/kernels.h"
#include "kernels/format_host.h"
#include "kernels/fused_host.h"
#include "kernels/store_load_host.h"
#include "libkvdepot/capi_internal.h"
#include "libkvdepot/device_checks.h"
#include "planner/sequence_plans.h"

namespace kvdepot::capi {
namespace {

// The workspace parts of `op` for `count` items inside the caller's buffer.
struct Parts {
  uint8_t* part[3] = {nullptr, nullptr, nullptr};
};

absl::StatusOr<Parts> CarveWorkspace(int32_t op, int64_t count, void* workspace,
                                     int64_t workspace_bytes) {
  Workspace w;
  RETURN_IF_ERROR(WorkspaceFor(op, count, &w));
  Parts p;
  if (count == 0) return p;
  if (workspace == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("workspace is null (", w.total,
                     " bytes needed: kvdk_cuda_workspace_bytes)"));
  }
  if (reinterpret_cast<uintptr_t>(workspace) % 16 != 0) {
    return absl::InvalidArgumentError("workspace is not 16-byte aligned");
  }
  if (workspace_bytes < w.total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "workspace_bytes = ", workspace_bytes, " is less than the ", w.total,
        " needed (kvdk_cuda_workspace_bytes)"));
  }
  for (int i = 0; i < 3; ++i) {
    p.part[i] = static_cast<uint8_t*>(workspace) + w.offset[i];
  }
  return p;
}

absl::Status CudaStatus(int error, absl::string_view what) {
  return gpu::ToStatus(static_cast<cudaError_t>(error), what);
}

gpu::LaunchOptions Options(void* stream) {
  gpu::LaunchOptions o;
  o.stream = stream;
  // As the daemon's CUDA backend: the kernel may launch while the previous
  // one (our check pass) drains; it waits before reading any input.
  o.pdl = true;
  return o;
}

// Non-null and aligned: what the launchers (and the check kernels' loads)
// need, checked before anything is enqueued, so that a refused call writes
// nothing (not even the workspace or *invalid_count).
absl::Status Aligned(const void* p, absl::string_view name,
                     uintptr_t alignment) {
  RETURN_IF_ERROR(CheckNotNull(p, name));
  if (reinterpret_cast<uintptr_t>(p) % alignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " is not ", alignment, "-byte aligned"));
  }
  return absl::OkStatus();
}

// The index kernels' grid: a 256-column tile per CTA in y.
absl::Status CheckWidth(int64_t width, absl::string_view name) {
  constexpr int64_t kMaxWidth = int64_t{65535} * 256;
  if (width > kMaxWidth) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, " = ", width, " exceeds the kernels' limit of ", kMaxWidth));
  }
  return absl::OkStatus();
}

// Slots are int32 on the device: the launchers take pools of at most
// 2^31 - 1 slots.
absl::Status CheckSlots(const PoolLayout& l) {
  if (l.num_slots() > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout: num_blocks * block_size = ", l.num_slots(),
                     " exceeds 2^31 - 1 slots"));
  }
  return absl::OkStatus();
}

absl::Status CheckInt32Layout(const PoolLayout& l, absl::string_view name) {
  if (l.block_size > INT32_MAX || l.num_blocks > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": block_size and num_blocks must be < 2^31"));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvdepot::capi

using namespace kvdepot;        // NOLINT: the C entry points below
using namespace kvdepot::capi;  // NOLINT

extern "C" {

int kvdk_has_cuda(void) { return 1; }

int kvdk_store_cuda(const kvdk_layout* layout, void* pool, int64_t pool_bytes,
                    int64_t layer, const void* kv, int32_t dtype,
                    const int32_t* slot_mapping, int64_t num_tokens,
                    void* workspace, int64_t workspace_bytes,
                    unsigned long long* invalid_count, void* stream) {
  return Guard(
      "kvdk_store_cuda",
      [&]() -> absl::Status {
        RETURN_IF_ERROR(CheckLayout(layout, "layout"));
        const PoolLayout& l = layout->layout;
        RETURN_IF_ERROR(CheckPool(l, pool, pool_bytes, layer));
        RETURN_IF_ERROR(CheckDtype(l.format, dtype));
        RETURN_IF_ERROR(CheckCount(num_tokens, "num_tokens"));
        RETURN_IF_ERROR(CheckSlots(l));
        if (num_tokens == 0) return absl::OkStatus();
        RETURN_IF_ERROR(Aligned(pool, "pool", 16));
        RETURN_IF_ERROR(Aligned(kv, "kv", 16));
        RETURN_IF_ERROR(Aligned(slot_mapping, "slot_mapping", 4));
        ASSIGN_OR_RETURN(Parts ws, CarveWorkspace(KVDK_OP_STORE, num_tokens,
                                                  workspace, workspace_bytes));
        auto* slots = reinterpret_cast<int32_t*>(ws.part[0]);
        RETURN_IF_ERROR(CudaStatus(
            device::CheckIndices(slot_mapping, num_tokens, l.num_slots(), slots,
                                 invalid_count, stream),
            "checking slot_mapping"));
        return gpu::Store(l, LayerBase(l, pool, layer), kv,
                          static_cast<InputDtype>(dtype), slots, num_tokens,
                          Options(stream));
      },
      /*cuda=*/true);
}

int kvdk_load_cuda(const kvdk_layout* layout, const void* pool,
                   int64_t pool_bytes, int64_t layer, const int32_t* segments,
                   int64_t num_segments, int64_t total_k, void* data,
                   int64_t data_bytes, void* scales, int64_t scales_bytes,
                   void* workspace, int64_t workspace_bytes,
                   unsigned long long* invalid_count, void* stream) {
  return Guard(
      "kvdk_load_cuda",
      [&]() -> absl::Status {
        RETURN_IF_ERROR(CheckLayout(layout, "layout"));
        const PoolLayout& l = layout->layout;
        RETURN_IF_ERROR(CheckPool(l, pool, pool_bytes, layer));
        RETURN_IF_ERROR(
            CheckCount(num_segments, "num_segments", INT32_MAX / 4));
        RETURN_IF_ERROR(CheckCount(total_k, "total_k"));
        RETURN_IF_ERROR(CheckOutput(data, data_bytes, total_k,
                                    LoadDataRowBytes(l.format), "data"));
        RETURN_IF_ERROR(CheckOutput(scales, scales_bytes, total_k,
                                    LoadScaleRowBytes(l.format), "scales"));
        RETURN_IF_ERROR(CheckSlots(l));
        if (num_segments == 0) return absl::OkStatus();
        RETURN_IF_ERROR(Aligned(pool, "pool", 16));
        RETURN_IF_ERROR(Aligned(segments, "segments", 4));
        RETURN_IF_ERROR(Aligned(data, "data", 16));
        if (!l.format.do_cast) RETURN_IF_ERROR(Aligned(scales, "scales", 4));
        ASSIGN_OR_RETURN(Parts ws, CarveWorkspace(KVDK_OP_LOAD, num_segments,
                                                  workspace, workspace_bytes));
        auto* checked = reinterpret_cast<int32_t*>(ws.part[0]);
        RETURN_IF_ERROR(CudaStatus(
            device::CheckSegments(segments, num_segments, l.num_blocks,
                                  l.block_size, total_k, checked, invalid_count,
                                  stream),
            "checking segments"));
        return gpu::LoadSegments(l, LayerBase(l, pool, layer), checked,
                                 num_segments, data, scales, Options(stream));
      },
      /*cuda=*/true);
}

int kvdk_fused_store_cuda(const kvdk_layout* layout, void* pool,
                          int64_t pool_bytes, int64_t layer, const uint16_t* kv,
                          const kvdk_fused_params* params,
                          const int32_t* slot_mapping, int64_t num_tokens,
                          uint16_t* cast_back, void* workspace,
                          int64_t workspace_bytes,
                          unsigned long long* invalid_count, void* stream) {
  return Guard(
      "kvdk_fused_store_cuda",
      [&]() -> absl::Status {
        RETURN_IF_ERROR(CheckLayout(layout, "layout"));
        const PoolLayout& l = layout->layout;
        RETURN_IF_ERROR(CheckPool(l, pool, pool_bytes, layer));
        FusedParams p;
        RETURN_IF_ERROR(ToFusedParams(params, &p));
        RETURN_IF_ERROR(ValidateQuantization(l.format));
        // Everything but the positions (device memory: checked below).
        RETURN_IF_ERROR(ValidateFused(l.format, p, {}));
        RETURN_IF_ERROR(CheckCount(num_tokens, "num_tokens"));
        const bool rope = p.rope != RopeStyle::kNone;
        RETURN_IF_ERROR(CheckSlots(l));
        if (num_tokens == 0) return absl::OkStatus();
        RETURN_IF_ERROR(Aligned(pool, "pool", 16));
        RETURN_IF_ERROR(Aligned(kv, "kv", 16));
        RETURN_IF_ERROR(Aligned(slot_mapping, "slot_mapping", 4));
        if (cast_back != nullptr) {
          RETURN_IF_ERROR(Aligned(cast_back, "cast_back", 16));
        }
        if (p.norm()) {
          RETURN_IF_ERROR(Aligned(p.norm_weight, "params.norm_weight", 16));
        }
        if (rope) {
          RETURN_IF_ERROR(Aligned(p.positions, "params.positions", 8));
          RETURN_IF_ERROR(Aligned(p.cos_sin, "params.cos_sin", 4));
        }
        ASSIGN_OR_RETURN(
            Parts ws, CarveWorkspace(KVDK_OP_FUSED_STORE, num_tokens, workspace,
                                     workspace_bytes));
        auto* slots = reinterpret_cast<int32_t*>(ws.part[0]);
        auto* positions = reinterpret_cast<int64_t*>(ws.part[1]);
        RETURN_IF_ERROR(CudaStatus(
            device::CheckFusedInputs(slot_mapping, rope ? p.positions : nullptr,
                                     num_tokens, l.num_slots(), p.max_position,
                                     slots, positions, invalid_count, stream),
            "checking slot_mapping and positions"));
        if (rope) p.positions = positions;
        return gpu::FusedStore(l, LayerBase(l, pool, layer), kv, p, slots,
                               num_tokens, cast_back, Options(stream));
      },
      /*cuda=*/true);
}

int kvdk_convert_topk_cuda(const kvdk_layout* layout, int32_t* topk,
                           int64_t num_seqs, int32_t k,
                           const int32_t* valid_count,
                           const int32_t* num_tokens,
                           const int32_t* block_table,
                           int32_t max_blocks_per_seq, int64_t row_stride,
                           unsigned long long* invalid_count, void* stream) {
  return Guard(
      "kvdk_convert_topk_cuda",
      [&]() -> absl::Status {
        RETURN_IF_ERROR(CheckLayout(layout, "layout"));
        const PoolLayout& l = layout->layout;
        RETURN_IF_ERROR(CheckInt32Layout(l, "layout"));
        RETURN_IF_ERROR(CheckCount(num_seqs, "num_seqs"));
        RETURN_IF_ERROR(CheckCount(k, "k"));
        RETURN_IF_ERROR(CheckCount(max_blocks_per_seq, "max_blocks_per_seq"));
        if (row_stride < max_blocks_per_seq || row_stride > INT32_MAX) {
          return absl::InvalidArgumentError(absl::StrCat(
              "row_stride = ", row_stride, " is outside [max_blocks_per_seq = ",
              max_blocks_per_seq, ", 2^31)"));
        }
        RETURN_IF_ERROR(CheckWidth(k, "k"));
        if (num_seqs == 0 || k == 0) return absl::OkStatus();
        RETURN_IF_ERROR(Aligned(topk, "topk", 4));
        RETURN_IF_ERROR(Aligned(valid_count, "valid_count", 4));
        RETURN_IF_ERROR(Aligned(num_tokens, "num_tokens", 4));
        if (max_blocks_per_seq > 0) {
          RETURN_IF_ERROR(Aligned(block_table, "block_table", 4));
        }
        // The kernel checks every entry on the device (kernels/cuda:
        // index_ops.cu): out-of-range entries become -1 and are counted.
        return gpu::ConvertTopk(
            topk, num_seqs, k, valid_count, num_tokens, block_table,
            /*row_lens=*/nullptr, max_blocks_per_seq, row_stride,
            static_cast<int32_t>(l.block_size),
            static_cast<int32_t>(l.num_blocks), invalid_count, Options(stream));
      },
      /*cuda=*/true);
}

int kvdk_swa_decode_index_cuda(const kvdk_layout* ring,
                               const int32_t* state_ids, const int32_t* starts,
                               const int32_t* valid_lens, int64_t n,
                               int32_t window, int32_t* out, void* workspace,
                               int64_t workspace_bytes,
                               unsigned long long* invalid_count,
                               void* stream) {
  return Guard(
      "kvdk_swa_decode_index_cuda",
      [&]() -> absl::Status {
        RETURN_IF_ERROR(CheckLayout(ring, "ring"));
        const PoolLayout& l = ring->layout;
        RETURN_IF_ERROR(CheckInt32Layout(l, "ring"));
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
        RETURN_IF_ERROR(CheckWidth(window, "window"));
        if (n == 0) return absl::OkStatus();
        RETURN_IF_ERROR(Aligned(state_ids, "state_ids", 4));
        RETURN_IF_ERROR(Aligned(starts, "starts", 4));
        RETURN_IF_ERROR(Aligned(valid_lens, "valid_lens", 4));
        RETURN_IF_ERROR(Aligned(out, "out", 4));
        ASSIGN_OR_RETURN(Parts ws, CarveWorkspace(KVDK_OP_SWA_DECODE_INDEX, n,
                                                  workspace, workspace_bytes));
        auto* q = reinterpret_cast<int32_t*>(ws.part[0]);
        RETURN_IF_ERROR(
            CudaStatus(device::CheckSwaQueries(state_ids, starts, valid_lens, n,
                                               l.num_blocks, window, q,
                                               invalid_count, stream),
                       "checking the SWA queries"));
        return gpu::SwaDecodeIndex(q, q + n, q + 2 * n, n, window,
                                   params.ring_size, out, Options(stream));
      },
      /*cuda=*/true);
}

int kvdk_expand_swa_index_cuda(const int32_t* pivots, int64_t rows,
                               int32_t width, int32_t num_kv_rows, int32_t* out,
                               void* workspace, int64_t workspace_bytes,
                               unsigned long long* invalid_count,
                               void* stream) {
  return Guard(
      "kvdk_expand_swa_index_cuda",
      [&]() -> absl::Status {
        RETURN_IF_ERROR(CheckCount(rows, "rows"));
        if (width <= 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("width = ", width, " must be positive"));
        }
        RETURN_IF_ERROR(CheckCount(num_kv_rows, "num_kv_rows"));
        if (rows > INT32_MAX / width) {
          return absl::InvalidArgumentError(absl::StrCat(
              "rows * width = ", rows * width, " exceeds 2^31 - 1 entries"));
        }
        RETURN_IF_ERROR(CheckWidth(width, "width"));
        if (rows == 0) return absl::OkStatus();
        RETURN_IF_ERROR(Aligned(pivots, "pivots", 4));
        RETURN_IF_ERROR(Aligned(out, "out", 4));
        ASSIGN_OR_RETURN(
            Parts ws, CarveWorkspace(KVDK_OP_EXPAND_SWA_INDEX, rows, workspace,
                                     workspace_bytes));
        auto* checked = reinterpret_cast<int32_t*>(ws.part[0]);
        RETURN_IF_ERROR(
            CudaStatus(device::CheckPivots(pivots, rows, width, num_kv_rows,
                                           checked, invalid_count, stream),
                       "checking pivots"));
        return gpu::ExpandSwaIndex(checked, rows, width, out, Options(stream));
      },
      /*cuda=*/true);
}

int kvdk_kv_index_cat_cuda(const int32_t* swa, int32_t swa_width,
                           const int32_t* compressed, int32_t compressed_width,
                           int64_t rows, int32_t main_kv_offset,
                           int32_t compressed_rows, int32_t* out,
                           void* workspace, int64_t workspace_bytes,
                           unsigned long long* invalid_count, void* stream) {
  return Guard(
      "kvdk_kv_index_cat_cuda",
      [&]() -> absl::Status {
        RETURN_IF_ERROR(CheckCount(rows, "rows"));
        RETURN_IF_ERROR(CheckCount(swa_width, "swa_width"));
        RETURN_IF_ERROR(CheckCount(compressed_width, "compressed_width"));
        if (main_kv_offset < 0 || compressed_rows < 0 ||
            int64_t{main_kv_offset} + compressed_rows > INT32_MAX) {
          return absl::InvalidArgumentError(absl::StrCat(
              "main_kv_offset = ", main_kv_offset, " plus compressed_rows = ",
              compressed_rows, " is outside the int32 row range"));
        }
        const int64_t width = int64_t{swa_width} + compressed_width;
        if (width > INT32_MAX || (width > 0 && rows > INT32_MAX / width)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "rows * (swa_width + compressed_width) = ", rows * width,
              " exceeds 2^31 - 1 entries"));
        }
        RETURN_IF_ERROR(CheckWidth(width, "swa_width + compressed_width"));
        if (rows == 0 || width == 0) return absl::OkStatus();
        if (swa_width > 0) RETURN_IF_ERROR(Aligned(swa, "swa", 4));
        if (compressed_width > 0) {
          RETURN_IF_ERROR(Aligned(compressed, "compressed", 4));
        }
        RETURN_IF_ERROR(Aligned(out, "out", 4));
        ASSIGN_OR_RETURN(Parts ws,
                         CarveWorkspace(KVDK_OP_KV_INDEX_CAT, rows * width,
                                        workspace, workspace_bytes));
        const int64_t swa_n = rows * swa_width;
        const int64_t split = (4 * swa_n + kWorkspaceAlignment - 1) /
                              kWorkspaceAlignment * kWorkspaceAlignment;
        auto* swa_checked = reinterpret_cast<int32_t*>(ws.part[0]);
        auto* comp_checked = reinterpret_cast<int32_t*>(ws.part[0] + split);
        RETURN_IF_ERROR(
            CudaStatus(device::CheckIndices(swa, swa_n, main_kv_offset,
                                            swa_checked, invalid_count, stream),
                       "checking swa"));
        RETURN_IF_ERROR(
            CudaStatus(device::CheckIndices(compressed, rows * compressed_width,
                                            compressed_rows, comp_checked,
                                            invalid_count, stream),
                       "checking compressed"));
        return gpu::KvIndexCat(swa_checked, swa_width, comp_checked,
                               compressed_width, rows, main_kv_offset, out,
                               Options(stream));
      },
      /*cuda=*/true);
}

}  // extern "C"
