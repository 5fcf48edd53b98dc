#include "common/status_macros.h"

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

int calls = 0;

absl::Status Fails() {
  ++calls;
  return absl::InvalidArgumentError("x[3] = 9 is outside [0, 4)");
}
absl::Status Succeeds() {
  ++calls;
  return absl::OkStatus();
}
absl::StatusOr<std::unique_ptr<int>> Make(bool ok) {
  ++calls;
  if (!ok) return absl::ResourceExhaustedError("no room");
  return std::make_unique<int>(7);
}

absl::Status Chain(bool first_ok, bool second_ok, int* out) {
  RETURN_IF_ERROR(first_ok ? Succeeds() : Fails());
  ASSIGN_OR_RETURN(std::unique_ptr<int> v, Make(second_ok));  // move-only
  ASSIGN_OR_RETURN(*out, absl::StatusOr<int>(*v + 1));        // lvalue
  return absl::OkStatus();
}

absl::StatusOr<std::string> InStatusOrFunction(bool ok) {
  RETURN_IF_ERROR(ok ? Succeeds() : Fails());
  return std::string("done");
}

TEST(StatusMacrosTest, PropagatesTheFirstErrorAndEvaluatesOnce) {
  int out = 0;
  calls = 0;
  absl::Status s = Chain(false, true, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "x[3] = 9 is outside [0, 4)");
  EXPECT_EQ(calls, 1);  // stopped before Make
  calls = 0;
  s = Chain(true, false, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(out, 0);
  calls = 0;
  ASSERT_TRUE(Chain(true, true, &out).ok());
  EXPECT_EQ(out, 8);
  EXPECT_EQ(calls, 2);
}

TEST(StatusMacrosTest, WorksInFunctionsReturningStatusOr) {
  EXPECT_EQ(*InStatusOrFunction(true), "done");
  EXPECT_EQ(InStatusOrFunction(false).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvdepot
