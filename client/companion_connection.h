// The client side of the companion socket (SPEC §11): checks that the
// socket's directory is private and that the daemon runs as the expected
// uid before anything else, opens the session (Hello) and carries the
// requests that hand memory over as descriptors.
#ifndef KVDEPOT_CLIENT_COMPANION_CONNECTION_H_
#define KVDEPOT_CLIENT_COMPANION_CONNECTION_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/unique_fd.h"
#include "kvdepot/v1/kvdepot.pb.h"

namespace kvdepot {

// OK unless the directory of `socket_path` can be written by others (a
// world-writable directory lets anyone put their own socket there).
absl::Status CheckSocketDirectory(const std::string& socket_path);

// The daemon uid a client accepts: `flag` when >= 0, else
// $KVDEPOT_DAEMON_UID when set, else -1 (= the client's own uid or root).
int64_t ExpectedDaemonUid(int64_t flag);

class CompanionConnection {
 public:
  // Connects to `path` (SOCK_SEQPACKET), checks the directory and the
  // daemon's uid (SO_PEERCRED) against `expected_uid` (-1 = own or root),
  // then sends Hello.
  static absl::StatusOr<std::unique_ptr<CompanionConnection>> Open(
      const std::string& path, int64_t expected_uid,
      const std::string& client_name);

  CompanionConnection(const CompanionConnection&) = delete;
  CompanionConnection& operator=(const CompanionConnection&) = delete;

  const v1::HelloReply& hello() const { return hello_; }
  const std::string& session_id() const { return hello_.session_id(); }

  // One request and its reply; `fd` (>= 0) is attached, *fd_out receives a
  // returned descriptor (when not null). A non-OK reply code becomes the
  // status.
  absl::StatusOr<v1::CompanionReply> Call(const v1::CompanionRequest& request,
                                          int fd, UniqueFd* fd_out);

 private:
  explicit CompanionConnection(UniqueFd fd) : fd_(std::move(fd)) {}

  absl::Mutex mu_;  // one request at a time
  UniqueFd fd_ ABSL_GUARDED_BY(mu_);
  v1::HelloReply hello_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_CLIENT_COMPANION_CONNECTION_H_
