// Helpers shared by the reference tests: the formats under test, seeded
// inputs, and an independent per-element error bound derived from a group's
// scale (half a code step of the element type, plus saturation).
#ifndef KVDEPOT_KERNELS_REFERENCE_REFERENCE_TEST_UTIL_H_
#define KVDEPOT_KERNELS_REFERENCE_REFERENCE_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/format.h"
#include "kernels/format_host.h"
#include "kernels/quant.h"

namespace kvdepot::testing {

// Every supported format, plus two BF16 widths (one not a multiple of 32 B).
inline std::vector<std::string> AllFormatNames() {
  return {"V41",         "V41_FP4",   "FP4_INDEX", "FP8_FP32SF_INDEX",
          "MXFP8_INDEX", "BF16(512)", "BF16(6)"};
}

inline std::string ParamName(const std::string& name) {
  std::string out;
  for (char c : name) {
    if ((c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) out += c;
  }
  return out;
}

// n * elements fp32 values: normal samples with a per-group magnitude of
// 2^k, k in [-10, 10], a few exact zeros and one all-zero group per token
// when there are at least two groups.
inline std::vector<float> RandomTokens(const KVCacheFormat& f, int64_t n,
                                       std::mt19937& rng) {
  const int elements = f.elements();
  const int group = f.quantized() ? f.elements_per_sf : elements;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exp(-10, 10);
  std::vector<float> x(static_cast<size_t>(n) * elements);
  for (int64_t t = 0; t < n; ++t) {
    for (int g = 0; g < elements / group; ++g) {
      const float mag = std::ldexp(1.0f, exp(rng));
      const bool zero_group = g == 1 && (t % 3 == 0);
      for (int i = 0; i < group; ++i) {
        float v = normal(rng) * mag;
        if (zero_group || i % 17 == 5) v = 0.0f;
        x[t * elements + g * group + i] = v;
      }
    }
  }
  return x;
}

inline std::vector<uint16_t> ToBf16(const std::vector<float>& x) {
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = FloatToBf16(x[i]);
  return h;
}

// Dequantization multiplier of group g from the stored scale bytes.
inline double GroupScaleValue(const KVCacheFormat& f, const uint8_t* scales,
                              int g) {
  switch (f.sf_format) {
    case ScaleFormat::kUE8M0:
      return std::ldexp(1.0, static_cast<int>(scales[g]) - 127);
    case ScaleFormat::kE4M3:
      return DecodeE4M3(scales[g]);
    case ScaleFormat::kFP32: {
      float s;
      memcpy(&s, scales + 4 * g, 4);
      return s;
    }
    case ScaleFormat::kNone:
      return 1.0;
  }
  return 1.0;
}

// Largest error of one element x quantized with dequant scale `scale`: half
// a code step at |x| / scale, plus whatever lies beyond the saturation
// point, plus 1e-6 relative for the rounded fp32 reciprocal.
inline double ErrorBound(QuantDtype d, double scale, double x) {
  const double y = std::fabs(x) / scale;
  const double qmax = d == QuantDtype::kE4M3 ? 448.0 : 6.0;
  const double yc = y < qmax ? y : qmax;
  double half;
  if (d == QuantDtype::kE4M3) {
    half = yc < 1.0 / 64 ? 1.0 / 1024 : std::ldexp(1.0, std::ilogb(yc) - 4);
  } else {
    half = yc < 2.0 ? 0.25 : (yc < 4.0 ? 0.5 : 1.0);
  }
  return scale * (half + (y - yc)) + 1e-6 * std::fabs(x);
}

}  // namespace kvdepot::testing

#endif  // KVDEPOT_KERNELS_REFERENCE_REFERENCE_TEST_UTIL_H_
