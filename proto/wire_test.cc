#include "proto/wire.h"

#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

TEST(WireTest, RoundTripsEveryValue) {
  std::mt19937 rng(301);
  for (int n : {0, 1, 3, 7, 17, 133}) {
    std::vector<int32_t> v(n);
    for (int32_t& x : v) x = static_cast<int32_t>(rng());
    if (n > 0) v[0] = -1;
    std::string bytes;
    EncodeInt32s(v, &bytes);
    ASSERT_EQ(bytes.size(), static_cast<size_t>(4 * n));
    std::vector<int32_t> out = {42};
    ASSERT_TRUE(DecodeInt32s("f", bytes, "n", n, 1000, &out).ok());
    EXPECT_EQ(out, v);
    EXPECT_EQ(ReadInt32s(bytes), v);
  }
}

TEST(WireTest, LittleEndianOnTheWire) {
  std::string bytes;
  EncodeInt32s(std::vector<int32_t>{0x01020304, -1}, &bytes);
  EXPECT_EQ(bytes, std::string("\x04\x03\x02\x01\xff\xff\xff\xff", 8));
}

TEST(WireTest, RejectsCountAndLengthMismatches) {
  std::vector<int32_t> out = {7, 8};
  const std::vector<int32_t> before = out;
  absl::Status s = DecodeInt32s("slot_mapping", std::string(12, '\0'),
                                "num_tokens", 4, 100, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("slot_mapping holds 12 bytes, expected 4 bytes x "
                        "(num_tokens = 4) = 16"));
  EXPECT_EQ(out, before);
  s = DecodeInt32s("slot_mapping", "", "num_tokens", -1, 100, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("num_tokens = -1 is outside [0, 100]"));
  s = DecodeInt32s("slot_mapping", std::string(404, '\0'), "num_tokens", 101,
                   100, &out);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("num_tokens = 101 is outside [0, 100]"));
  EXPECT_EQ(out, before);
}

// Found by //tests/fuzz:wire_fuzz (UBSan): with a limit beyond 2^61 the
// length check multiplied count * 4 and overflowed int64.
TEST(WireTest, HugeCountWithHugeLimitDoesNotOverflow) {
  std::vector<int32_t> out;
  const int64_t huge = int64_t{0x5555555555555556};
  const absl::Status s = DecodeInt32s("f", "abcd", "n", huge, INT64_MAX, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("f holds 4 bytes, expected 4 bytes x "
                                     "(n = 6148914691236517206)"));
}

}  // namespace
}  // namespace kvdepot
