// The CPU reference of the e4m3 + fp32 pow2_ceil records with a BF16 tail
// (DS_MLA_FP8, SPEC §2.1): the math is FlashMLA's tests/quant.py at commit
// 9241ae3 (V32_FP8Sparse), written here from the definition in SPEC §2.1.
//
// One record (DS_MLA_FP8: G = 128, T = 4 tiles, tail 64):
//
//   [ T x G e4m3 codes | T fp32 scales (little-endian) | tail BF16 values ]
//
// Per tile, by what the tile holds:
//   finite:   s = 2^ceil(log2(max(amax / 448, 1e-4))), q = e4m3(x / s) RNE
//             (x / s is exact and |x / s| <= 448: no saturation happens)
//   a NaN:    scale bits 0x7FFFFFFF, every code 0x7F
//   an Inf:   scale +Inf; finite x -> signed zero, ±Inf -> 0x7F
// The tail is copied bit for bit. Decode: q x s in fp32 (then BF16 RNE for
// the load), tail copied.
#include <cstdint>
#include <cstring>

#include "kernels/format.h"
#include "kernels/quant.h"
#include "kernels/reference/reference_internal.h"

namespace kvdepot::internal {

void EncodePow2Record(const KVCacheFormat& f, const uint8_t* x, uint8_t* data,
                      uint8_t* scales) {
  const int group = f.elements_per_sf;
  const int tiles = f.quantized_elements / group;
  for (int t = 0; t < tiles; ++t) {
    const uint8_t* xt = x + 2 * static_cast<int64_t>(t) * group;
    uint8_t* q = data + static_cast<int64_t>(t) * group;
    auto at = [xt](int i) {
      uint16_t h;
      memcpy(&h, xt + 2 * i, 2);
      return Bf16ToFloat(h);
    };
    bool nan = false, inf = false;
    float amax = 0.0f;
    for (int i = 0; i < group; ++i) {
      const float xi = at(i);
      const uint32_t a = FloatBits(xi) & 0x7FFFFFFFu;
      nan |= a > 0x7F800000u;
      inf |= a == 0x7F800000u;
      amax = AmaxUpdate(amax, xi);
    }
    uint32_t scale_bits;
    if (nan) {
      scale_bits = kDsMlaNanScaleBits;
      memset(q, kE4M3NaN, group);
    } else if (inf) {
      scale_bits = kDsMlaInfScaleBits;
      for (int i = 0; i < group; ++i) q[i] = DsMlaInfTileCode(at(i));
    } else {
      const int e = DsMlaScaleExponent(amax);
      scale_bits = static_cast<uint32_t>(e + 127) << 23;
      const float inv = Exp2i(-e);  // x * 2^-e == x / 2^e, both exact roundings
      for (int i = 0; i < group; ++i) q[i] = EncodeE4M3(at(i) * inv);
    }
    memcpy(scales + 4 * t, &scale_bits, 4);
  }
  memcpy(scales + f.sf_bytes(),
         x + 2 * static_cast<int64_t>(f.quantized_elements), f.tail_bytes());
}

void DecodePow2Record(const KVCacheFormat& f, const uint8_t* data,
                      const uint8_t* scales, bool bf16_out, uint8_t* out) {
  const int group = f.elements_per_sf;
  const int n = f.quantized_elements;
  for (int i = 0; i < n; ++i) {
    float s;
    memcpy(&s, scales + 4 * (i / group), 4);
    const float v = DecodeE4M3(data[i]) * s;
    if (bf16_out) {
      const uint16_t h = FloatToBf16(v);
      memcpy(out + 2 * static_cast<int64_t>(i), &h, 2);
    } else {
      memcpy(out + 4 * static_cast<int64_t>(i), &v, 4);
    }
  }
  const uint8_t* tail = scales + f.sf_bytes();
  if (bf16_out) {
    memcpy(out + 2 * static_cast<int64_t>(n), tail, f.tail_bytes());
    return;
  }
  for (int i = 0; i < f.bf16_elements; ++i) {
    uint16_t h;
    memcpy(&h, tail + 2 * i, 2);
    const float v = Bf16ToFloat(h);
    memcpy(out + 4 * (static_cast<int64_t>(n) + i), &v, 4);
  }
}

}  // namespace kvdepot::internal
