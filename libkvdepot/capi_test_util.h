// Helpers of the library-mode tests: an owning layout handle, seeded inputs
// (BF16 tokens with varied group magnitudes, distinct slots with -1
// padding, random plans with zero segments, fused-store parameters) and
// the formats and block sizes swept.
#ifndef KVDEPOT_LIBKVDEPOT_CAPI_TEST_UTIL_H_
#define KVDEPOT_LIBKVDEPOT_CAPI_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "libkvdepot/kvdepot_kernels.h"

namespace kvdepot::capi_test {

struct LayoutDeleter {
  void operator()(kvdk_layout* l) const { kvdk_layout_destroy(l); }
};
using LayoutPtr = std::unique_ptr<kvdk_layout, LayoutDeleter>;

// A layout or null (the test then fails on kvdk_last_error()).
inline LayoutPtr MakeLayout(const std::string& name, int64_t block_size,
                            int64_t num_blocks, int64_t num_layers) {
  kvdk_layout* l = nullptr;
  if (kvdk_layout_create(name.c_str(), 0, block_size, num_blocks, num_layers,
                         &l) != KVDK_OK) {
    return nullptr;
  }
  return LayoutPtr(l);
}

inline kvdk_layout_info Info(const kvdk_layout* l) {
  kvdk_layout_info info{};
  kvdk_layout_get_info(l, &info, sizeof(info));
  return info;
}

// Every named format, two BF16 widths (one not a multiple of 32 bytes).
inline std::vector<std::string> Formats() {
  return {"V41",         "V41_FP4",    "FP4_INDEX", "FP8_FP32SF_INDEX",
          "MXFP8_INDEX", "DS_MLA_FP8", "BF16(512)", "BF16(6)"};
}

inline std::string ParamName(const std::string& name, int64_t block_size) {
  std::string out;
  for (char c : name) {
    if ((c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) out += c;
  }
  return out + "_bs" + std::to_string(block_size);
}

// BF16 of a float (round to nearest even; inputs here are finite).
inline uint16_t Bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// n x d BF16 values: normal samples, magnitude 2^k per 32 elements
// (k in [-8, 8]), some exact zeros.
inline std::vector<uint16_t> RandomBf16(std::mt19937& rng, int64_t n,
                                        int64_t d) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exp(-8, 8);
  std::vector<uint16_t> x(static_cast<size_t>(n * d));
  for (int64_t t = 0; t < n; ++t) {
    float mag = 1.0f;
    for (int64_t i = 0; i < d; ++i) {
      if (i % 32 == 0) mag = std::ldexp(1.0f, exp(rng));
      const float v = i % 13 == 7 ? 0.0f : normal(rng) * mag;
      x[t * d + i] = Bf16(v);
    }
  }
  return x;
}

inline std::vector<float> RandomFloats(std::mt19937& rng, int64_t n) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = normal(rng);
  return x;
}

// n slots: distinct, in [0, num_slots), about one in five -1; slot 0 and
// the last slot among them when n allows.
inline std::vector<int32_t> RandomSlots(std::mt19937& rng, int64_t n,
                                        int64_t num_slots) {
  std::vector<int32_t> all(static_cast<size_t>(num_slots));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  std::vector<int32_t> slots(static_cast<size_t>(n), -1);
  std::uniform_int_distribution<int> pad(0, 4);
  size_t next = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (pad(rng) == 0 || next == all.size()) continue;
    slots[i] = all[next++];
  }
  // Slot 0 always written (by token 0), the last slot too when n >= 3.
  const int64_t last = n >= 3 ? n - 1 : -1;
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] == 0 || (last >= 0 && slots[i] == num_slots - 1)) {
      slots[i] = -1;
    }
  }
  if (n >= 1) slots[0] = 0;
  if (last >= 0 && num_slots > 1) {
    slots[last] = static_cast<int32_t>(num_slots - 1);
  }
  return slots;
}

// Equal bytes, or the first differing index (gtest would print megabytes).
template <typename T>
::testing::AssertionResult SameBytes(const std::vector<T>& got,
                                     const std::vector<T>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure()
           << "sizes " << got.size() << " vs " << want.size();
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(got[i] == want[i])) {
      return ::testing::AssertionFailure()
             << "first difference at element " << i << ": "
             << static_cast<int64_t>(got[i]) << " vs "
             << static_cast<int64_t>(want[i]);
    }
  }
  return ::testing::AssertionSuccess();
}

// A valid plan over `num_blocks` blocks of `block_size`: segments of random
// blocks (some -1) and ranges, placed at increasing destinations with gaps
// (rows no segment covers), possibly empty segments.
struct Plan {
  std::vector<int32_t> segments;  // [S][4]
  int64_t total_k = 0;
  int64_t num_segments() const {
    return static_cast<int64_t>(segments.size()) / 4;
  }
};

inline Plan RandomPlan(std::mt19937& rng, int64_t block_size,
                       int64_t num_blocks, int64_t count) {
  Plan p;
  std::uniform_int_distribution<int64_t> block(-1, num_blocks - 1);
  std::uniform_int_distribution<int64_t> pos(0, block_size);
  std::uniform_int_distribution<int> gap(0, 2);
  int64_t dst = 0;
  for (int64_t s = 0; s < count; ++s) {
    int64_t a = pos(rng), b = pos(rng);
    if (a > b) std::swap(a, b);
    dst += gap(rng);
    p.segments.insert(
        p.segments.end(),
        {static_cast<int32_t>(block(rng)), static_cast<int32_t>(a),
         static_cast<int32_t>(b), static_cast<int32_t>(dst)});
    dst += b - a;
  }
  p.total_k = dst + gap(rng);
  return p;
}

// Fused-store parameters for a format of d elements: RMSNorm over the
// first part, interleaved RoPE over the last 64 (when d > 64) and a
// Hadamard of 64 at the start, with their arrays kept here.
struct FusedInputs {
  std::vector<uint16_t> norm_weight;
  std::vector<float> cos_sin;
  std::vector<int64_t> positions;
  kvdk_fused_params params{};
};

inline FusedInputs RandomFused(std::mt19937& rng, int64_t d, int64_t n) {
  FusedInputs f;
  const int32_t rope_dim = d > 64 ? 64 : 0;
  const int32_t norm_end = static_cast<int32_t>(d - rope_dim);
  f.norm_weight = std::vector<uint16_t>(norm_end);
  std::uniform_real_distribution<float> w(0.5f, 1.5f);
  for (uint16_t& x : f.norm_weight) x = Bf16(w(rng));
  const int64_t max_position = 97;
  std::uniform_real_distribution<float> angle(0.0f, 6.283f);
  f.cos_sin.resize(static_cast<size_t>(max_position * std::max(rope_dim, 1)));
  for (int64_t p = 0; p < max_position && rope_dim > 0; ++p) {
    for (int i = 0; i < rope_dim / 2; ++i) {
      const float a = angle(rng);
      f.cos_sin[p * rope_dim + i] = std::cos(a);
      f.cos_sin[p * rope_dim + rope_dim / 2 + i] = std::sin(a);
    }
  }
  std::uniform_int_distribution<int64_t> pos(0, max_position - 1);
  f.positions.resize(static_cast<size_t>(n));
  for (int64_t& p : f.positions) p = pos(rng);
  kvdk_fused_params& p = f.params;
  p.norm_begin = 0;
  p.norm_end = norm_end;
  p.norm_weight = f.norm_weight.data();
  p.eps = 1e-6f;
  p.rope_style = rope_dim > 0 ? KVDK_ROPE_INTERLEAVED : KVDK_ROPE_NONE;
  p.rope_offset = norm_end;
  p.rope_dim = rope_dim;
  p.positions = rope_dim > 0 ? f.positions.data() : nullptr;
  p.cos_sin = rope_dim > 0 ? f.cos_sin.data() : nullptr;
  p.max_position = rope_dim > 0 ? max_position : 0;
  p.hadamard_begin = 0;
  p.hadamard_len = 64;
  return f;
}

// True when the fused store takes the format (elements a multiple of 8, at
// most 1024, at least 64 for the Hadamard of RandomFused).
inline bool FusedFits(int64_t elements) {
  return elements % 8 == 0 && elements >= 64 && elements <= 1024;
}

}  // namespace kvdepot::capi_test

#endif  // KVDEPOT_LIBKVDEPOT_CAPI_TEST_UTIL_H_
