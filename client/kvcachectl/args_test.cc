#include "client/kvcachectl/args.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvdepot::ctl {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

const CommandSpec kSpec{"t [flags]",
                        "test",
                        {{"block_size", "slots", "64"},
                         {"output", "fmt", "table"},
                         {"all", "everything", "", true}}};

TEST(ArgsTest, ParsesFormsOfFlagsAndPositionals) {
  absl::StatusOr<ParsedArgs> a =
      ParseArgs(kSpec, {"V41", "--block_size=7", "-o", "json", "--all", "x",
                        "--", "--not-a-flag"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(a->positional(), ElementsAre("V41", "x", "--not-a-flag"));
  EXPECT_EQ(*a->GetInt("block_size", 1, 100), 7);
  EXPECT_EQ(a->Get("output"), "json");
  EXPECT_EQ(a->Get("all"), "true");
  EXPECT_FALSE(a->help());
}

TEST(ArgsTest, DefaultsApplyWhenAbsent) {
  absl::StatusOr<ParsedArgs> a = ParseArgs(kSpec, {"--block_size", "9"});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->Get("output"), "table");
  EXPECT_EQ(*a->GetInt("block_size", 1, 100), 9);
  EXPECT_FALSE(a->Has("output"));
}

TEST(ArgsTest, RejectsUnknownFlagsMissingValuesAndBadIntegers) {
  absl::StatusOr<ParsedArgs> a = ParseArgs(kSpec, {"--blocksize=3"});
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(a.status().message(), HasSubstr("--blocksize"));

  a = ParseArgs(kSpec, {"--block_size"});
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(a.status().message(), HasSubstr("needs a value"));

  a = ParseArgs(kSpec, {"--all=maybe"});
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(a.status().message(), HasSubstr("true or false"));

  a = ParseArgs(kSpec, {"--block_size=abc"});
  ASSERT_TRUE(a.ok());
  EXPECT_THAT(a->GetInt("block_size", 1, 100).status().message(),
              HasSubstr("not an integer"));
  a = ParseArgs(kSpec, {"--block_size=0"});
  ASSERT_TRUE(a.ok());
  EXPECT_THAT(a->GetInt("block_size", 1, 100).status().message(),
              HasSubstr("--block_size = 0 is outside [1, 100]"));
}

TEST(ArgsTest, HelpIsRecognizedAndListsFlags) {
  absl::StatusOr<ParsedArgs> a = ParseArgs(kSpec, {"-h"});
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(a->help());
  const std::string help = HelpText(kSpec);
  EXPECT_THAT(help, HasSubstr("--block_size VALUE"));
  EXPECT_THAT(help, HasSubstr("-o, --output"));
  EXPECT_THAT(help, HasSubstr("(default 64)"));
}

TEST(ArgsTest, GlobalFlagsBeforeTheCommandMoveBehindIt) {
  EXPECT_THAT(
      HoistGlobalFlags(
          {"--addr", "/tmp/kv.sock", "-o", "json", "pool", "list"}),
      ElementsAre("pool", "list", "--addr", "/tmp/kv.sock", "-o", "json"));
  EXPECT_THAT(HoistGlobalFlags({"--timeout=2s", "status", "--addr", "x"}),
              ElementsAre("status", "--addr", "x", "--timeout=2s"));
  // Nothing to move; an unknown leading flag stays for the usage error.
  EXPECT_THAT(HoistGlobalFlags({"status", "-o", "json"}),
              ElementsAre("status", "-o", "json"));
  EXPECT_THAT(HoistGlobalFlags({"--bogus", "status"}),
              ElementsAre("--bogus", "status"));
  EXPECT_THAT(HoistGlobalFlags({"--addr"}), ElementsAre("--addr"));
}

}  // namespace
}  // namespace kvdepot::ctl
