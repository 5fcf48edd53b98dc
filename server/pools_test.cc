// Pool names: 1..64 bytes of [A-Za-z0-9._-]; a refusal quotes at most 64
// escaped bytes of the name, never the whole of it nor a raw control byte.
#include "server/pools.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

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

}  // namespace
}  // namespace kvdepot
