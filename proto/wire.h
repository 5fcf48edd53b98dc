// Packed little-endian integer arrays of the wire format (kvdepot.proto):
// a `bytes` field plus an explicit element count.
#ifndef KVDEPOT_PROTO_WIRE_H_
#define KVDEPOT_PROTO_WIRE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvdepot {

// Decodes `count` int32 values from `bytes` into `out` (resized; capacity is
// reused). Errors (INVALID_ARGUMENT naming the fields): count < 0, count >
// max_count, or bytes.size() != 4 * count.
absl::Status DecodeInt32s(absl::string_view field, absl::string_view bytes,
                          absl::string_view count_field, int64_t count,
                          int64_t max_count, std::vector<int32_t>* out);

// Appends `values` little-endian to `out` after clearing it.
void EncodeInt32s(absl::Span<const int32_t> values, std::string* out);

// Reads the packed int32 array without validation (tests, clients).
std::vector<int32_t> ReadInt32s(absl::string_view bytes);

}  // namespace kvdepot

#endif  // KVDEPOT_PROTO_WIRE_H_
