// Messages with descriptors over a Unix socket (SCM_RIGHTS), as the
// companion socket carries them (SPEC §11). Meant for SOCK_SEQPACKET, where
// every message keeps its boundaries.
//
// Receiving is defensive: the control buffer holds at most `max_fds`
// descriptors; descriptors arrive close-on-exec (MSG_CMSG_CLOEXEC) and go
// straight into UniqueFds, so every one of them is closed on any error —
// a message cut short (MSG_TRUNC) or carrying more descriptors than allowed
// (MSG_CTRUNC) is refused with nothing left open.
#ifndef KVDEPOT_COMMON_FD_PASSING_H_
#define KVDEPOT_COMMON_FD_PASSING_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/unique_fd.h"

namespace kvdepot {

// Upper bound on `max_fds` (the control buffer is sized for it).
inline constexpr int kMaxFdsPerMessage = 16;

struct ReceivedMessage {
  std::string bytes;
  std::vector<UniqueFd> fds;  // in the order the peer sent them
};

// Sends `bytes` (non-empty) with `fds` attached (at most
// kMaxFdsPerMessage). UNAVAILABLE when the peer is gone.
absl::Status SendMessage(int sock, absl::string_view bytes,
                         absl::Span<const int> fds);

// Receives one message of at most `max_bytes` with at most `max_fds`
// descriptors. OUT_OF_RANGE when the peer closed the connection (an empty
// message counts as closing), INVALID_ARGUMENT for a message too long or
// with too many descriptors, UNAVAILABLE for a socket error.
absl::StatusOr<ReceivedMessage> ReceiveMessage(int sock, size_t max_bytes,
                                               int max_fds);

}  // namespace kvdepot

#endif  // KVDEPOT_COMMON_FD_PASSING_H_
