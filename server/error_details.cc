#include "server/error_details.h"

#include <cctype>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace kvdepot {
namespace {

bool IsIdentStart(char c) {
  return std::isalpha(static_cast<unsigned char>(c)) || c == '_';
}
bool IsIdentChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
}

}  // namespace

std::string LeadingFieldPath(absl::string_view message) {
  // path := ident ('[' digits ']')* ('.' ident ('[' digits ']')*)*
  size_t i = 0;
  const size_t n = message.size();
  while (true) {
    if (i >= n || !IsIdentStart(message[i])) return "";
    while (i < n && IsIdentChar(message[i])) ++i;
    while (i < n && message[i] == '[') {
      size_t j = i + 1;
      while (j < n && std::isdigit(static_cast<unsigned char>(message[j]))) ++j;
      if (j == i + 1 || j >= n || message[j] != ']') return "";
      i = j + 1;
    }
    if (i < n && message[i] == '.') {
      ++i;
      continue;
    }
    break;
  }
  // Then what a validation message says next about that field.
  const absl::string_view rest = message.substr(i);
  for (absl::string_view next :
       {" = ", ": ", " must ", " repeats ", " overlaps "}) {
    if (absl::StartsWith(rest, next)) return std::string(message.substr(0, i));
  }
  return "";
}

void AttachFieldViolation(absl::string_view field, absl::Status* status) {
  google::rpc::BadRequest bad;
  if (auto p = status->GetPayload(kBadRequestTypeUrl)) {
    bad.ParseFromString(std::string(*p));
  }
  google::rpc::BadRequest::FieldViolation* v = bad.add_field_violations();
  v->set_field(std::string(field));
  v->set_description(std::string(status->message()));
  status->SetPayload(kBadRequestTypeUrl, absl::Cord(bad.SerializeAsString()));
}

std::string ViolatedField(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kInvalidArgument &&
      status.code() != absl::StatusCode::kOutOfRange) {
    return "";
  }
  if (auto p = status.GetPayload(kBadRequestTypeUrl)) {
    google::rpc::BadRequest bad;
    if (bad.ParseFromString(std::string(*p)) &&
        bad.field_violations_size() > 0) {
      return bad.field_violations(0).field();
    }
  }
  return LeadingFieldPath(status.message());
}

grpc::Status ToGrpcStatusWithDetails(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const auto code = static_cast<grpc::StatusCode>(status.code());
  const std::string message(status.message());
  if (status.code() != absl::StatusCode::kInvalidArgument &&
      status.code() != absl::StatusCode::kOutOfRange) {
    return grpc::Status(code, message);
  }
  google::rpc::BadRequest bad;
  if (auto p = status.GetPayload(kBadRequestTypeUrl)) {
    bad.ParseFromString(std::string(*p));
  } else if (std::string field = LeadingFieldPath(message); !field.empty()) {
    google::rpc::BadRequest::FieldViolation* v = bad.add_field_violations();
    v->set_field(field);
    v->set_description(message);
  }
  if (bad.field_violations_size() == 0) return grpc::Status(code, message);
  google::rpc::Status details;
  details.set_code(static_cast<int>(code));
  details.set_message(message);
  details.add_details()->PackFrom(bad);
  return grpc::Status(code, message, details.SerializeAsString());
}

}  // namespace kvdepot
