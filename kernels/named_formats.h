// The named formats of SPEC §2, each defined once. These constants are what
// NamedFormat / FormatFromName (format_host.h) return and what the CUDA
// kernels are specialized on (QFormat<kFormatV41>, device_quant.cuh), so the
// host and the device cannot disagree about a format's fields. Like format.h
// this header is constexpr only and compiled by nvcc (no absl).
//
//   name               dtype  elements  group  scale  interleaved  bytes
//   V41                e4m3   512       32     ue8m0  yes          528
//   V41_FP4            e2m1   512       16     e4m3   yes          288
//   FP4_INDEX          e2m1   128       32     ue8m0  no            68
//   FP8_FP32SF_INDEX   e4m3   128       128    fp32   no           132
//   MXFP8_INDEX        e4m3   128       32     ue8m0  no           132
//   BF16(N)            bf16   N (even)  -      -      no           2N
//   DS_MLA_FP8         e4m3   512+64    128    fp32   yes          656
//                      (pow2_ceil scales, 64 BF16 tail values; SPEC §2.1)
#ifndef KVDEPOT_KERNELS_NAMED_FORMATS_H_
#define KVDEPOT_KERNELS_NAMED_FORMATS_H_

#include <cstdint>

#include "kernels/format.h"
#include "kernels/host_device.h"

namespace kvdepot {

// The supported formats; names are part of the API ("V41", "BF16(512)").
// The CUDA launchers dispatch on this id.
enum class FormatId : uint8_t {
  kV41 = 0,             // main / SWA: e4m3 x 512, group 32, ue8m0, 528 B
  kV41Fp4 = 1,          // main: e2m1 x 512, group 16, e4m3 scale, 288 B
  kFp4Index = 2,        // index: e2m1 x 128, group 32, ue8m0, 68 B
  kFp8Fp32SfIndex = 3,  // index: e4m3 x 128, group 128, fp32, 132 B
  kMxfp8Index = 4,      // index: e4m3 x 128, group 32, ue8m0, 132 B
  kBf16 = 5,            // BF16(N): N even >= 2, 2N B
  kDsMlaFp8 = 6,        // DeepSeek-V3.2 MLA: 4 x 128 e4m3, fp32 pow2, BF16 x 64
};

inline constexpr FormatId kAllFormatIds[] = {
    FormatId::kV41,        FormatId::kV41Fp4,
    FormatId::kFp4Index,   FormatId::kFp8Fp32SfIndex,
    FormatId::kMxfp8Index, FormatId::kBf16,
    FormatId::kDsMlaFp8};

inline constexpr KVCacheFormat kFormatV41{
    .quantized_dtype = QuantDtype::kE4M3,
    .quantized_elements = 512,
    .elements_per_sf = 32,
    .do_cast = true,
    .sf_format = ScaleFormat::kUE8M0,
    .token_interleaved = true,
};
inline constexpr KVCacheFormat kFormatV41Fp4{
    .quantized_dtype = QuantDtype::kE2M1,
    .quantized_elements = 512,
    .elements_per_sf = 16,
    .do_cast = true,
    .sf_format = ScaleFormat::kE4M3,
    .token_interleaved = true,
};
inline constexpr KVCacheFormat kFormatFp4Index{
    .quantized_dtype = QuantDtype::kE2M1,
    .quantized_elements = 128,
    .elements_per_sf = 32,
    .do_cast = false,
    .sf_format = ScaleFormat::kUE8M0,
    .token_interleaved = false,
};
inline constexpr KVCacheFormat kFormatFp8Fp32SfIndex{
    .quantized_dtype = QuantDtype::kE4M3,
    .quantized_elements = 128,
    .elements_per_sf = 128,
    .do_cast = false,
    .sf_format = ScaleFormat::kFP32,
    .token_interleaved = false,
};
inline constexpr KVCacheFormat kFormatMxfp8Index{
    .quantized_dtype = QuantDtype::kE4M3,
    .quantized_elements = 128,
    .elements_per_sf = 32,
    .do_cast = false,
    .sf_format = ScaleFormat::kUE8M0,
    .token_interleaved = false,
};

// vLLM fp8_ds_mla / FlashMLA V32_FP8Sparse: [512 e4m3 in 4 tiles of 128 |
// 4 fp32 scales, powers of two | 64 BF16 RoPE values] = 656 bytes.
inline constexpr KVCacheFormat kFormatDsMlaFp8{
    .quantized_dtype = QuantDtype::kE4M3,
    .quantized_elements = 512,
    .elements_per_sf = 128,
    .bf16_elements = 64,
    .do_cast = true,
    .sf_format = ScaleFormat::kFP32,
    .token_interleaved = true,
    .scale_rounding = ScaleRounding::kPow2Ceil,
};

// BF16(n). Not validated: NamedFormat checks that n is even and in range.
KV_HD constexpr KVCacheFormat Bf16Format(int32_t n) {
  return KVCacheFormat{.bf16_elements = n, .do_cast = true};
}

static_assert(kFormatV41.bytes_per_token() == 528);
static_assert(kFormatV41Fp4.bytes_per_token() == 288);
static_assert(kFormatFp4Index.bytes_per_token() == 68);
static_assert(kFormatFp8Fp32SfIndex.bytes_per_token() == 132);
static_assert(kFormatMxfp8Index.bytes_per_token() == 132);
static_assert(kFormatDsMlaFp8.bytes_per_token() == 656 &&
              kFormatDsMlaFp8.elements() == 576);

}  // namespace kvdepot

#endif  // KVDEPOT_KERNELS_NAMED_FORMATS_H_
