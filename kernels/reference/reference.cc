// The CPU reference of store (SPEC §4) and segment load (SPEC §5).
//
// The format is dispatched once per call into a template instantiation
// (Dispatch below); inside, a token is a loop over contiguous groups using
// quant.h's primitives, the same the CUDA kernels use, so both produce the
// same bits (lookup tables built from quant.h's decoders, and the
// branch-free encoders of quant_fast.h, tested equal to quant.h's). A store
// allocates one scratch token per call (widened to fp32 so that the group
// loops vectorize), nothing per token. Inputs and outputs are read and
// written through memcpy, so no pointer needs more than byte alignment.
//
// Load outputs (one row per destination token):
//   do_cast, quantized:  BF16 [elements]            (bf16_rne(q * scale))
//   not quantized:       the record's BF16 bytes     (a copy)
//   index formats:       data  [quantized_bytes]     (a copy)
//                        scales [round_up(sf_bytes, 4)] (a copy, zero padded:
//                        UE8M0 bytes packed four per little-endian int32,
//                        fp32 scales one float per row)
#include "kernels/reference/reference.h"

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "kernels/format.h"
#include "kernels/format_host.h"
#include "kernels/quant.h"
#include "kernels/reference/quant_fast.h"
#include "kernels/reference/reference_internal.h"
#include "kernels/store_load.h"
#include "kernels/store_load_host.h"

namespace kvdepot {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the byte contract is little-endian");

using Q = QuantDtype;
using S = ScaleFormat;

// fp32 values of the 256 e4m3 codes, built once from DecodeE4M3.
const std::array<float, 256> kE4M3Values = [] {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) t[c] = DecodeE4M3(static_cast<uint8_t>(c));
  return t;
}();

// fp32 values of the two e2m1 elements of each byte (low nibble first).
const std::array<std::array<float, 2>, 256> kE2M1PairValues = [] {
  std::array<std::array<float, 2>, 256> t{};
  for (int b = 0; b < 256; ++b) {
    t[b] = {DecodeE2M1(static_cast<uint8_t>(b & 0xF)),
            DecodeE2M1(static_cast<uint8_t>(b >> 4))};
  }
  return t;
}();

template <typename In>
inline float LoadIn(const uint8_t* p, int64_t i) {
  In v;
  memcpy(&v, p + i * static_cast<int64_t>(sizeof(In)), sizeof(In));
  if constexpr (sizeof(In) == 2) {
    return Bf16ToFloat(v);
  } else {
    return v;
  }
}

template <Q D, S F>
inline GroupScale ScaleOf(float amax) {
  if constexpr (F == S::kUE8M0) {
    return Ue8m0Scale(amax, D == Q::kE4M3 ? kE4M3Max : kE2M1Max);
  } else if constexpr (F == S::kE4M3) {
    static_assert(D == Q::kE2M1);
    return E4m3Scale(amax);
  } else {
    static_assert(D == Q::kE4M3 && F == S::kFP32);
    return Fp32Scale(amax);
  }
}

template <S F>
inline float ScaleValue(const uint8_t* scales, int g) {
  if constexpr (F == S::kUE8M0) {
    return Ue8m0ToFloat(scales[g]);
  } else if constexpr (F == S::kE4M3) {
    return kE4M3Values[scales[g]];
  } else {
    float s;
    memcpy(&s, scales + 4 * g, 4);
    return s;
  }
}

// Per-call scratch of EncodeQuantized: one token as fp32, then its codes.
struct Scratch {
  explicit Scratch(int elements) : values(elements), codes(elements) {}
  std::vector<float> values;
  std::vector<uint8_t> codes;
};

// One token: elements values of type In at `x` -> data and scale bytes. The
// token is first widened to fp32 in `scratch`, so that the group loops below
// are plain loops over contiguous floats that the compiler vectorizes.
template <Q D, S F, typename In>
void EncodeQuantized(int elements, int group, const uint8_t* x, uint8_t* data,
                     uint8_t* scales, Scratch& scratch) {
  float* xs = scratch.values.data();
  uint8_t* codes = scratch.codes.data();
  for (int i = 0; i < elements; ++i) xs[i] = LoadIn<In>(x, i);
  const int groups = elements / group;
  for (int g = 0; g < groups; ++g) {
    const float* xg = xs + static_cast<int64_t>(g) * group;
    const float amax = GroupAmaxFast(xg, group);
    const GroupScale gs = ScaleOf<D, F>(amax);
    if constexpr (F == S::kFP32) {
      memcpy(scales + 4 * g, &gs.stored, 4);
    } else {
      scales[g] = static_cast<uint8_t>(gs.stored);
    }
    const float m = gs.multiplier;
    if constexpr (D == Q::kE4M3) {
      uint8_t* d = data + static_cast<int64_t>(g) * group;
      for (int k = 0; k < group; ++k) d[k] = EncodeE4M3Fast(xg[k] * m);
    } else {
      for (int k = 0; k < group; ++k) codes[k] = EncodeE2M1Fast(xg[k] * m);
      uint8_t* d = data + static_cast<int64_t>(g) * group / 2;
      for (int j = 0; j < group / 2; ++j) {
        d[j] = static_cast<uint8_t>(codes[2 * j] | (codes[2 * j + 1] << 4));
      }
    }
  }
}

// BF16 records: BF16 input is copied, fp32 input rounded (RNE).
template <typename In>
void EncodeBf16(int elements, const uint8_t* x, uint8_t* data) {
  if constexpr (sizeof(In) == 2) {
    memcpy(data, x, 2 * static_cast<size_t>(elements));
  } else {
    for (int i = 0; i < elements; ++i) {
      const uint16_t h = FloatToBf16(LoadIn<float>(x, i));
      memcpy(data + 2 * i, &h, 2);
    }
  }
}

// One record -> dequantized values; Out is uint16_t (BF16 bits) or float.
template <Q D, S F, typename Out>
void DecodeQuantized(int elements, int group, const uint8_t* data,
                     const uint8_t* scales, uint8_t* out) {
  const int groups = elements / group;
  auto put = [out](int64_t i, float v) {
    if constexpr (sizeof(Out) == 2) {
      const uint16_t h = FloatToBf16(v);
      memcpy(out + 2 * i, &h, 2);
    } else {
      memcpy(out + 4 * i, &v, 4);
    }
  };
  for (int g = 0; g < groups; ++g) {
    const float sc = ScaleValue<F>(scales, g);
    const int64_t base = static_cast<int64_t>(g) * group;
    if constexpr (D == Q::kE4M3) {
      const uint8_t* d = data + base;
      for (int i = 0; i < group; ++i) put(base + i, kE4M3Values[d[i]] * sc);
    } else {
      const uint8_t* d = data + base / 2;
      for (int i = 0; i < group / 2; ++i) {
        const std::array<float, 2>& v = kE2M1PairValues[d[i]];
        put(base + 2 * i, v[0] * sc);
        put(base + 2 * i + 1, v[1] * sc);
      }
    }
  }
}

// The quantization schemes SPEC §3 defines.
enum class Scheme { kE4m3Ue8m0, kE2m1Ue8m0, kE2m1E4m3, kE4m3Fp32, kNone };

Scheme SchemeOf(const KVCacheFormat& f) {
  if (!f.quantized()) return Scheme::kNone;
  if (f.quantized_dtype == Q::kE4M3 && f.sf_format == S::kUE8M0) {
    return Scheme::kE4m3Ue8m0;
  }
  if (f.quantized_dtype == Q::kE2M1 && f.sf_format == S::kUE8M0) {
    return Scheme::kE2m1Ue8m0;
  }
  if (f.quantized_dtype == Q::kE2M1 && f.sf_format == S::kE4M3) {
    return Scheme::kE2m1E4m3;
  }
  if (f.quantized_dtype == Q::kE4M3 && f.sf_format == S::kFP32) {
    return Scheme::kE4m3Fp32;
  }
  return Scheme::kNone;  // unsupported combination; see ValidateQuantization
}

// Calls fn.template operator()<D, F>() for the format's scheme, once.
template <typename Fn>
void Dispatch(const KVCacheFormat& f, Fn&& fn) {
  switch (SchemeOf(f)) {
    case Scheme::kE4m3Ue8m0:
      return fn.template operator()<Q::kE4M3, S::kUE8M0>();
    case Scheme::kE2m1Ue8m0:
      return fn.template operator()<Q::kE2M1, S::kUE8M0>();
    case Scheme::kE2m1E4m3:
      return fn.template operator()<Q::kE2M1, S::kE4M3>();
    case Scheme::kE4m3Fp32:
      return fn.template operator()<Q::kE4M3, S::kFP32>();
    case Scheme::kNone:
      return fn.template operator()<Q::kNone, S::kNone>();
  }
}

template <Q D, S F, typename In>
void StoreAll(const PoolLayout& layout, uint8_t* layer, const uint8_t* kv,
              absl::Span<const int32_t> slots) {
  const KVCacheFormat& f = layout.format;
  const int elements = f.elements();
  const int64_t row = static_cast<int64_t>(elements) * sizeof(In);
  Scratch scratch(D == Q::kNone ? 0 : elements);
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] < 0) continue;
    const uint8_t* x = kv + static_cast<int64_t>(i) * row;
    uint8_t* data = layer + layout.slot_data_offset(slots[i]);
    if constexpr (D == Q::kNone) {
      EncodeBf16<In>(elements, x, data);
    } else {
      uint8_t* scales = layer + layout.slot_scale_offset(slots[i]);
      EncodeQuantized<D, F, In>(elements, f.elements_per_sf, x, data, scales,
                                scratch);
    }
  }
}

// Copies one segment's raw rows (data and padded scales) or zero rows.
void LoadRawSegment(const PoolLayout& layout, const uint8_t* layer,
                    const Segment& seg, uint8_t* data, uint8_t* scales) {
  const KVCacheFormat& f = layout.format;
  const int64_t data_row = f.data_bytes();
  const int64_t scale_row = LoadScaleRowBytes(f);
  const int64_t sf = f.sf_bytes();
  const int64_t len = seg.len();
  uint8_t* d = data + seg.dst * data_row;
  uint8_t* s = scales == nullptr ? nullptr : scales + seg.dst * scale_row;
  if (seg.block < 0) {
    memset(d, 0, len * data_row);
    if (s != nullptr) memset(s, 0, len * scale_row);
    return;
  }
  if (!f.token_interleaved) {  // a segment is contiguous in the block
    memcpy(d, layer + layout.data_offset(seg.block, seg.begin), len * data_row);
    if (s != nullptr && scale_row == sf) {
      memcpy(s, layer + layout.scale_offset(seg.block, seg.begin), len * sf);
      return;
    }
  } else {
    for (int64_t t = 0; t < len; ++t) {
      memcpy(d + t * data_row,
             layer + layout.data_offset(seg.block, seg.begin + t), data_row);
    }
  }
  if (s == nullptr) return;
  for (int64_t t = 0; t < len; ++t) {
    memcpy(s + t * scale_row,
           layer + layout.scale_offset(seg.block, seg.begin + t), sf);
    memset(s + t * scale_row + sf, 0, scale_row - sf);
  }
}

template <Q D, S F>
void LoadCastSegment(const PoolLayout& layout, const uint8_t* layer,
                     const Segment& seg, uint8_t* data) {
  const KVCacheFormat& f = layout.format;
  const int64_t row = LoadDataRowBytes(f);
  const int64_t len = seg.len();
  uint8_t* d = data + seg.dst * row;
  if (seg.block < 0) {
    memset(d, 0, len * row);
    return;
  }
  for (int64_t t = 0; t < len; ++t) {
    DecodeQuantized<D, F, uint16_t>(
        f.elements(), f.elements_per_sf,
        layer + layout.data_offset(seg.block, seg.begin + t),
        layer + layout.scale_offset(seg.block, seg.begin + t), d + t * row);
  }
}

// e4m3 + fp32 pow2_ceil records with a BF16 tail (DS_MLA_FP8, SPEC §2.1):
// not a §3 scheme, so not in Dispatch.
bool IsPow2(const KVCacheFormat& f) {
  return f.quantized() && f.scale_rounding == ScaleRounding::kPow2Ceil;
}

void StorePow2(const PoolLayout& layout, uint8_t* layer, const uint8_t* kv,
               absl::Span<const int32_t> slots) {
  const int64_t row = 2 * static_cast<int64_t>(layout.format.elements());
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] < 0) continue;
    internal::EncodePow2Record(layout.format,
                               kv + static_cast<int64_t>(i) * row,
                               layer + layout.slot_data_offset(slots[i]),
                               layer + layout.slot_scale_offset(slots[i]));
  }
}

void LoadPow2Segment(const PoolLayout& layout, const uint8_t* layer,
                     const Segment& seg, uint8_t* data) {
  const int64_t row = LoadDataRowBytes(layout.format);
  uint8_t* d = data + seg.dst * row;
  if (seg.block < 0) {
    memset(d, 0, seg.len() * row);
    return;
  }
  for (int64_t t = 0; t < seg.len(); ++t) {
    internal::DecodePow2Record(
        layout.format, layer + layout.data_offset(seg.block, seg.begin + t),
        layer + layout.scale_offset(seg.block, seg.begin + t), true,
        d + t * row);
  }
}

}  // namespace

absl::Status Store(const PoolLayout& layout, uint8_t* layer, const void* kv,
                   InputDtype dtype, absl::Span<const int32_t> slot_mapping) {
  RETURN_IF_ERROR(internal::ValidateLayout(layout));
  RETURN_IF_ERROR(ValidateQuantization(layout.format));
  RETURN_IF_ERROR(ValidateInputDtype(layout.format, dtype));
  RETURN_IF_ERROR(ValidateSlotMapping(layout, slot_mapping));
  if (slot_mapping.empty()) return absl::OkStatus();
  if (layer == nullptr || kv == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(layer == nullptr ? "layer" : "kv",
                     " is null with n = ", slot_mapping.size(), " tokens"));
  }
  const auto* in = static_cast<const uint8_t*>(kv);
  if (IsPow2(layout.format)) {
    StorePow2(layout, layer, in, slot_mapping);
    return absl::OkStatus();
  }
  Dispatch(layout.format, [&]<Q D, S F>() {
    if (dtype == InputDtype::kBF16) {
      StoreAll<D, F, uint16_t>(layout, layer, in, slot_mapping);
    } else {
      StoreAll<D, F, float>(layout, layer, in, slot_mapping);
    }
  });
  return absl::OkStatus();
}

absl::Status LoadSegments(const PoolLayout& layout, const uint8_t* layer,
                          absl::Span<const int32_t> segments, int64_t total_k,
                          void* data, void* scales) {
  RETURN_IF_ERROR(internal::ValidateLayout(layout));
  const KVCacheFormat& f = layout.format;
  const bool cast = f.do_cast && f.quantized();
  if (cast) {
    RETURN_IF_ERROR(ValidateQuantization(f));
  }
  RETURN_IF_ERROR(ValidateSegments(layout, segments, total_k));
  if (segments.empty() || total_k == 0) return absl::OkStatus();
  if (layer == nullptr || data == nullptr ||
      (scales == nullptr && LoadScaleRowBytes(f) > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        layer == nullptr ? "layer" : (data == nullptr ? "data" : "scales"),
        " is null with total_k = ", total_k));
  }
  auto* out = static_cast<uint8_t*>(data);
  auto* out_scales =
      LoadScaleRowBytes(f) > 0 ? static_cast<uint8_t*>(scales) : nullptr;
  const size_t num_segments = segments.size() / kSegmentFields;
  if (cast && IsPow2(f)) {
    for (size_t s = 0; s < num_segments; ++s) {
      LoadPow2Segment(layout, layer, SegmentAt(segments.data(), s), out);
    }
    return absl::OkStatus();
  }
  if (!cast) {
    for (size_t s = 0; s < num_segments; ++s) {
      LoadRawSegment(layout, layer, SegmentAt(segments.data(), s), out,
                     out_scales);
    }
    return absl::OkStatus();
  }
  Dispatch(f, [&]<Q D, S F>() {
    if constexpr (D != Q::kNone) {
      for (size_t s = 0; s < num_segments; ++s) {
        LoadCastSegment<D, F>(layout, layer, SegmentAt(segments.data(), s),
                              out);
      }
    }
  });
  return absl::OkStatus();
}

void EncodeToken(const KVCacheFormat& format, const float* x, uint8_t* data,
                 uint8_t* scales) {
  if (!ValidateQuantization(format).ok()) return;
  if (IsPow2(format)) {  // BF16 input: the values rounded to BF16 first
    std::vector<uint16_t> bf16(static_cast<size_t>(format.elements()));
    for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = FloatToBf16(x[i]);
    internal::EncodePow2Record(
        format, reinterpret_cast<const uint8_t*>(bf16.data()), data, scales);
    return;
  }
  const auto* in = reinterpret_cast<const uint8_t*>(x);
  Dispatch(format, [&]<Q D, S F>() {
    if constexpr (D == Q::kNone) {
      EncodeBf16<float>(format.elements(), in, data);
    } else {
      Scratch scratch(format.elements());
      EncodeQuantized<D, F, float>(format.elements(), format.elements_per_sf,
                                   in, data, scales, scratch);
    }
  });
}

void DecodeToken(const KVCacheFormat& format, const uint8_t* data,
                 const uint8_t* scales, float* out) {
  if (!ValidateQuantization(format).ok()) return;
  auto* o = reinterpret_cast<uint8_t*>(out);
  if (IsPow2(format)) {
    internal::DecodePow2Record(format, data, scales, false, o);
    return;
  }
  Dispatch(format, [&]<Q D, S F>() {
    if constexpr (D == Q::kNone) {
      for (int i = 0; i < format.elements(); ++i) {
        const float v = LoadIn<uint16_t>(data, i);
        memcpy(o + 4 * i, &v, 4);
      }
    } else {
      DecodeQuantized<D, F, float>(format.elements(), format.elements_per_sf,
                                   data, scales, o);
    }
  });
}

void EncodeTokenBf16(const KVCacheFormat& format, const uint8_t* x,
                     uint8_t* data, uint8_t* scales) {
  if (!ValidateQuantization(format).ok()) return;
  if (IsPow2(format)) {
    internal::EncodePow2Record(format, x, data, scales);
    return;
  }
  Dispatch(format, [&]<Q D, S F>() {
    if constexpr (D == Q::kNone) {
      EncodeBf16<uint16_t>(format.elements(), x, data);
    } else {
      Scratch scratch(format.elements());
      EncodeQuantized<D, F, uint16_t>(format.elements(), format.elements_per_sf,
                                      x, data, scales, scratch);
    }
  });
}

void DecodeTokenBf16(const KVCacheFormat& format, const uint8_t* data,
                     const uint8_t* scales, uint8_t* out) {
  if (!ValidateQuantization(format).ok()) return;
  if (IsPow2(format)) {
    internal::DecodePow2Record(format, data, scales, true, out);
    return;
  }
  Dispatch(format, [&]<Q D, S F>() {
    if constexpr (D == Q::kNone) {
      memcpy(out, data, 2 * static_cast<size_t>(format.elements()));
    } else {
      DecodeQuantized<D, F, uint16_t>(format.elements(), format.elements_per_sf,
                                      data, scales, out);
    }
  });
}

}  // namespace kvdepot
