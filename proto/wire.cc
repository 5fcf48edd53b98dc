#include "proto/wire.h"

#include <bit>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvdepot {

static_assert(std::endian::native == std::endian::little,
              "the wire format is little-endian; add byte swaps");

absl::Status DecodeInt32s(absl::string_view field, absl::string_view bytes,
                          absl::string_view count_field, int64_t count,
                          int64_t max_count, std::vector<int32_t>* out) {
  if (count < 0 || count > max_count) {
    return absl::InvalidArgumentError(absl::StrCat(
        count_field, " = ", count, " is outside [0, ", max_count, "]"));
  }
  // Compared by division: count * 4 overflows int64 when max_count is
  // beyond 2^61.
  if (bytes.size() % 4 != 0 ||
      static_cast<uint64_t>(bytes.size() / 4) != static_cast<uint64_t>(count)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " holds ", bytes.size(), " bytes, expected 4 bytes x (",
        count_field, " = ", count, ")",
        count <= INT64_MAX / 4 ? absl::StrCat(" = ", count * 4) : ""));
  }
  out->resize(static_cast<size_t>(count));
  if (count > 0) std::memcpy(out->data(), bytes.data(), bytes.size());
  return absl::OkStatus();
}

void EncodeInt32s(absl::Span<const int32_t> values, std::string* out) {
  out->resize(values.size() * 4);
  if (!values.empty()) std::memcpy(out->data(), values.data(), out->size());
}

std::vector<int32_t> ReadInt32s(absl::string_view bytes) {
  std::vector<int32_t> v(bytes.size() / 4);
  if (!v.empty()) std::memcpy(v.data(), bytes.data(), v.size() * 4);
  return v;
}

}  // namespace kvdepot
