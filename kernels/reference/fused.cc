// The fused store's CPU reference (SPEC §8). Per token, in fp32, each
// operation rounded as written (this file is compiled with
// -ffp-contract=off, so a * b - c * d is two products and a difference):
//   1. RMSNorm: sum of squares in the tree of FusedSumOfSquares, mean =
//      sum / len, r = 1 / sqrt(mean + eps), y = (x * r) * w;
//   2. RoPE: (a, b) -> (a * cos - b * sin, b * cos + a * sin);
//   3. Hadamard: butterflies h = 1, 2, 4, ...: (a, b) -> (a + b, a - b),
//      then * kHadamardScaleBits[log2 len];
//   4. round to BF16 (nearest even, NaN canonical);
//   5. quantize and scatter: exactly Store of the BF16 values;
//   6. cast_back: the load of the record (DecodeTokenBf16).
#include "kernels/reference/fused.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/format_host.h"
#include "kernels/fused_host.h"
#include "kernels/quant.h"
#include "kernels/reference/reference.h"
#include "kernels/store_load_host.h"

namespace kvdepot {

float FusedSumOfSquares(const float* x, int32_t begin, int32_t end) {
  // Slot j (0..31) sums, in increasing order, the 8-element chunks c (the
  // token's elements [8c, 8c + 8)) inside the range with c % 32 == j; a
  // chunk is summed left to right. Then slot[j] += slot[j + h] for h = 16,
  // 8, 4, 2, 1 and the total is slot[0].
  float slot[32] = {};
  for (int32_t c = begin / 8; c < end / 8; ++c) {
    const float* v = x + 8 * c;
    float s = v[0] * v[0];
    for (int k = 1; k < 8; ++k) s = s + v[k] * v[k];
    slot[c % 32] = slot[c % 32] + s;
  }
  for (int h = 16; h >= 1; h /= 2) {
    for (int j = 0; j < h; ++j) slot[j] = slot[j] + slot[j + h];
  }
  return slot[0];
}

void FusedTransformToken(const KVCacheFormat& format, const FusedParams& p,
                         int64_t position, const uint16_t* x, uint16_t* out) {
  const int32_t d = format.elements();
  std::vector<float> y(static_cast<size_t>(d));
  for (int32_t i = 0; i < d; ++i) y[i] = Bf16ToFloat(x[i]);
  if (p.norm()) {
    const float len = static_cast<float>(p.norm_end - p.norm_begin);
    const float sum = FusedSumOfSquares(y.data(), p.norm_begin, p.norm_end);
    const float r = 1.0f / std::sqrt(sum / len + p.eps);
    for (int32_t i = p.norm_begin; i < p.norm_end; ++i) {
      y[i] = (y[i] * r) * Bf16ToFloat(p.norm_weight[i - p.norm_begin]);
    }
  }
  if (p.rope != RopeStyle::kNone) {
    const int32_t half = p.rope_dim / 2;
    const float* cs = p.cos_sin + position * p.rope_dim;
    float* r = y.data() + p.rope_offset;
    for (int32_t k = 0; k < half; ++k) {
      const bool neox = p.rope == RopeStyle::kNeox;
      float& a = neox ? r[k] : r[2 * k];
      float& b = neox ? r[k + half] : r[2 * k + 1];
      const float c = cs[k], s = cs[half + k];
      const float a2 = a * c - b * s;
      const float b2 = b * c + a * s;
      a = a2;
      b = b2;
    }
  }
  if (p.hadamard()) {
    float* v = y.data() + p.hadamard_begin;
    int log2 = 0;
    for (int32_t h = 1; h < p.hadamard_len; h *= 2, ++log2) {
      for (int32_t i = 0; i < p.hadamard_len; i += 2 * h) {
        for (int32_t j = i; j < i + h; ++j) {
          const float a = v[j], b = v[j + h];
          v[j] = a + b;
          v[j + h] = a - b;
        }
      }
    }
    const float scale = BitsToFloat(kHadamardScaleBits[log2]);
    for (int32_t i = 0; i < p.hadamard_len; ++i) v[i] = v[i] * scale;
  }
  for (int32_t i = 0; i < d; ++i) out[i] = FloatToBf16(y[i]);
}

absl::Status FusedStore(const PoolLayout& layout, uint8_t* layer,
                        const uint16_t* kv, const FusedParams& params,
                        absl::Span<const int32_t> slots, uint16_t* cast_back) {
  const KVCacheFormat& f = layout.format;
  if (absl::Status s = ValidateQuantization(f); !s.ok()) return s;
  const size_t n = slots.size();
  const absl::Span<const int64_t> positions =
      params.rope != RopeStyle::kNone && params.positions != nullptr
          ? absl::MakeConstSpan(params.positions, n)
          : absl::Span<const int64_t>();
  if (params.rope != RopeStyle::kNone && params.positions == nullptr && n > 0) {
    return absl::InvalidArgumentError("positions is null with rope on");
  }
  if (absl::Status s = ValidateFused(f, params, positions); !s.ok()) return s;
  if (absl::Status s = ValidateSlotMapping(layout, slots); !s.ok()) return s;
  if (n == 0) return absl::OkStatus();
  if (kv == nullptr || layer == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(kv == nullptr ? "kv" : "layer", " is null with n = ", n));
  }
  const int32_t d = f.elements();
  std::vector<uint16_t> y(n * static_cast<size_t>(d));
  for (size_t t = 0; t < n; ++t) {
    FusedTransformToken(f, params, positions.empty() ? 0 : positions[t],
                        kv + t * d, y.data() + t * d);
  }
  if (absl::Status s = Store(layout, layer, y.data(), InputDtype::kBF16, slots);
      !s.ok()) {
    return s;
  }
  if (cast_back == nullptr) return absl::OkStatus();
  std::vector<uint8_t> rec(static_cast<size_t>(f.bytes_per_token()));
  for (size_t t = 0; t < n; ++t) {
    const auto* in = reinterpret_cast<const uint8_t*>(y.data() + t * d);
    EncodeTokenBf16(f, in, rec.data(), rec.data() + f.data_bytes());
    DecodeTokenBf16(f, rec.data(), rec.data() + f.data_bytes(),
                    reinterpret_cast<uint8_t*>(cast_back + t * d));
  }
  return absl::OkStatus();
}

}  // namespace kvdepot
