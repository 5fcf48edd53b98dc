// The byte contract of a KV-cache pool (SPEC §2): the format descriptor and
// the layout of one pool layer. Everything here is constexpr, allocation-free
// and usable from CUDA device code; host-only helpers (validation, names,
// resolution from a byte width) live in format_host.h.
//
// One token record, token-interleaved (do_cast formats, e.g. V41 = 528 B):
//
//   +------------------------------+---------------------+
//   | data: quantized_bytes        | scales: sf_bytes    |   bytes_per_token
//   +------------------------------+---------------------+
//
// With a BF16 tail (DS_MLA_FP8, SPEC §2.1: 512 e4m3 + 4 fp32 + 64 BF16 =
// 656 B) the tail follows the scales:
//
//   +-----------------------+-------------------+-------------------------+
//   | data: quantized_bytes | scales: sf_bytes  | tail: 2 * bf16_elements |
//   +-----------------------+-------------------+-------------------------+
//
// One block, interleaved: block_size records back to back, padded to
// block_stride = round_up(block_size * bytes_per_token,
//                         lcm(32, bytes_per_token)).
//
// One block, not interleaved (index formats, BF16):
//
//   +-------------------------------------+--------------------------+-----+
//   | data: block_size * quantized_bytes  | scales: block_size *     | pad |
//   |   (token t at t * quantized_bytes)  |   sf_bytes (t * sf_bytes)|     |
//   +-------------------------------------+--------------------------+-----+
//   block_stride = round_up(block_size * bytes_per_token, 32)
//
// A pool is num_layers such layer regions, each starting on a 256-byte
// boundary. FP4 (e2m1) packs element 2i in the low nibble and element 2i+1 in
// the high nibble of byte i. All byte offsets are int64_t.
#ifndef KVDEPOT_KERNELS_FORMAT_H_
#define KVDEPOT_KERNELS_FORMAT_H_

#include <cstdint>

#include "kernels/host_device.h"

namespace kvdepot {

enum class QuantDtype : uint8_t {
  kNone = 0,  // BF16 records
  kE4M3 = 1,  // 8-bit float, 4 exponent bits, 3 mantissa bits, max 448
  kE2M1 = 2,  // 4-bit float, 2 exponent bits, 1 mantissa bit, max 6
};

enum class ScaleFormat : uint8_t {
  kNone = 0,
  kUE8M0 = 1,  // 1 byte: a power of two 2^(byte - 127)
  kE4M3 = 2,   // 1 byte: an e4m3 value
  kFP32 = 3,   // 4 bytes: little-endian IEEE fp32
};

// How a quantized format's fp32 scale is rounded (SPEC §2.1).
enum class ScaleRounding : uint8_t {
  kNone = 0,      // the fp32 scale as computed (SPEC §3)
  kPow2Ceil = 1,  // rounded up to a power of two (DS_MLA_FP8, SPEC §2.1)
};

// Block alignment of token-interleaved layouts is lcm(32, bytes_per_token),
// of block-split layouts 32 bytes; layers start on kLayerAlignment.
inline constexpr int64_t kBlockAlignment = 32;
inline constexpr int64_t kLayerAlignment = 256;

KV_HD constexpr int64_t Gcd(int64_t a, int64_t b) {
  while (b != 0) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

KV_HD constexpr int64_t Lcm(int64_t a, int64_t b) { return a / Gcd(a, b) * b; }

KV_HD constexpr int64_t RoundUp(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

KV_HD constexpr int32_t ScaleBytes(ScaleFormat f) {
  return f == ScaleFormat::kFP32 ? 4 : (f == ScaleFormat::kNone ? 0 : 1);
}

// Plain descriptor (SPEC §2). Trivially copyable so kernels take it by value.
// Instances built by hand are not validated: use MakeFormat / NamedFormat
// (format_host.h), which never return a half-valid descriptor.
struct KVCacheFormat {
  QuantDtype quantized_dtype = QuantDtype::kNone;
  int32_t quantized_elements = 0;  // logical elements (not bytes)
  int32_t elements_per_sf = 0;     // group size sharing one scale
  int32_t bf16_elements = 0;       // BF16 record, or the BF16 tail of an
                                   // interleaved quantized record
  bool do_cast = false;            // load dequantizes to BF16
  ScaleFormat sf_format = ScaleFormat::kNone;
  bool token_interleaved = false;  // [data | scales (| tail)] per token
  ScaleRounding scale_rounding = ScaleRounding::kNone;  // fp32 scales only

  KV_HD constexpr bool quantized() const {
    return quantized_dtype != QuantDtype::kNone;
  }
  KV_HD constexpr int32_t bits_per_element() const {
    return quantized_dtype == QuantDtype::kE2M1 ? 4 : 8;
  }
  // Logical elements of one token: quantized_elements + bf16_elements (one
  // of them is 0 except for a quantized record with a BF16 tail).
  KV_HD constexpr int32_t elements() const {
    return quantized_elements + bf16_elements;
  }
  // Bytes of the BF16 tail after the scales (quantized formats only).
  KV_HD constexpr int32_t tail_bytes() const {
    return quantized() ? 2 * bf16_elements : 0;
  }
  KV_HD constexpr int32_t quantized_bytes() const {
    return quantized() ? quantized_elements * bits_per_element() / 8 : 0;
  }
  KV_HD constexpr int32_t num_scales() const {
    return quantized()
               ? (quantized_elements + elements_per_sf - 1) / elements_per_sf
               : 0;
  }
  KV_HD constexpr int32_t sf_bytes() const {
    return num_scales() * ScaleBytes(sf_format);
  }
  KV_HD constexpr int32_t bytes_per_token() const {
    return quantized_bytes() + sf_bytes() + 2 * bf16_elements;
  }
  // Bytes of the data part of one record (BF16 payload for kNone).
  KV_HD constexpr int32_t data_bytes() const {
    return quantized() ? quantized_bytes() : 2 * bf16_elements;
  }
  // Block alignment: lcm(32, bytes_per_token) interleaved, else 32.
  KV_HD constexpr int64_t block_alignment() const {
    return token_interleaved ? Lcm(kBlockAlignment, bytes_per_token())
                             : kBlockAlignment;
  }
  // Alignment guaranteed for every token's data start (vector width):
  // gcd(32, bytes_per_token) interleaved, else gcd(32, data_bytes). SPEC §2
  // says 32 for block-split layouts; that holds for the index formats (data
  // rows of 64 or 128 bytes) but not for BF16(N) with 2N not a multiple of
  // 32 (BF16(2) rows are 4 bytes apart), hence the gcd.
  KV_HD constexpr int64_t token_stride_alignment() const {
    return token_interleaved ? Gcd(kBlockAlignment, bytes_per_token())
                             : Gcd(kBlockAlignment, data_bytes());
  }

  friend constexpr bool operator==(const KVCacheFormat&,
                                   const KVCacheFormat&) = default;
};

// The layout of a pool: num_layers regions of num_blocks blocks of
// block_size token slots. Build with MakePoolLayout (format_host.h), which
// validates sizes and overflow; the accessors assume in-range arguments.
struct PoolLayout {
  KVCacheFormat format;
  int64_t block_size = 0;    // token slots per block (any positive integer)
  int64_t num_blocks = 0;    // blocks per layer
  int64_t num_layers = 0;    // layers in the pool
  int64_t block_stride = 0;  // bytes between consecutive blocks
  int64_t layer_bytes = 0;   // num_blocks * block_stride
  int64_t layer_stride = 0;  // layer_bytes rounded up to kLayerAlignment
  int64_t total_bytes = 0;   // num_layers * layer_stride

  KV_HD constexpr int64_t num_slots() const { return num_blocks * block_size; }

  // Byte offset of layer `layer` from the pool base.
  KV_HD constexpr int64_t layer_offset(int64_t layer) const {
    return layer * layer_stride;
  }
  // Offsets below are relative to the start of a layer.
  KV_HD constexpr int64_t block_offset(int64_t block) const {
    return block * block_stride;
  }
  KV_HD constexpr int64_t data_offset(int64_t block, int64_t t) const {
    return format.token_interleaved
               ? block * block_stride + t * format.bytes_per_token()
               : block * block_stride + t * format.data_bytes();
  }
  KV_HD constexpr int64_t scale_offset(int64_t block, int64_t t) const {
    return format.token_interleaved
               ? block * block_stride + t * format.bytes_per_token() +
                     format.data_bytes()
               : block * block_stride + block_size * format.data_bytes() +
                     t * format.sf_bytes();
  }
  // The BF16 tail of an interleaved record: right after its scales.
  KV_HD constexpr int64_t tail_offset(int64_t block, int64_t t) const {
    return scale_offset(block, t) + format.sf_bytes();
  }
  KV_HD constexpr int64_t slot_data_offset(int64_t slot) const {
    return data_offset(slot / block_size, slot % block_size);
  }
  KV_HD constexpr int64_t slot_scale_offset(int64_t slot) const {
    return scale_offset(slot / block_size, slot % block_size);
  }
};

// Computes a layout without validation (for constexpr and device use).
// REQUIRES: format valid, block_size > 0, num_blocks > 0, num_layers > 0,
// and no int64 overflow (MakePoolLayout checks all of this).
KV_HD constexpr PoolLayout ComputePoolLayout(const KVCacheFormat& format,
                                             int64_t block_size,
                                             int64_t num_blocks,
                                             int64_t num_layers) {
  PoolLayout l;
  l.format = format;
  l.block_size = block_size;
  l.num_blocks = num_blocks;
  l.num_layers = num_layers;
  l.block_stride =
      RoundUp(block_size * format.bytes_per_token(), format.block_alignment());
  l.layer_bytes = num_blocks * l.block_stride;
  l.layer_stride = RoundUp(l.layer_bytes, kLayerAlignment);
  l.total_bytes = num_layers * l.layer_stride;
  return l;
}

}  // namespace kvdepot

#endif  // KVDEPOT_KERNELS_FORMAT_H_
