// proto/wire.h: DecodeInt32s with any bytes, count and limit; ReadInt32s and
// EncodeInt32s. Properties: an accepted array has exactly `count` values,
// its bytes round-trip through EncodeInt32s and ReadInt32s; a rejected one
// is INVALID_ARGUMENT with a message naming the field and leaves `out` alone.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "proto/wire.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvdepot::fuzz::FuzzInput in(data, size);
  const int64_t count = in.Int64();
  const int64_t max_count = in.Int64();
  const std::string bytes = in.Rest();
  std::vector<int32_t> out = {7, 7, 7};
  const absl::Status s = kvdepot::DecodeInt32s("field_x", bytes, "count_y",
                                               count, max_count, &out);
  if (s.ok()) {
    FUZZ_CHECK(count >= 0 && count <= max_count, "count %lld max %lld",
               static_cast<long long>(count),
               static_cast<long long>(max_count));
    FUZZ_CHECK(static_cast<int64_t>(out.size()) == count, "size %zu",
               out.size());
    FUZZ_CHECK(bytes.size() == out.size() * 4, "bytes %zu", bytes.size());
    std::string again = "junk";
    kvdepot::EncodeInt32s(out, &again);
    FUZZ_CHECK(again == bytes, "EncodeInt32s does not round-trip");
    FUZZ_CHECK(kvdepot::ReadInt32s(bytes) == out, "ReadInt32s differs");
  } else {
    FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument, "code %d",
               static_cast<int>(s.code()));
    FUZZ_CHECK(s.message().find("count_y") != absl::string_view::npos,
               "message does not name the count: %s",
               std::string(s.message()).c_str());
    FUZZ_CHECK(out == std::vector<int32_t>({7, 7, 7}), "out changed on error");
  }
  // ReadInt32s takes any bytes (a trailing partial value is ignored).
  FUZZ_CHECK(kvdepot::ReadInt32s(bytes).size() == bytes.size() / 4,
             "ReadInt32s size");
  return 0;
}
