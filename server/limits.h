// Which limit refused a request (docs/DAEMON.md "Limits"). A refusal by a
// limit is RESOURCE_EXHAUSTED with a payload naming the limit, so the
// place that counts calls (the service, the companion socket) can count
// rejections by limit (kvdepot_rejections_total{reason="limit_<name>"})
// without each limit knowing about metrics. The payload never reaches a
// client: only the code and the message are sent.
#ifndef KVDEPOT_SERVER_LIMITS_H_
#define KVDEPOT_SERVER_LIMITS_H_

#include <optional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvdepot {

enum class Limit : int {
  kSessions,                    // all sessions together
  kSessionsPerClient,           // sessions of one uid / TLS subject
  kBuffersPerSession,           // buffers one session holds
  kDescriptorsPerConnection,    // descriptors held for one companion connection
  kCompanionConnections,        // companion connections together
  kCompanionConnectionsPerUid,  // companion connections of one uid
  kVerifyStreamsPerClient,      // concurrent Verify streams of one client
  kPools,                       // pools together
  kMemoryBudget,                // bytes of the memory budget
  kMemoryPerClient,             // bytes one client may hold of it
  kDescriptors,                 // descriptors held for pools and buffers
  kConnections,                 // gRPC connections past the descriptor headroom
  kConnectionsPerUid,           // gRPC connections of one uid (Unix socket)
  kReplyBytes,                  // inline reply bytes not yet sent, together
  kReplyBytesPerClient,         // inline reply bytes not yet sent, one client
  kAclEntries,  // entries of one kind in an object's access list
  kCount,
};

// "sessions", "sessions_per_client", ... (the metric's reason without the
// "limit_" prefix).
absl::string_view LimitName(Limit limit);

// RESOURCE_EXHAUSTED with `message`, tagged with `limit`.
absl::Status LimitExceeded(Limit limit, absl::string_view message);

// The limit a status was tagged with, if any.
std::optional<Limit> LimitOf(const absl::Status& status);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_LIMITS_H_
