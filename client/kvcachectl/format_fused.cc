#include "client/kvcachectl/format_fused.h"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/fused.h"
#include "kernels/fused_host.h"
#include "kernels/reference/fused.h"

namespace kvdepot::ctl {
namespace {

absl::StatusOr<std::string> ReadAll(const std::string& flag,
                                    const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": cannot open ", path));
  }
  return std::string((std::istreambuf_iterator<char>(in)),
                     std::istreambuf_iterator<char>());
}

absl::Status SizeIs(const std::string& flag, size_t got, int64_t want,
                    const std::string& what) {
  if (static_cast<int64_t>(got) != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, " holds ", got, " bytes, want ", want, " (", what, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int32_t> Int(const ParsedArgs& a, const char* name) {
  ASSIGN_OR_RETURN(int64_t v, a.GetInt(name, 0, kFusedMaxElements));
  return static_cast<int32_t>(v);
}

}  // namespace

std::vector<FlagSpec> FusedEncodeFlags() {
  return {
      {"norm_weight",
       "RMSNorm weights: raw little-endian BF16 over the norm range", ""},
      {"norm_begin", "RMSNorm range start (multiple of 8)", "0"},
      {"norm_end", "RMSNorm range end (default: the token's elements)", ""},
      {"eps", "RMSNorm epsilon (fp32)", "1e-6"},
      {"rope", "RoPE style: none, neox or interleaved", "none"},
      {"rope_offset", "RoPE range start", "0"},
      {"rope_dim", "RoPE range length (even)", "0"},
      {"positions", "RoPE positions: raw little-endian int64, one per token",
       ""},
      {"cos_sin",
       "RoPE cache: raw little-endian fp32 [max_position][rope_dim], cos | sin",
       ""},
      {"hadamard_begin", "Hadamard range start", "0"},
      {"hadamard_len", "Hadamard length: 64, 128, 256 or 512 (0 = off)", "0"},
      {"cast_back",
       "also write the BF16 a later load returns (n x elements) to this file",
       ""},
  };
}

bool WantsFused(const ParsedArgs& a) {
  return !a.Get("norm_weight").empty() || a.Get("rope") != "none" ||
         a.Get("hadamard_len") != "0";
}

absl::Status FusedTransform(const ParsedArgs& a, const KVCacheFormat& f,
                            std::string* bf16) {
  const int32_t d = f.elements();
  const size_t n = bf16->size() / (2 * static_cast<size_t>(d));
  // The ranges first (stand-in arrays), then the files sized by them.
  FusedParams p;
  const bool norm = !a.Get("norm_weight").empty();
  if (norm) {
    ASSIGN_OR_RETURN(p.norm_begin, Int(a, "norm_begin"));
    p.norm_end = d;
    if (!a.Get("norm_end").empty()) {
      ASSIGN_OR_RETURN(p.norm_end, Int(a, "norm_end"));
    }
    if (!absl::SimpleAtof(a.Get("eps"), &p.eps)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--eps = \"", a.Get("eps"), "\" is not a number"));
    }
  }
  const std::string rope = a.Get("rope");
  if (rope == "neox") {
    p.rope = RopeStyle::kNeox;
  } else if (rope == "interleaved") {
    p.rope = RopeStyle::kInterleaved;
  } else if (rope != "none") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rope = \"", rope, "\" is not none, neox or interleaved"));
  }
  if (p.rope != RopeStyle::kNone) {
    ASSIGN_OR_RETURN(p.rope_offset, Int(a, "rope_offset"));
    ASSIGN_OR_RETURN(p.rope_dim, Int(a, "rope_dim"));
  }
  ASSIGN_OR_RETURN(p.hadamard_begin, Int(a, "hadamard_begin"));
  ASSIGN_OR_RETURN(p.hadamard_len, Int(a, "hadamard_len"));
  static const uint8_t kStandIn[16] = {};
  FusedParams shape = p;
  shape.norm_weight = reinterpret_cast<const uint16_t*>(kStandIn);
  shape.cos_sin = reinterpret_cast<const float*>(kStandIn);
  shape.max_position = 1;
  RETURN_IF_ERROR(ValidateFused(f, shape, {}));

  std::string weight, positions_bytes, cos_sin_bytes;
  if (norm) {
    ASSIGN_OR_RETURN(weight, ReadAll("norm_weight", a.Get("norm_weight")));
    RETURN_IF_ERROR(SizeIs("norm_weight", weight.size(),
                           2 * int64_t{p.norm_end - p.norm_begin},
                           "2 x (norm_end - norm_begin)"));
    p.norm_weight = reinterpret_cast<const uint16_t*>(weight.data());
  }
  std::vector<int64_t> positions;
  std::vector<float> cos_sin;
  if (p.rope != RopeStyle::kNone) {
    ASSIGN_OR_RETURN(positions_bytes, ReadAll("positions", a.Get("positions")));
    RETURN_IF_ERROR(SizeIs("positions", positions_bytes.size(),
                           8 * static_cast<int64_t>(n),
                           "8 bytes per input token"));
    ASSIGN_OR_RETURN(cos_sin_bytes, ReadAll("cos_sin", a.Get("cos_sin")));
    const size_t row = 4 * static_cast<size_t>(p.rope_dim);
    if (cos_sin_bytes.empty() || cos_sin_bytes.size() % row != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--cos_sin holds ", cos_sin_bytes.size(),
                       " bytes, not a positive multiple of one row (4 x "
                       "rope_dim = ",
                       row, ")"));
    }
    positions.resize(n);
    std::memcpy(positions.data(), positions_bytes.data(), 8 * n);
    cos_sin.resize(cos_sin_bytes.size() / 4);
    std::memcpy(cos_sin.data(), cos_sin_bytes.data(), cos_sin_bytes.size());
    p.positions = positions.data();
    p.cos_sin = cos_sin.data();
    p.max_position = static_cast<int64_t>(cos_sin_bytes.size() / row);
  }
  RETURN_IF_ERROR(ValidateFused(f, p, positions));
  // Little-endian files on a little-endian host: the bytes are the values.
  std::vector<uint16_t> x(static_cast<size_t>(d)), y(static_cast<size_t>(d));
  for (size_t t = 0; t < n; ++t) {
    char* row = bf16->data() + 2 * t * static_cast<size_t>(d);
    std::memcpy(x.data(), row, 2 * static_cast<size_t>(d));
    FusedTransformToken(f, p, positions.empty() ? 0 : positions[t], x.data(),
                        y.data());
    std::memcpy(row, y.data(), 2 * static_cast<size_t>(d));
  }
  return absl::OkStatus();
}

}  // namespace kvdepot::ctl
