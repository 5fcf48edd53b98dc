#include "server/limits.h"

#include "absl/strings/cord.h"

namespace kvdepot {
namespace {

constexpr char kLimitPayloadUrl[] = "kvdepot.dev/limit";

constexpr absl::string_view kNames[] = {
    "sessions",
    "sessions_per_client",
    "buffers_per_session",
    "descriptors_per_connection",
    "companion_connections",
    "companion_connections_per_uid",
    "verify_streams_per_client",
    "pools",
    "memory_budget",
    "memory_per_client",
    "descriptors",
    "connections",
    "connections_per_uid",
    "reply_bytes",
    "reply_bytes_per_client",
    "acl_entries",
};
static_assert(sizeof(kNames) / sizeof(kNames[0]) ==
              static_cast<size_t>(Limit::kCount));

}  // namespace

absl::string_view LimitName(Limit limit) {
  const int i = static_cast<int>(limit);
  if (i < 0 || i >= static_cast<int>(Limit::kCount)) return "unknown";
  return kNames[i];
}

absl::Status LimitExceeded(Limit limit, absl::string_view message) {
  absl::Status s = absl::ResourceExhaustedError(message);
  s.SetPayload(kLimitPayloadUrl, absl::Cord(LimitName(limit)));
  return s;
}

std::optional<Limit> LimitOf(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kResourceExhausted) {
    return std::nullopt;
  }
  auto payload = status.GetPayload(kLimitPayloadUrl);
  if (!payload.has_value()) return std::nullopt;
  for (int i = 0; i < static_cast<int>(Limit::kCount); ++i) {
    if (*payload == kNames[i]) return static_cast<Limit>(i);
  }
  return std::nullopt;
}

}  // namespace kvdepot
