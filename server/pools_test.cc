// Pool names: 1..64 bytes of [A-Za-z0-9._-]; a refusal quotes at most 64
// escaped bytes of the name, never the whole of it nor a raw control byte.
#include "server/pools.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/format_host.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(ValidatePoolNameTest, BoundedNamesAndBoundedMessages) {
  EXPECT_TRUE(ValidatePoolName("name", std::string(64, 'a')).ok());
  EXPECT_TRUE(ValidatePoolName("name", "Main-1.v_2").ok());
  absl::Status s = ValidatePoolName("name", std::string(8 << 20, 'a'));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("8388608 bytes"));
  EXPECT_LT(s.message().size(), 200u);
  s = ValidatePoolName("name", std::string(65, 'a'));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidatePoolName("name", "").code(),
            absl::StatusCode::kInvalidArgument);
  s = ValidatePoolName("name", "a\nrpc=forged");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("a\\x0arpc=forged"));
  EXPECT_THAT(std::string(s.message()), Not(HasSubstr("\n")));
  EXPECT_THAT(std::string(s.message()), HasSubstr("character 1"));
}

// PoolInfo.layout describes every byte of a record: data, scales and the
// BF16 tail (DS_MLA_FP8), and the scale rounding.
TEST(LayoutToProtoTest, TheRecordsPartsAddUp) {
  struct Want {
    const char* format;
    int32_t data, sf, tail;
    const char* rounding;
  };
  for (const Want& w : {Want{"DS_MLA_FP8", 512, 16, 128, "pow2_ceil"},
                        Want{"V41", 512, 16, 0, "none"},
                        Want{"FP8_FP32SF_INDEX", 128, 4, 0, "none"}}) {
    SCOPED_TRACE(w.format);
    absl::StatusOr<KVCacheFormat> f = FormatFromName(w.format);
    ASSERT_TRUE(f.ok()) << f.status();
    absl::StatusOr<PoolLayout> l = MakePoolLayout(*f, 64, 4, 2);
    ASSERT_TRUE(l.ok()) << l.status();
    v1::PoolLayout out;
    LayoutToProto(*l, &out);
    EXPECT_EQ(out.format(), w.format);
    EXPECT_EQ(out.data_bytes(), w.data);
    EXPECT_EQ(out.sf_bytes(), w.sf);
    EXPECT_EQ(out.tail_bytes(), w.tail);
    EXPECT_EQ(out.scale_rounding(), w.rounding);
    EXPECT_EQ(out.data_bytes() + out.sf_bytes() + out.tail_bytes(),
              out.bytes_per_token());
  }
}

}  // namespace
}  // namespace kvdepot
