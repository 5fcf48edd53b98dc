#include "server/fused_store.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/fused_host.h"

namespace kvdepot {
namespace {

absl::Status Prefixed(const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("fused: ", s.message()));
}

}  // namespace

absl::Status CheckFusedStore(InputDtype dtype, bool gpu_ordering) {
  if (dtype != InputDtype::kBF16) {
    return absl::InvalidArgumentError(
        "dtype: the fused store takes BF16 input only (SPEC §8)");
  }
  if (gpu_ordering) {
    return absl::InvalidArgumentError(
        "fused: wait_event_ipc_handle and record_event are not supported "
        "with the fused store; leave them unset");
  }
  return absl::OkStatus();
}

absl::StatusOr<FusedStoreInputs> ResolveFusedStore(
    const SessionManager& sessions, Backend& backend, const Caller& caller,
    const KVCacheFormat& format, const v1::FusedStoreOptions& o,
    int64_t num_tokens, const ByteRange& kv, int64_t max_array_elements,
    int64_t max_inline_bytes, std::string* inline_cast_back) {
  FusedStoreInputs in;
  FusedParams& p = in.params;
  if (o.rope() < v1::ROPE_STYLE_NONE || o.rope() > v1::ROPE_STYLE_INTERLEAVED) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fused.rope = ", static_cast<int>(o.rope()), " is not a RopeStyle"));
  }
  if (o.max_position() < 0 || o.max_position() > max_array_elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("fused.max_position = ", o.max_position(),
                     " is outside [0, ", max_array_elements, "]"));
  }
  p.norm_begin = o.norm_begin();
  p.norm_end = o.norm_end();
  p.eps = o.eps();
  p.rope = static_cast<RopeStyle>(o.rope());
  p.rope_offset = o.rope_offset();
  p.rope_dim = o.rope_dim();
  p.max_position = o.max_position();
  p.hadamard_begin = o.hadamard_begin();
  p.hadamard_len = o.hadamard_len();
  // Ranges, lengths and eps first (the array sizes below depend on them);
  // stand-in pointers until the arrays are resolved.
  static const uint8_t kStandIn[16] = {};
  FusedParams shape = p;
  shape.norm_weight = reinterpret_cast<const uint16_t*>(kStandIn);
  shape.cos_sin = reinterpret_cast<const float*>(kStandIn);
  RETURN_IF_ERROR(Prefixed(ValidateFused(format, shape, {})));

  const bool rope = p.rope != RopeStyle::kNone;
  if (p.norm()) {
    ASSIGN_OR_RETURN(
        in.norm_weight,
        ResolveInput(sessions, caller, "fused.norm_weight", o.norm_weight(),
                     2 * int64_t{p.norm_end - p.norm_begin}));
    p.norm_weight = reinterpret_cast<const uint16_t*>(in.norm_weight.data);
  }
  if (rope) {
    ASSIGN_OR_RETURN(in.positions,
                     ResolveInput(sessions, caller, "fused.positions",
                                  o.positions(), 8 * num_tokens));
    ASSIGN_OR_RETURN(
        in.cos_sin, ResolveInput(sessions, caller, "fused.cos_sin", o.cos_sin(),
                                 4 * p.max_position * int64_t{p.rope_dim}));
    in.host_positions.resize(static_cast<size_t>(num_tokens));
    RETURN_IF_ERROR(backend.CopyBytes(in.host_positions.data(),
                                      in.positions.data, 8 * num_tokens));
    p.positions = reinterpret_cast<const int64_t*>(in.positions.data);
    p.cos_sin = reinterpret_cast<const float*>(in.cos_sin.data);
  }
  RETURN_IF_ERROR(Prefixed(ValidateFused(format, p, in.host_positions)));
  if (o.has_cast_back()) {
    ASSIGN_OR_RETURN(
        in.cast_back,
        ResolveOutput(sessions, caller, "fused.cast_back", o.cast_back(),
                      2 * num_tokens * format.elements(), max_inline_bytes,
                      inline_cast_back));
    RETURN_IF_ERROR(CheckDisjoint("fused.cast_back", in.cast_back, "kv", kv));
    RETURN_IF_ERROR(CheckDisjoint("fused.cast_back", in.cast_back,
                                  "fused.norm_weight", in.norm_weight));
    RETURN_IF_ERROR(CheckDisjoint("fused.cast_back", in.cast_back,
                                  "fused.positions", in.positions));
    RETURN_IF_ERROR(CheckDisjoint("fused.cast_back", in.cast_back,
                                  "fused.cos_sin", in.cos_sin));
  }
  return in;
}

}  // namespace kvdepot
