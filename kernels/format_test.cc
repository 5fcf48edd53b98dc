#include "kernels/format.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/format_host.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;

TEST(FormatTest, NamedFormatsHaveSpecSizes) {
  struct Expect {
    const char* name;
    int32_t bytes;
    int32_t scales;
  };
  for (const Expect& e :
       {Expect{"V41", 528, 16}, Expect{"V41_FP4", 288, 32},
        Expect{"FP4_INDEX", 68, 4}, Expect{"FP8_FP32SF_INDEX", 132, 1},
        Expect{"MXFP8_INDEX", 132, 4}, Expect{"BF16(512)", 1024, 0}}) {
    absl::StatusOr<KVCacheFormat> f = FormatFromName(e.name);
    ASSERT_TRUE(f.ok()) << e.name << ": " << f.status();
    EXPECT_EQ(f->bytes_per_token(), e.bytes) << e.name;
    EXPECT_EQ(f->num_scales(), e.scales) << e.name;
    EXPECT_EQ(*FormatName(*f), e.name);
    EXPECT_TRUE(ValidateFormat(*f).ok());
  }
}

}  // namespace
}  // namespace kvcache
