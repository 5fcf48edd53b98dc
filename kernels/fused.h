// The fused store's parameters (SPEC §8): per token, RMSNorm -> RoPE ->
// Hadamard -> round to BF16 -> quantize with the format's math -> scatter by
// slot, optionally writing the BF16 a later load returns (cast_back). Plain
// struct, usable from device code; validated by ValidateFused
// (fused_host.h). Every array is host memory for the CPU reference and
// device memory for the CUDA kernel.
//
// Ranges are element indices of a token [0, D), D = format.elements():
//   norm:     [norm_begin, norm_end), both multiples of 8 (the reduction
//             tree of SPEC §8 works on 8-element chunks)
//   rope:     [rope_offset, rope_offset + rope_dim), rope_dim even
//   hadamard: [hadamard_begin, hadamard_begin + hadamard_len), len one of
//             kHadamardLengths
#ifndef KVDEPOT_KERNELS_FUSED_H_
#define KVDEPOT_KERNELS_FUSED_H_

#include <cstdint>

#include "kernels/host_device.h"

namespace kvdepot {

enum class RopeStyle : uint8_t {
  kNone = 0,
  kNeox = 1,         // rotates (i, i + rope_dim / 2)
  kInterleaved = 2,  // rotates (2i, 2i + 1) (DeepSeek MLA)
};

// Hadamard lengths the fused store supports (the CUDA kernel is specialized
// on each); others are refused.
inline constexpr int32_t kHadamardLengths[] = {64, 128, 256, 512};
// Largest token (elements) the fused store takes (the CUDA kernel stages a
// token in shared memory).
inline constexpr int32_t kFusedMaxElements = 1024;

// len^(-1/2) as fp32 bits, per log2(len) (SPEC §8): even exponents are
// exact powers of two, odd ones the fp32 nearest 2^-k * 2^(-1/2)
// (0x3F3504F3 = fp32(1 / sqrt(2)) with the exponent lowered).
inline constexpr uint32_t kHadamardScaleBits[] = {
    0x3F800000u,  // 1
    0x3F3504F3u,  // 2
    0x3F000000u,  // 4
    0x3EB504F3u,  // 8
    0x3E800000u,  // 16
    0x3E3504F3u,  // 32
    0x3E000000u,  // 64
    0x3DB504F3u,  // 128
    0x3D800000u,  // 256
    0x3D3504F3u,  // 512
    0x3D000000u,  // 1024
};

struct FusedParams {
  // RMSNorm (off when norm_end == norm_begin).
  int32_t norm_begin = 0;
  int32_t norm_end = 0;
  const uint16_t* norm_weight = nullptr;  // BF16 [norm_end - norm_begin]
  float eps = 1e-6f;
  // RoPE (off when rope == kNone).
  RopeStyle rope = RopeStyle::kNone;
  int32_t rope_offset = 0;
  int32_t rope_dim = 0;
  const int64_t* positions = nullptr;  // [n]; each in [0, max_position)
  const float* cos_sin = nullptr;      // [max_position][rope_dim]: cos | sin
  int64_t max_position = 0;
  // Hadamard (off when hadamard_len == 0).
  int32_t hadamard_begin = 0;
  int32_t hadamard_len = 0;

  KV_HD constexpr bool norm() const { return norm_end > norm_begin; }
  KV_HD constexpr bool hadamard() const { return hadamard_len > 0; }
};

}  // namespace kvdepot

#endif  // KVDEPOT_KERNELS_FUSED_H_
