#include "server/command_line.h"

#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

ABSL_FLAG(std::string, cl_test_name, "x", "A string flag for the test.");
ABSL_FLAG(int64_t, cl_test_count, 3, "An integer flag for the test.");
ABSL_FLAG(bool, cl_test_on, false, "A bool flag for the test.");

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

absl::Status Check(std::vector<std::string> args) {
  args.insert(args.begin(), "kvdepotd");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return CheckFlagSyntax(static_cast<int>(argv.size()), argv.data());
}

TEST(CheckFlagSyntaxTest, AcceptsEveryFormAbslAccepts) {
  EXPECT_TRUE(Check({}).ok());
  EXPECT_TRUE(Check({"--cl_test_name=a", "--cl_test_count", "7", "--cl_test_on",
                     "--nocl_test_on", "-cl_test_count=2", "--cl_test_on=false",
                     "--helpfull"})
                  .ok());
}

TEST(CheckFlagSyntaxTest, RefusesUnknownFlagsBadValuesAndArguments) {
  EXPECT_THAT(Check({"--bogus=1"}).message(),
              HasSubstr("unknown flag \"--bogus=1\""));
  EXPECT_THAT(Check({"--cl_test_count=many"}).message(),
              HasSubstr("--cl_test_count = \"many\" is not a valid int"));
  EXPECT_THAT(Check({"--cl_test_count"}).message(),
              HasSubstr("--cl_test_count needs a value"));
  EXPECT_THAT(Check({"serve"}).message(),
              HasSubstr("unexpected argument \"serve\""));
  EXPECT_THAT(Check({"--nocl_test_name"}).message(), HasSubstr("unknown flag"));
  EXPECT_EQ(Check({"--x\n"}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Check({"--x\n"}).message(), HasSubstr("--x\\x0a"));
}

TEST(CheckAddressFlagTest, PortsOutsideTheRangeAreRefused) {
  EXPECT_TRUE(CheckAddressFlag("listen", "", true).ok());
  EXPECT_TRUE(CheckAddressFlag("listen", "/tmp/a.sock", true).ok());
  EXPECT_TRUE(CheckAddressFlag("listen", "unix:/tmp/a.sock", true).ok());
  EXPECT_TRUE(CheckAddressFlag("listen", "127.0.0.1:65535", true).ok());
  EXPECT_TRUE(CheckAddressFlag("listen", "[::1]:1", true).ok());
  EXPECT_TRUE(CheckAddressFlag("metrics_address", "0.0.0.0:0", false).ok());
  for (const char* bad : {"127.0.0.1:99999", "127.0.0.1:-1",
                          "host:", "host:80x", "host", ":80"}) {
    const absl::Status s = CheckAddressFlag("listen", bad, true);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(s.message(), HasSubstr("--listen = \"")) << bad;
  }
  EXPECT_THAT(CheckAddressFlag("listen", "127.0.0.1:99999", true).message(),
              HasSubstr("port \"99999\" is outside [1, 65535]"));
  EXPECT_FALSE(CheckAddressFlag("metrics_address", "/tmp/m.sock", false).ok());
}

TEST(HandleHelpAndVersionTest, HelpListsTheFlagsOfTheFile) {
  std::ostringstream out;
  std::string a0 = "kvdepotd", a1 = "-h";
  char* argv[] = {a0.data(), a1.data()};
  EXPECT_EQ(HandleHelpAndVersion(2, argv, "about", "command_line_test.cc", out),
            0);
  EXPECT_THAT(out.str(), HasSubstr("about\n\nUsage: "));
  for (const char* f : {"--cl_test_name (string, default \"x\")",
                        "--cl_test_count (int, default \"3\")",
                        "--cl_test_on (bool, default \"false\")"}) {
    EXPECT_THAT(out.str(), HasSubstr(f));
  }
  std::ostringstream version;
  std::string v = "--version";
  char* argv2[] = {a0.data(), v.data()};
  EXPECT_EQ(HandleHelpAndVersion(2, argv2, "", "", version), 0);
  EXPECT_THAT(version.str(), HasSubstr("kvdepotd 0."));
  char* argv3[] = {a0.data()};
  EXPECT_EQ(HandleHelpAndVersion(1, argv3, "", "", version), -1);
}

}  // namespace
}  // namespace kvdepot
