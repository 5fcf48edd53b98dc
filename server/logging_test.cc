#include "server/logging.h"

#include <grpc/grpc.h>
#include <grpc/support/log.h>

#include <algorithm>
#include <string>

#include "gmock/gmock.h"
#include "google/protobuf/wrappers.pb.h"
#include "gtest/gtest.h"
#include "server/log_limiter.h"

namespace kvdepot {
namespace {

using ::testing::HasSubstr;

TEST(EscapeForLogTest, ControlCharactersQuotesAndHighBytesBecomeHex) {
  EXPECT_EQ(EscapeForLog("pool-1"), "pool-1");
  EXPECT_EQ(EscapeForLog("a\nb"), "a\\x0ab");
  EXPECT_EQ(EscapeForLog("\x1b[31mred"), "\\x1b[31mred");
  EXPECT_EQ(EscapeForLog("q\"\\"), "q\\x22\\x5c");
  EXPECT_EQ(EscapeForLog(std::string("z\0z", 3)), "z\\x00z");
  EXPECT_EQ(EscapeForLog("\x7f\xc3\xa9"), "\\x7f\\xc3\\xa9");
}

TEST(EscapeForLogTest, LongValuesAreCutAndSaySo) {
  const std::string s(1000, 'a');
  const std::string e = EscapeForLog(s, 10);
  EXPECT_EQ(e, "aaaaaaaaaa...(1000 bytes)");
  EXPECT_EQ(EscapeForLog(s),
            std::string(kMaxLoggedValueBytes, 'a') + "...(1000 bytes)");
}

TEST(EscapeForLogTest, EveryByteComesOutPrintable) {
  std::string all;
  for (int c = 0; c < 256; ++c) all.push_back(static_cast<char>(c));
  for (char c : EscapeForLog(all, all.size())) {
    EXPECT_GE(c, 0x20);
    EXPECT_LT(c, 0x7f);
    EXPECT_NE(c, '"');
  }
}

TEST(JsonEscapeTest, QuotesBackslashesAndControls) {
  EXPECT_EQ(JsonEscape("a\"b\\c\nd\x01"), "a\\\"b\\\\c\\u000ad\\u0001");
}

TEST(CheckLogFlagsTest, RefusesUnknownValuesNamingTheFlag) {
  EXPECT_TRUE(CheckLogFlags("info", "text").ok());
  EXPECT_TRUE(CheckLogFlags("off", "json").ok());
  absl::Status s = CheckLogFlags("verbose", "text");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("--log_level = \"verbose\""));
  s = CheckLogFlags("info", "xml");
  EXPECT_THAT(s.message(), HasSubstr("--log_format = \"xml\""));
  EXPECT_FALSE(InitLogging("INFO", "text").ok());
}

// libprotobuf's complaint about a client's bytes ("invalid UTF-8") is one
// line per message: only at debug level, escaped, never at the default.
TEST(InitLoggingTest, ProtobufParseComplaintsAreDebugOnly) {
  const std::string bad("\x0a\x02\xff\xfe", 4);  // StringValue "\xff\xfe"
  google::protobuf::StringValue v;
  ASSERT_TRUE(InitLogging("info", "text").ok());
  ::testing::internal::CaptureStderr();
  EXPECT_FALSE(v.ParseFromString(bad));
  std::string out = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(out.find("libprotobuf"), std::string::npos) << out;
  ASSERT_TRUE(InitLogging("debug", "text").ok());
  ::testing::internal::CaptureStderr();
  EXPECT_FALSE(v.ParseFromString(bad));
  out = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(out, HasSubstr(" debug kvdepotd libprotobuf ")) << out;
  EXPECT_THAT(out, HasSubstr("UTF-8")) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
  ASSERT_TRUE(InitLogging("info", "text").ok());
}

int Lines(const std::string& out) {
  return static_cast<int>(std::count(out.begin(), out.end(), '\n'));
}

// gRPC reads GRPC_VERBOSITY in grpc_init; before, gpr_log writes nothing.
class GrpcLogTest : public ::testing::Test {
 protected:
  void SetUp() override { grpc_init(); }
  void TearDown() override {
    SetClientLogRate(kDefaultClientLogLinesPerSecond);
    ASSERT_TRUE(InitLogging("info", "text").ok());
    grpc_shutdown();
  }
};

// gRPC's own lines (a client's failed TLS handshake is one per connection)
// come out as log lines, escaped, and a flood of them is cut to the rate
// limit of their kind, counted and reported as dropped.
TEST_F(GrpcLogTest, LinesAreLogLinesAndRateLimited) {
  ASSERT_TRUE(InitLogging("info", "text").ok());
  SetClientLogRate(4);  // gRPC's lines share the unidentified half: 2
  const int64_t dropped = ClientLogLinesDropped(ClientLog::kGrpc);
  ::testing::internal::CaptureStderr();
  gpr_log(GPR_ERROR, "Handshake failed: %s", "bad\nline");
  for (int i = 0; i < 50; ++i) gpr_log(GPR_ERROR, "flood %d", i);
  ReportDroppedClientLogLines(absl::ZeroDuration());
  const std::string out = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(out, HasSubstr(" error kvdepotd grpc logging_test.cc:")) << out;
  EXPECT_THAT(out, HasSubstr("Handshake failed: bad\\x0aline\n")) << out;
  // One second's share at most, and the drop report.
  EXPECT_LE(Lines(out), 3 + 1) << out;
  EXPECT_THAT(out, HasSubstr(" grpc lines dropped since ")) << out;
  EXPECT_GE(ClientLogLinesDropped(ClientLog::kGrpc) - dropped, 47);
}

// With GRPC_VERBOSITY=debug gRPC sends many debug lines; at --log_level
// info they are not written and take nothing from the limit.
TEST_F(GrpcLogTest, HiddenLinesTakeNothingFromTheLimit) {
  ASSERT_TRUE(InitLogging("info", "text").ok());
  SetClientLogRate(4);
  gpr_set_log_verbosity(GPR_LOG_SEVERITY_DEBUG);
  const int64_t dropped = ClientLogLinesDropped(ClientLog::kGrpc);
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 50; ++i) gpr_log(GPR_DEBUG, "chatter %d", i);
  gpr_log(GPR_ERROR, "the one that matters");
  const std::string out = ::testing::internal::GetCapturedStderr();
  gpr_set_log_verbosity(GPR_LOG_SEVERITY_ERROR);
  EXPECT_EQ(out.find("chatter"), std::string::npos) << out;
  EXPECT_THAT(out, HasSubstr("the one that matters")) << out;
  EXPECT_EQ(ClientLogLinesDropped(ClientLog::kGrpc), dropped);
}

// gRPC aborts right after "assertion failed" or "UNREACHABLE CODE": those
// lines are never dropped.
TEST_F(GrpcLogTest, AssertionLinesAreNeverDropped) {
  ASSERT_TRUE(InitLogging("info", "text").ok());
  SetClientLogRate(2);
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 20; ++i) gpr_log(GPR_ERROR, "flood %d", i);
  gpr_log(GPR_ERROR, "assertion failed: %s", "x != nullptr");
  gpr_log(GPR_ERROR, "UNREACHABLE CODE: %s", "bad state");
  const std::string out = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(out, HasSubstr("grpc logging_test.cc:")) << out;
  EXPECT_THAT(out, HasSubstr("assertion failed: x != nullptr")) << out;
  EXPECT_THAT(out, HasSubstr("UNREACHABLE CODE: bad state")) << out;
  EXPECT_EQ(out.find("flood 19"), std::string::npos) << out;
}

TEST_F(GrpcLogTest, LinesFollowTheLogFormat) {
  ASSERT_TRUE(InitLogging("info", "json").ok());
  ::testing::internal::CaptureStderr();
  gpr_log(GPR_ERROR, "peer said \"%s\"", "hi");
  const std::string out = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(out, HasSubstr("\"level\":\"error\"")) << out;
  EXPECT_THAT(out, HasSubstr("\"msg\":\"grpc logging_test.cc:")) << out;
  EXPECT_THAT(out, HasSubstr("peer said \\\\x22hi\\\\x22\"}")) << out;
  EXPECT_EQ(Lines(out), 1) << out;
}

}  // namespace
}  // namespace kvdepot
