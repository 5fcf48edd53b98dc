#include "server/error_details.h"

#include "gmock/gmock.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "gtest/gtest.h"

namespace kvdepot {
namespace {

TEST(LeadingFieldPathTest, FindsThePathValidationMessagesStartWith) {
  EXPECT_EQ(LeadingFieldPath("layer = 9 is outside [0, 4)"), "layer");
  EXPECT_EQ(LeadingFieldPath("slot_mapping[17] = 9000 is outside [-1, 8192)"),
            "slot_mapping[17]");
  EXPECT_EQ(LeadingFieldPath("sequences.seqlen_k[3] = -1 is negative"),
            "sequences.seqlen_k[3]");
  EXPECT_EQ(LeadingFieldPath("layers[1] = 1 repeats layers[0]"), "layers[1]");
  EXPECT_EQ(LeadingFieldPath("name: character 3 is not allowed"), "name");
  EXPECT_EQ(LeadingFieldPath("kvdepot is draining"), "");
  EXPECT_EQ(LeadingFieldPath("the deadline passed"), "");
  EXPECT_EQ(LeadingFieldPath("a[x] = 1"), "");
  EXPECT_EQ(LeadingFieldPath(""), "");
}

google::rpc::BadRequest Details(const grpc::Status& s) {
  google::rpc::Status st;
  EXPECT_TRUE(st.ParseFromString(s.error_details()));
  EXPECT_EQ(st.code(), s.error_code());
  EXPECT_EQ(st.message(), s.error_message());
  google::rpc::BadRequest bad;
  EXPECT_EQ(st.details_size(), 1);
  EXPECT_EQ(st.details(0).type_url(), kBadRequestTypeUrl);
  EXPECT_TRUE(st.details(0).UnpackTo(&bad));
  return bad;
}

TEST(ToGrpcStatusWithDetailsTest, InvalidArgumentCarriesTheField) {
  const grpc::Status s = ToGrpcStatusWithDetails(
      absl::InvalidArgumentError("block_table[3] = 99 is outside [0, 8)"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "block_table[3] = 99 is outside [0, 8)");
  const google::rpc::BadRequest bad = Details(s);
  ASSERT_EQ(bad.field_violations_size(), 1);
  EXPECT_EQ(bad.field_violations(0).field(), "block_table[3]");
  EXPECT_EQ(bad.field_violations(0).description(), s.error_message());
}

TEST(ToGrpcStatusWithDetailsTest, AnAttachedViolationWins) {
  absl::Status st = absl::InvalidArgumentError("the token count differs");
  AttachFieldViolation("slot_mapping", &st);
  const google::rpc::BadRequest bad = Details(ToGrpcStatusWithDetails(st));
  ASSERT_EQ(bad.field_violations_size(), 1);
  EXPECT_EQ(bad.field_violations(0).field(), "slot_mapping");
}

TEST(ToGrpcStatusWithDetailsTest, OtherCodesAndUnknownFieldsHaveNoDetails) {
  EXPECT_TRUE(ToGrpcStatusWithDetails(absl::OkStatus()).ok());
  EXPECT_EQ(ToGrpcStatusWithDetails(absl::NotFoundError("pool = \"a\""))
                .error_details(),
            "");
  EXPECT_EQ(ToGrpcStatusWithDetails(absl::InvalidArgumentError("bad request"))
                .error_details(),
            "");
}

TEST(ViolatedFieldTest, IsTheFieldTheDetailWouldCarry) {
  EXPECT_EQ(ViolatedField(absl::InvalidArgumentError(
                "slot_mapping[2] = 9 duplicates slot_mapping[0]")),
            "slot_mapping[2]");
  EXPECT_EQ(ViolatedField(absl::OutOfRangeError("step_id: 5 is not next")),
            "step_id");
  absl::Status attached = absl::InvalidArgumentError("both are wrong");
  AttachFieldViolation("seq_lens[1]", &attached);
  EXPECT_EQ(ViolatedField(attached), "seq_lens[1]");
  // Only for the codes that carry a BadRequest.
  EXPECT_EQ(ViolatedField(absl::NotFoundError("registration_id: no such")), "");
  EXPECT_EQ(ViolatedField(absl::InvalidArgumentError("no field here")), "");
  EXPECT_EQ(ViolatedField(absl::OkStatus()), "");
}

}  // namespace
}  // namespace kvdepot
