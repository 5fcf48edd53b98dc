#include "kernels/format_host.h"

#include <algorithm>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kernels/named_formats.h"

namespace kvdepot {
namespace {

constexpr int32_t kMaxElements = 1 << 20;  // sanity bound on a record

struct NamedEntry {
  FormatId id;
  absl::string_view name;
  KVCacheFormat format;  // bf16_elements filled in for kBf16
};

constexpr NamedEntry kQuantizedFormats[] = {
    {FormatId::kV41, "V41", kFormatV41},
    {FormatId::kV41Fp4, "V41_FP4", kFormatV41Fp4},
    {FormatId::kFp4Index, "FP4_INDEX", kFormatFp4Index},
    {FormatId::kFp8Fp32SfIndex, "FP8_FP32SF_INDEX", kFormatFp8Fp32SfIndex},
    {FormatId::kMxfp8Index, "MXFP8_INDEX", kFormatMxfp8Index},
    {FormatId::kDsMlaFp8, "DS_MLA_FP8", kFormatDsMlaFp8},
};

}  // namespace

absl::Status ValidateFormat(const KVCacheFormat& f) {
  if (!f.quantized()) {
    if (f.quantized_elements != 0 || f.elements_per_sf != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "format without quantization needs quantized_elements = "
          "elements_per_sf = 0, got %d and %d",
          f.quantized_elements, f.elements_per_sf));
    }
    if (f.sf_format != ScaleFormat::kNone) {
      return absl::InvalidArgumentError(
          "format without quantization must not set sf_format");
    }
    if (f.bf16_elements < 2 || f.bf16_elements > kMaxElements ||
        f.bf16_elements % 2 != 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("bf16_elements = %d must be even and in [2, %d]",
                          f.bf16_elements, kMaxElements));
    }
  } else {
    if (f.quantized_dtype != QuantDtype::kE4M3 &&
        f.quantized_dtype != QuantDtype::kE2M1) {
      return absl::InvalidArgumentError(
          absl::StrFormat("quantized_dtype = %d is not e4m3 or e2m1",
                          static_cast<int>(f.quantized_dtype)));
    }
    if (f.quantized_elements <= 0 || f.quantized_elements > kMaxElements ||
        f.elements_per_sf <= 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "quantized format needs quantized_elements in [1, %d] and "
          "elements_per_sf > 0, got %d and %d",
          kMaxElements, f.quantized_elements, f.elements_per_sf));
    }
    if (f.quantized_elements % f.elements_per_sf != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "elements_per_sf = %d does not divide quantized_elements = %d",
          f.elements_per_sf, f.quantized_elements));
    }
    if (f.sf_format != ScaleFormat::kUE8M0 &&
        f.sf_format != ScaleFormat::kE4M3 &&
        f.sf_format != ScaleFormat::kFP32) {
      return absl::InvalidArgumentError(
          "quantized format needs sf_format ue8m0, e4m3 or fp32");
    }
    if (f.bf16_elements < 0 || f.bf16_elements > kMaxElements ||
        f.quantized_elements + f.bf16_elements > kMaxElements) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "bf16_elements = %d (a BF16 tail) must be in [0, %d] with "
          "quantized_elements + bf16_elements <= %d",
          f.bf16_elements, kMaxElements, kMaxElements));
    }
    if (f.bf16_elements != 0 && !f.token_interleaved) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "a BF16 tail (bf16_elements = %d) on a quantized format needs "
          "token_interleaved",
          f.bf16_elements));
    }
    if (f.quantized_dtype == QuantDtype::kE2M1 &&
        (f.quantized_elements % 2 != 0 || f.elements_per_sf % 2 != 0)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "e2m1 needs even element counts, got quantized_elements = %d, "
          "elements_per_sf = %d",
          f.quantized_elements, f.elements_per_sf));
    }
  }
  if (f.scale_rounding != ScaleRounding::kNone &&
      f.scale_rounding != ScaleRounding::kPow2Ceil) {
    return absl::InvalidArgumentError(
        absl::StrFormat("scale_rounding = %d is not none or pow2_ceil",
                        static_cast<int>(f.scale_rounding)));
  }
  if (f.scale_rounding == ScaleRounding::kPow2Ceil &&
      f.sf_format != ScaleFormat::kFP32) {
    return absl::InvalidArgumentError(
        absl::StrCat("scale_rounding pow2_ceil needs sf_format fp32 (got ",
                     ScaleFormatName(f.sf_format), ")"));
  }
  if (f.do_cast && !f.token_interleaved && f.quantized()) {
    return absl::InvalidArgumentError(
        "do_cast (main/SWA) formats must be token_interleaved");
  }
  return absl::OkStatus();
}

absl::StatusOr<KVCacheFormat> MakeFormat(
    QuantDtype dtype, int32_t quantized_elements, int32_t elements_per_sf,
    int32_t bf16_elements, bool do_cast, ScaleFormat sf_format,
    bool token_interleaved, ScaleRounding scale_rounding) {
  const KVCacheFormat f{
      dtype,   quantized_elements, elements_per_sf,   bf16_elements,
      do_cast, sf_format,          token_interleaved, scale_rounding};
  RETURN_IF_ERROR(ValidateFormat(f));
  return f;
}

absl::StatusOr<KVCacheFormat> NamedFormat(FormatId id, int32_t bf16_elements) {
  if (id == FormatId::kBf16) {
    const KVCacheFormat f = Bf16Format(bf16_elements);
    RETURN_IF_ERROR(ValidateFormat(f));
    return f;
  }
  for (const NamedEntry& e : kQuantizedFormats) {
    if (e.id != id) continue;
    if (bf16_elements != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "format %s takes no element count (got %d)", e.name, bf16_elements));
    }
    return e.format;
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("unknown format id %d", static_cast<int>(id)));
}

absl::StatusOr<KVCacheFormat> FormatFromName(absl::string_view name) {
  const std::string upper = absl::AsciiStrToUpper(name);
  for (const NamedEntry& e : kQuantizedFormats) {
    if (upper == e.name) return e.format;
  }
  absl::string_view rest = upper;
  if (rest.size() > 6 && rest.substr(0, 5) == "BF16(" && rest.back() == ')') {
    rest = rest.substr(5, rest.size() - 6);
    // Digits only: SimpleAtoi alone would also take "+4" and " 4".
    const bool digits =
        !rest.empty() && rest.size() <= 9 &&
        std::all_of(rest.begin(), rest.end(), absl::ascii_isdigit);
    int32_t n = 0;
    if (digits && absl::SimpleAtoi(rest, &n)) {
      return NamedFormat(FormatId::kBf16, n);
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown format \"", name,
      "\"; expected V41, V41_FP4, FP4_INDEX, FP8_FP32SF_INDEX, MXFP8_INDEX, "
      "DS_MLA_FP8 or BF16(N)"));
}

std::optional<FormatId> IdentifyFormat(const KVCacheFormat& f) {
  for (const NamedEntry& e : kQuantizedFormats) {
    if (f == e.format) return e.id;
  }
  if (f.bf16_elements > 0 && f == Bf16Format(f.bf16_elements) &&
      ValidateFormat(f).ok()) {
    return FormatId::kBf16;
  }
  return std::nullopt;
}

absl::StatusOr<std::string> FormatName(const KVCacheFormat& f) {
  const std::optional<FormatId> id = IdentifyFormat(f);
  if (!id.has_value()) {
    return absl::InvalidArgumentError("not one of the supported formats");
  }
  if (*id == FormatId::kBf16)
    return absl::StrCat("BF16(", f.bf16_elements, ")");
  for (const NamedEntry& e : kQuantizedFormats) {
    if (e.id == *id) return std::string(e.name);
  }
  return absl::InternalError("unreachable");
}

absl::string_view ScaleFormatName(ScaleFormat f) {
  switch (f) {
    case ScaleFormat::kNone:
      return "none";
    case ScaleFormat::kUE8M0:
      return "ue8m0";
    case ScaleFormat::kE4M3:
      return "e4m3";
    case ScaleFormat::kFP32:
      return "fp32";
  }
  return "invalid";
}

absl::string_view ScaleRoundingName(ScaleRounding r) {
  switch (r) {
    case ScaleRounding::kNone:
      return "none";
    case ScaleRounding::kPow2Ceil:
      return "pow2_ceil";
  }
  return "invalid";
}

absl::StatusOr<ScaleRounding> ScaleRoundingFromName(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  for (ScaleRounding r : {ScaleRounding::kNone, ScaleRounding::kPow2Ceil}) {
    if (lower == ScaleRoundingName(r)) return r;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown scale_rounding \"", name, "\"; expected none or pow2_ceil"));
}

absl::string_view QuantDtypeName(QuantDtype d) {
  switch (d) {
    case QuantDtype::kNone:
      return "none";
    case QuantDtype::kE4M3:
      return "e4m3";
    case QuantDtype::kE2M1:
      return "e2m1";
  }
  return "invalid";
}

absl::StatusOr<ScaleFormat> ScaleFormatFromName(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  for (ScaleFormat f : {ScaleFormat::kNone, ScaleFormat::kUE8M0,
                        ScaleFormat::kE4M3, ScaleFormat::kFP32}) {
    if (lower == ScaleFormatName(f)) return f;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown sf_format \"", name, "\"; expected none, ue8m0, e4m3 or fp32"));
}

absl::StatusOr<KVCacheFormat> ResolveFormat(int64_t bytes_per_token,
                                            std::optional<ScaleFormat> hint) {
  std::vector<const NamedEntry*> candidates;
  if (!hint.has_value() || *hint != ScaleFormat::kNone) {
    for (const NamedEntry& e : kQuantizedFormats) {
      if (e.format.bytes_per_token() != bytes_per_token) continue;
      if (hint.has_value() && e.format.sf_format != *hint) continue;
      candidates.push_back(&e);
    }
  }
  if (candidates.size() == 1) return candidates[0]->format;
  if (candidates.size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bytes_per_token = ", bytes_per_token, " is ambiguous: ",
        absl::StrJoin(candidates, " or ",
                      [](std::string* out, const NamedEntry* e) {
                        absl::StrAppend(out, e->name, " (sf_format ",
                                        ScaleFormatName(e->format.sf_format),
                                        ")");
                      }),
        "; pass an sf_format hint"));
  }
  const bool bf16_allowed = !hint.has_value() || *hint == ScaleFormat::kNone;
  if (bf16_allowed && bytes_per_token % 4 == 0 && bytes_per_token >= 4 &&
      bytes_per_token / 2 <= kMaxElements) {
    return NamedFormat(FormatId::kBf16,
                       static_cast<int32_t>(bytes_per_token / 2));
  }
  return absl::NotFoundError(absl::StrCat(
      "no supported format has bytes_per_token = ", bytes_per_token,
      hint.has_value() ? absl::StrCat(" and sf_format ", ScaleFormatName(*hint))
                       : "",
      "; supported: V41 528, V41_FP4 288, FP4_INDEX 68, FP8_FP32SF_INDEX 132, "
      "MXFP8_INDEX 132, DS_MLA_FP8 656, BF16(N) 2N with N even"));
}

absl::StatusOr<PoolLayout> MakePoolLayout(const KVCacheFormat& format,
                                          int64_t block_size,
                                          int64_t num_blocks,
                                          int64_t num_layers) {
  RETURN_IF_ERROR(ValidateFormat(format));
  if (block_size <= 0 || num_blocks <= 0 || num_layers <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "block_size, num_blocks and num_layers must be positive, got %d, %d, "
        "%d",
        block_size, num_blocks, num_layers));
  }
  // Slots are int32 in every request (slot = block * block_size + offset).
  constexpr int64_t kMaxSlots = std::numeric_limits<int32_t>::max();
  if (block_size > kMaxSlots || num_blocks > kMaxSlots / block_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "num_blocks * block_size = %d * %d exceeds the int32 slot range",
        num_blocks, block_size));
  }
  // Bound every product below so that int64 cannot overflow.
  constexpr int64_t kMaxPoolBytes = int64_t{1} << 50;
  const int64_t record_bytes = block_size * format.bytes_per_token();
  const int64_t stride = RoundUp(record_bytes, format.block_alignment());
  if (stride > kMaxPoolBytes / num_blocks ||
      RoundUp(stride * num_blocks, kLayerAlignment) >
          kMaxPoolBytes / num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "pool of %d layers x %d blocks x %d bytes exceeds %d bytes", num_layers,
        num_blocks, stride, kMaxPoolBytes));
  }
  return ComputePoolLayout(format, block_size, num_blocks, num_layers);
}

std::string DescribeLayout(const PoolLayout& l) {
  const KVCacheFormat& f = l.format;
  const absl::StatusOr<std::string> name = FormatName(f);
  std::string out;
  absl::StrAppendFormat(&out, "format              %s\n",
                        name.ok() ? *name : std::string("custom"));
  absl::StrAppendFormat(&out, "quantized_dtype     %s\n",
                        QuantDtypeName(f.quantized_dtype));
  absl::StrAppendFormat(&out, "elements            %d\n", f.elements());
  absl::StrAppendFormat(&out, "elements_per_sf     %d\n", f.elements_per_sf);
  absl::StrAppendFormat(&out, "sf_format           %s\n",
                        ScaleFormatName(f.sf_format));
  absl::StrAppendFormat(&out, "do_cast             %s\n",
                        f.do_cast ? "true" : "false");
  absl::StrAppendFormat(&out, "token_interleaved   %s\n",
                        f.token_interleaved ? "true" : "false");
  absl::StrAppendFormat(&out, "bf16_elements       %d\n", f.bf16_elements);
  absl::StrAppendFormat(&out, "scale_rounding      %s\n",
                        ScaleRoundingName(f.scale_rounding));
  absl::StrAppendFormat(&out, "data_bytes          %d\n", f.data_bytes());
  absl::StrAppendFormat(&out, "num_scales          %d\n", f.num_scales());
  absl::StrAppendFormat(&out, "sf_bytes            %d\n", f.sf_bytes());
  absl::StrAppendFormat(&out, "bytes_per_token     %d\n", f.bytes_per_token());
  absl::StrAppendFormat(&out, "block_size          %d\n", l.block_size);
  absl::StrAppendFormat(&out, "block_alignment     %d\n", f.block_alignment());
  absl::StrAppendFormat(&out, "token_alignment     %d\n",
                        f.token_stride_alignment());
  absl::StrAppendFormat(&out, "block_stride        %d\n", l.block_stride);
  absl::StrAppendFormat(&out, "num_blocks          %d\n", l.num_blocks);
  absl::StrAppendFormat(&out, "layer_bytes         %d\n", l.layer_bytes);
  absl::StrAppendFormat(&out, "layer_stride        %d\n", l.layer_stride);
  absl::StrAppendFormat(&out, "num_layers          %d\n", l.num_layers);
  absl::StrAppendFormat(&out, "total_bytes         %d\n", l.total_bytes);
  absl::StrAppendFormat(&out, "token 0 data/scale  %d / %d\n",
                        l.data_offset(0, 0), l.scale_offset(0, 0));
  if (l.block_size > 1) {
    absl::StrAppendFormat(&out, "token 1 data/scale  %d / %d\n",
                          l.data_offset(0, 1), l.scale_offset(0, 1));
  }
  return out;
}

}  // namespace kvdepot
