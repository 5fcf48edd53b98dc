// absl::Status -> grpc::Status at the service edge, with the field that a
// bad request got wrong as a google.rpc.BadRequest in the status details
// (grpc-status-details-bin), next to the message that names it in prose.
//
// The field comes from a BadRequest payload on the absl::Status when a
// validator attached one (AttachFieldViolation), else from the message's
// leading field path, which every validation message starts with by
// convention: "slot_mapping[17] = 9000 is outside [-1, 8192)" -> field
// "slot_mapping[17]".
#ifndef KVDEPOT_SERVER_ERROR_DETAILS_H_
#define KVDEPOT_SERVER_ERROR_DETAILS_H_

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvdepot {

// The payload type URL of a serialized google.rpc.BadRequest.
inline constexpr char kBadRequestTypeUrl[] =
    "type.googleapis.com/google.rpc.BadRequest";

// The field path a message starts with ("layer", "block_table[3]",
// "sequences.seqlen_k[0]"), or "" when it starts with none.
std::string LeadingFieldPath(absl::string_view message);

// Adds a violation of `field` (description = the message) to `status`.
void AttachFieldViolation(absl::string_view field, absl::Status* status);

// The field a refused request got wrong, as ToGrpcStatusWithDetails puts
// it into the BadRequest detail (its first violation): for
// INVALID_ARGUMENT and OUT_OF_RANGE only, "" when none is known. A
// StepStream reply carries it (StepResponse.error_field).
std::string ViolatedField(const absl::Status& status);

// The grpc::Status for `status`; INVALID_ARGUMENT and OUT_OF_RANGE carry
// a google.rpc.Status with a BadRequest detail when a field is known.
grpc::Status ToGrpcStatusWithDetails(const absl::Status& status);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_ERROR_DETAILS_H_
