// Error reporting and the host-side argument checks of both halves.
#include <cmath>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/format_host.h"
#include "kernels/fused.h"
#include "kernels/store_load_host.h"
#include "libkvdepot/capi_internal.h"

namespace kvdepot::capi {
namespace {

thread_local std::string last_error;

}  // namespace

int Fail(int code, absl::string_view message) {
  last_error.assign(message.data(), message.size());
  return code;
}

int FailStatus(absl::string_view where, const absl::Status& status, bool cuda) {
  int code = KVDK_ERR_INVALID;
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
      code = KVDK_ERR_INVALID;
      break;
    case absl::StatusCode::kOutOfRange:
      code = KVDK_ERR_CAPACITY;
      break;
    case absl::StatusCode::kUnimplemented:
      code = KVDK_ERR_UNSUPPORTED;
      break;
    default:
      code = cuda ? KVDK_ERR_CUDA : KVDK_ERR_INVALID;
      break;
  }
  return Fail(code, absl::StrCat(where, ": ", status.message()));
}

const char* LastError() { return last_error.c_str(); }

int Ok() {
  last_error.clear();
  return KVDK_OK;
}

absl::Status CheckLayout(const kvdk_layout* layout, absl::string_view name) {
  if (layout == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is null"));
  }
  return absl::OkStatus();
}

absl::Status CheckNotNull(const void* p, absl::string_view name) {
  if (p == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is null"));
  }
  return absl::OkStatus();
}

absl::Status CheckCount(int64_t count, absl::string_view name, int64_t max) {
  if (count < 0 || count > max) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " = ", count, " is outside [0, ", max, "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckPool(const PoolLayout& layout, const void* pool,
                       int64_t pool_bytes, int64_t layer) {
  if (pool == nullptr) return absl::InvalidArgumentError("pool is null");
  if (layer < 0 || layer >= layout.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer = ", layer, " is outside [0, ", layout.num_layers, ")"));
  }
  const int64_t need = layout.layer_offset(layer) + layout.layer_bytes;
  if (pool_bytes < need) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool_bytes = ", pool_bytes, " is less than the ", need,
                     " bytes up to the end of layer ", layer));
  }
  return absl::OkStatus();
}

absl::Status CheckOutput(const void* p, int64_t have, int64_t rows,
                         int64_t row_bytes, absl::string_view name) {
  if (rows == 0 || row_bytes == 0) return absl::OkStatus();
  if (p == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " is null with ", rows, " rows"));
  }
  // rows <= INT32_MAX and row_bytes <= 2 * kFusedMaxElements-ish: no
  // overflow (row bytes of a format are at most a few KiB).
  const int64_t need = rows * row_bytes;
  if (have < need) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "_bytes = ", have, " is less than ", rows,
                     " rows x ", row_bytes, " bytes = ", need));
  }
  return absl::OkStatus();
}

absl::Status CheckDtype(const KVCacheFormat& format, int32_t dtype) {
  if (dtype != KVDK_DTYPE_BF16 && dtype != KVDK_DTYPE_FP32) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype = ", dtype, " is not KVDK_DTYPE_BF16 (0) or ",
                     "KVDK_DTYPE_FP32 (1)"));
  }
  return ValidateInputDtype(format, static_cast<InputDtype>(dtype));
}

absl::Status ToFusedParams(const kvdk_fused_params* in, FusedParams* out) {
  if (in == nullptr) return absl::InvalidArgumentError("params is null");
  if (in->rope_style != KVDK_ROPE_NONE && in->rope_style != KVDK_ROPE_NEOX &&
      in->rope_style != KVDK_ROPE_INTERLEAVED) {
    return absl::InvalidArgumentError(
        absl::StrCat("params.rope_style = ", in->rope_style,
                     " is not KVDK_ROPE_NONE, _NEOX or _INTERLEAVED"));
  }
  if (in->norm_end < in->norm_begin) {
    return absl::InvalidArgumentError(
        absl::StrCat("params.norm_end = ", in->norm_end,
                     " is less than norm_begin = ", in->norm_begin));
  }
  if (in->hadamard_len < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "params.hadamard_len = ", in->hadamard_len, " is negative"));
  }
  FusedParams p;
  p.norm_begin = in->norm_begin;
  p.norm_end = in->norm_end;
  p.norm_weight = in->norm_weight;
  p.eps = in->eps;
  p.rope = static_cast<RopeStyle>(in->rope_style);
  p.rope_offset = in->rope_offset;
  p.rope_dim = in->rope_dim;
  p.positions = in->positions;
  p.cos_sin = in->cos_sin;
  p.max_position = in->max_position;
  p.hadamard_begin = in->hadamard_begin;
  p.hadamard_len = in->hadamard_len;
  *out = p;
  return absl::OkStatus();
}

absl::Status WorkspaceFor(int32_t op, int64_t count, Workspace* out) {
  // 2^40 items bounds every product below far from int64 overflow.
  if (count < 0 || count > (int64_t{1} << 40)) {
    return absl::InvalidArgumentError(
        absl::StrCat("count = ", count, " is outside [0, 2^40]"));
  }
  Workspace w;
  switch (op) {
    case KVDK_OP_STORE:
      w.part_bytes[0] = 4 * count;  // checked slots
      break;
    case KVDK_OP_LOAD:
      w.part_bytes[0] = 16 * count;  // checked segments
      break;
    case KVDK_OP_FUSED_STORE:
      w.part_bytes[0] = 4 * count;  // checked slots
      w.part_bytes[1] = 8 * count;  // checked positions
      break;
    case KVDK_OP_SWA_DECODE_INDEX:
      w.part_bytes[0] = 12 * count;  // states | starts | valid_lens
      break;
    case KVDK_OP_EXPAND_SWA_INDEX:
      w.part_bytes[0] = 16 * count;  // checked pivots
      break;
    case KVDK_OP_KV_INDEX_CAT:
      // checked swa | checked compressed (count = rows * both widths); the
      // split point is known only at the call: room for its alignment.
      w.part_bytes[0] = 4 * count + kWorkspaceAlignment;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("op = ", op, " is not a KVDK_OP_*"));
  }
  for (int i = 0; i < 3; ++i) {
    w.offset[i] = w.total;
    w.total += (w.part_bytes[i] + kWorkspaceAlignment - 1) /
               kWorkspaceAlignment * kWorkspaceAlignment;
  }
  *out = w;
  return absl::OkStatus();
}

}  // namespace kvdepot::capi

extern "C" int64_t kvdk_cuda_workspace_bytes(int32_t op, int64_t count) {
  kvdepot::capi::Workspace w;
  const absl::Status s = kvdepot::capi::WorkspaceFor(op, count, &w);
  if (!s.ok()) {
    return kvdepot::capi::FailStatus("kvdk_cuda_workspace_bytes", s);
  }
  kvdepot::capi::Ok();
  return w.total;
}
