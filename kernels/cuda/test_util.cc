#include "kernels/cuda/test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "kernels/quant.h"

namespace kvdepot::gpu {
namespace {

float Special(std::mt19937& rng) {
  static constexpr uint32_t kBits[] = {
      0x7FC00000u, 0xFFC00001u, 0x7F800000u, 0xFF800000u, 0x80000000u,
      0x00000000u, 0x00010000u, 0x80010000u, 0x7F7F0000u, 0xFF7F0000u};
  return BitsToFloat(kBits[rng() % (sizeof(kBits) / sizeof(kBits[0]))]);
}

constexpr int64_t kDistinctTokens = 8192;

}  // namespace

std::vector<uint8_t> RandomKv(std::mt19937& rng, int64_t n, int32_t elements,
                              InputDtype dtype, bool specials) {
  const size_t size = dtype == InputDtype::kBF16 ? 2 : 4;
  std::vector<uint8_t> out(static_cast<size_t>(n) * elements * size);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-6.0f, 4.0f);
  const size_t row = static_cast<size_t>(elements) * size;
  for (int64_t t = 0; t < n; ++t) {
    if (t >= kDistinctTokens) {  // repeat the first tokens (fast setup)
      std::memcpy(&out[t * row], &out[(t % kDistinctTokens) * row], row);
      continue;
    }
    const float magnitude = std::pow(10.0f, exponent(rng));
    for (int32_t i = 0; i < elements; ++i) {
      const float v =
          specials && rng() % 256 == 0 ? Special(rng) : normal(rng) * magnitude;
      const size_t at = (static_cast<size_t>(t) * elements + i) * size;
      if (dtype == InputDtype::kBF16) {
        const uint16_t h = FloatToBf16(v);
        std::memcpy(&out[at], &h, 2);
      } else {
        std::memcpy(&out[at], &v, 4);
      }
    }
  }
  return out;
}

std::vector<int32_t> RandomSlots(std::mt19937& rng, int64_t n,
                                 int64_t num_slots, int padding_percent) {
  std::vector<int32_t> all(static_cast<size_t>(num_slots));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<size_t>(n));
  for (int32_t& s : all) {
    if (static_cast<int>(rng() % 100) < padding_percent) s = -1;
  }
  return all;
}

std::vector<int32_t> RandomSegments(std::mt19937& rng, const PoolLayout& layout,
                                    int64_t num_segments, int64_t* total_k) {
  std::vector<int32_t> segments;
  int64_t cursor = 0;
  const int64_t bs = layout.block_size;
  for (int64_t s = 0; s < num_segments; ++s) {
    cursor += rng() % 3;  // rows left uncovered
    const int32_t block =
        rng() % 10 == 0 ? -1 : static_cast<int32_t>(rng() % layout.num_blocks);
    const int64_t begin = rng() % (bs + 1);
    const int64_t len = rng() % (bs - begin + 1);
    segments.insert(segments.end(), {block, static_cast<int32_t>(begin),
                                     static_cast<int32_t>(begin + len),
                                     static_cast<int32_t>(cursor)});
    cursor += len;
  }
  *total_k = cursor + 2;
  return segments;
}

std::vector<uint8_t> RandomBytes(std::mt19937& rng, int64_t n) {
  std::vector<uint8_t> out(static_cast<size_t>(n));
  for (size_t i = 0; i < out.size(); i += 4) {
    const uint32_t r = rng();
    for (size_t j = 0; j < 4 && i + j < out.size(); ++j) {
      out[i + j] = static_cast<uint8_t>(r >> (8 * j));
    }
  }
  return out;
}

bool AllZero(const std::vector<uint8_t>& bytes) {
  return std::all_of(bytes.begin(), bytes.end(),
                     [](uint8_t b) { return b == 0; });
}

}  // namespace kvdepot::gpu
