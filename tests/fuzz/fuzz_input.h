// FuzzInput: turns fuzz bytes into structured values, the same way in the
// libFuzzer build (clang) and the corpus replay (gcc), so a committed input
// means the same call in both. Values are read front to back; an exhausted
// input reads as zeros, so every input decodes to some call.
//
// Int32()/Int64() read one byte: below 0xF0 it is a small value (byte - 16,
// i.e. -16..223), 0xF0..0xFD pick an edge (0, +-1 around the int32/int64
// limits and powers of two), 0xFE/0xFF read 4/8 raw little-endian bytes.
// Mutations then move between small, edge and arbitrary values.
#ifndef KVDEPOT_TESTS_FUZZ_FUZZ_INPUT_H_
#define KVDEPOT_TESTS_FUZZ_FUZZ_INPUT_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace kvdepot::fuzz {

// Stops the run with a message: a property the target checks failed. The
// replay test and libFuzzer both report an abort as a failure.
#define FUZZ_CHECK(cond, ...)                                          \
  do {                                                                 \
    if (!(cond)) {                                                     \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK(%s) failed: ", __FILE__, \
                   __LINE__, #cond);                                   \
      std::fprintf(stderr, __VA_ARGS__);                               \
      std::fprintf(stderr, "\n");                                      \
      std::abort();                                                    \
    }                                                                  \
  } while (0)

class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  size_t remaining() const { return size_; }

  uint8_t Byte() {
    if (size_ == 0) return 0;
    --size_;
    return *data_++;
  }
  bool Bool() { return (Byte() & 1) != 0; }

  // A value in [lo, hi] (lo <= hi), small values first.
  int64_t Range(int64_t lo, int64_t hi) {
    const uint64_t span = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo);
    uint64_t v = 0;
    for (uint64_t s = span; s != 0; s >>= 8) v = (v << 8) | Byte();
    if (span != std::numeric_limits<uint64_t>::max()) v %= span + 1;
    return static_cast<int64_t>(static_cast<uint64_t>(lo) + v);
  }

  int32_t Int32() {
    static constexpr int64_t kEdges[14] = {0,
                                           -1,
                                           1,
                                           INT32_MAX,
                                           INT32_MAX - 1,
                                           INT32_MIN,
                                           INT32_MIN + 1,
                                           1 << 16,
                                           (1 << 16) + 1,
                                           1 << 24,
                                           (1 << 30) + 1,
                                           1 << 30,
                                           65535,
                                           1000003};
    const uint8_t b = Byte();
    if (b < 0xF0) return static_cast<int32_t>(b) - 16;
    if (b < 0xFE) return static_cast<int32_t>(kEdges[b - 0xF0]);
    return static_cast<int32_t>(Raw(4));
  }

  int64_t Int64() {
    static constexpr int64_t kEdges[14] = {0,
                                           -1,
                                           INT64_MAX,
                                           INT64_MIN,
                                           INT32_MAX,
                                           INT32_MIN,
                                           int64_t{1} << 32,
                                           (int64_t{1} << 32) + 1,
                                           int64_t{1} << 62,
                                           -(int64_t{1} << 62),
                                           0x5555555555555556,
                                           -0x5555555555555556,
                                           int64_t{1} << 40,
                                           (int64_t{1} << 24) + 1};
    const uint8_t b = Byte();
    if (b < 0xF0) return static_cast<int64_t>(b) - 16;
    if (b < 0xFE) return kEdges[b - 0xF0];
    return static_cast<int64_t>(Raw(b == 0xFE ? 4 : 8));
  }

  // n values of Int32().
  std::vector<int32_t> Int32s(size_t n) {
    std::vector<int32_t> v(n);
    for (int32_t& x : v) x = Int32();
    return v;
  }

  // A length-prefixed byte string of at most max_len bytes.
  std::string Bytes(size_t max_len) {
    const size_t n =
        static_cast<size_t>(Range(0, static_cast<int64_t>(max_len)));
    return Take(n);
  }
  // Everything not read yet.
  std::string Rest() { return Take(size_); }

 private:
  uint64_t Raw(int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i)
      v |= static_cast<uint64_t>(Byte()) << (8 * i);
    if (bytes == 4)
      return static_cast<uint64_t>(
          static_cast<int64_t>(static_cast<int32_t>(v)));
    return v;
  }
  std::string Take(size_t n) {
    if (n > size_) n = size_;
    std::string s(reinterpret_cast<const char*>(data_), n);
    data_ += n;
    size_ -= n;
    return s;
  }

  const uint8_t* data_;
  size_t size_;
};

}  // namespace kvdepot::fuzz

#endif  // KVDEPOT_TESTS_FUZZ_FUZZ_INPUT_H_
