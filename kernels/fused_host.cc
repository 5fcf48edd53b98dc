#include "kernels/fused_host.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace kvdepot {
namespace {

absl::Status Range(absl::string_view name, int64_t begin, int64_t len,
                   int64_t d) {
  if (begin < 0 || len < 0 || begin + len > d) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " [", begin, ", ", begin + len,
                     ") is not inside the token's [0, ", d, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateFused(const KVCacheFormat& f, const FusedParams& p,
                           absl::Span<const int64_t> positions) {
  const int64_t d = f.elements();
  if (d % 8 != 0 || d > kFusedMaxElements) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the fused store needs elements() a multiple of 8 and at most ",
        kFusedMaxElements, " (got ", d, ")"));
  }
  if (p.norm_end != p.norm_begin) {
    // The length in 64 bits: int32 ends as far apart as INT32_MIN and
    // INT32_MAX overflow an int32 difference (step_fuzz, 2026-12-07).
    if (absl::Status s = Range("norm range", p.norm_begin,
                               int64_t{p.norm_end} - p.norm_begin, d);
        !s.ok()) {
      return s;
    }
    if (p.norm_begin % 8 != 0 || p.norm_end % 8 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "norm range [", p.norm_begin, ", ", p.norm_end,
          ") must start and end on multiples of 8 (SPEC §8 reduction tree)"));
    }
    if (p.norm_weight == nullptr) {
      return absl::InvalidArgumentError("norm_weight is null with norm on");
    }
    if (!std::isfinite(p.eps) || p.eps < 0.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat("eps = ", p.eps, " must be finite and >= 0"));
    }
  }
  if (p.rope != RopeStyle::kNone) {
    if (p.rope != RopeStyle::kNeox && p.rope != RopeStyle::kInterleaved) {
      return absl::InvalidArgumentError(
          absl::StrCat("rope style = ", static_cast<int>(p.rope),
                       " is not neox or interleaved"));
    }
    if (p.rope_dim <= 0 || p.rope_dim % 2 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rope_dim = ", p.rope_dim, " must be positive and even"));
    }
    if (absl::Status s = Range("rope range", p.rope_offset, p.rope_dim, d);
        !s.ok()) {
      return s;
    }
    if (p.cos_sin == nullptr || p.max_position <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rope needs a cos_sin cache (max_position = ", p.max_position, ")"));
    }
    for (size_t i = 0; i < positions.size(); ++i) {
      if (positions[i] < 0 || positions[i] >= p.max_position) {
        return absl::InvalidArgumentError(absl::StrCat(
            "positions[", i, "] = ", positions[i], " is outside [0, ",
            p.max_position, ") (the cos/sin cache length)"));
      }
    }
  }
  if (p.hadamard_len != 0) {
    bool supported = false;
    for (int32_t len : kHadamardLengths) supported |= len == p.hadamard_len;
    if (!supported) {
      const bool pow2 =
          p.hadamard_len > 0 && (p.hadamard_len & (p.hadamard_len - 1)) == 0;
      return absl::InvalidArgumentError(absl::StrCat(
          "hadamard_len = ", p.hadamard_len,
          pow2 ? " is a power of two the fused store does not support"
               : " is not a power of two",
          " (supported: 64, 128, 256, 512)"));
    }
    if (absl::Status s =
            Range("hadamard range", p.hadamard_begin, p.hadamard_len, d);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace kvdepot
