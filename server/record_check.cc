#include "server/record_check.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/quant.h"
#include "kernels/reference/reference.h"

namespace kvdepot {
namespace {

float LoadFp32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

absl::string_view ScaleName(ScaleFormat f) {
  switch (f) {
    case ScaleFormat::kUE8M0:
      return "UE8M0";
    case ScaleFormat::kE4M3:
      return "E4M3";
    case ScaleFormat::kFP32:
      return "FP32";
    default:
      return "none";
  }
}

}  // namespace

bool ScaleIsPossible(ScaleFormat format, const uint8_t* sf) {
  switch (format) {
    case ScaleFormat::kUE8M0:
      return sf[0] != 255;
    case ScaleFormat::kE4M3:
      // 0x7F / 0xFF are NaN; the sign bit is never set by the encoder.
      return (sf[0] & 0x80u) == 0 && (sf[0] & 0x7Fu) != 0x7Fu;
    case ScaleFormat::kFP32: {
      const float f = LoadFp32(sf);
      return std::isfinite(f) && !std::signbit(f);
    }
    default:
      return true;
  }
}

bool Pow2ScaleIsPossible(const uint8_t* sf) {
  uint32_t bits;
  std::memcpy(&bits, sf, 4);
  if (bits == kDsMlaNanScaleBits || bits == kDsMlaInfScaleBits) return true;
  const int e = static_cast<int>(bits >> 23) - 127;  // sign must be clear
  return (bits & 0x807FFFFFu) == 0 && e >= -13 && e <= 121;
}

float ScaleValue(ScaleFormat format, const uint8_t* sf) {
  switch (format) {
    case ScaleFormat::kUE8M0:
      return Ue8m0ToFloat(sf[0]);
    case ScaleFormat::kE4M3:
      return DecodeE4M3(sf[0]);
    case ScaleFormat::kFP32:
      return LoadFp32(sf);
    default:
      return 0.0f;
  }
}

RecordHealth CheckRecord(const PoolLayout& layout, const uint8_t* block,
                         int64_t t, float* values) {
  const KVCacheFormat& f = layout.format;
  RecordHealth h;
  const uint8_t* data = block + layout.data_offset(0, t);
  const uint8_t* scales = block + layout.scale_offset(0, t);
  for (int i = 0; i < f.data_bytes() && h.all_zero; ++i) {
    h.all_zero = data[i] == 0;
  }
  for (int i = 0; i < f.sf_bytes() && h.all_zero; ++i) {
    h.all_zero = scales[i] == 0;
  }
  const int sb = ScaleBytes(f.sf_format);
  // An all-zero record is a slot never written (what a new pool holds), not
  // a corrupt one, even where zero is no encoder's scale (DS_MLA_FP8's fp32
  // 2^e never is 0).
  for (int s = 0; s < f.num_scales() && !h.all_zero; ++s) {
    const bool possible = f.scale_rounding == ScaleRounding::kPow2Ceil
                              ? Pow2ScaleIsPossible(scales + s * sb)
                              : ScaleIsPossible(f.sf_format, scales + s * sb);
    if (!possible) {
      if (h.first_bad_scale < 0) h.first_bad_scale = s;
      ++h.bad_scales;
    }
  }
  if (f.quantized()) {
    DecodeToken(f, data, scales, values);
  } else {
    for (int i = 0; i < f.elements(); ++i) {
      uint16_t bits;
      std::memcpy(&bits, data + 2 * i, 2);
      values[i] = Bf16ToFloat(bits);
    }
  }
  for (int i = 0; i < f.elements(); ++i) {
    if (std::isnan(values[i])) ++h.nan_values;
    if (std::isinf(values[i])) ++h.inf_values;
  }
  return h;
}

std::string DescribeProblem(const PoolLayout& layout, const uint8_t* block,
                            int64_t t, int64_t slot, const RecordHealth& h) {
  const KVCacheFormat& f = layout.format;
  if (h.first_bad_scale >= 0) {
    const uint8_t* sf = block + layout.scale_offset(0, t) +
                        h.first_bad_scale * ScaleBytes(f.sf_format);
    std::string raw;
    for (int i = 0; i < ScaleBytes(f.sf_format); ++i) {
      absl::StrAppendFormat(&raw, "%02x", sf[i]);
    }
    return absl::StrCat("slot ", slot, ": ", ScaleName(f.sf_format), " scale[",
                        h.first_bad_scale, "] = 0x", raw, " (",
                        ScaleValue(f.sf_format, sf), "; no encoder writes it)");
  }
  return absl::StrCat("slot ", slot, ": ", h.nan_values, " NaN and ",
                      h.inf_values, " Inf of ", f.elements(), " values");
}

}  // namespace kvdepot
