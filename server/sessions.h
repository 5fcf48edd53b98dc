// Client sessions and the buffers they own. A session holds a lease; any
// request naming it (and KeepAlive) renews the lease, and Reap() releases
// every session whose lease has expired together with its buffers, so a
// client that vanishes leaves nothing behind.
//
// Buffers are addressed daemon-wide by id (a scheduler may name a worker's
// buffer); a request holds a shared_ptr while it uses one, so a release
// during the request frees the memory only when the request is done.
#ifndef KVDEPOT_SERVER_SESSIONS_H_
#define KVDEPOT_SERVER_SESSIONS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backend/backend.h"

namespace kvdepot {

struct Buffer {
  uint64_t id = 0;                 // daemon-wide, > 0
  std::string session_id;          // owner
  std::unique_ptr<Memory> memory;  // released with the last reference
};

struct SessionLimits {
  absl::Duration default_lease = absl::Seconds(10);
  absl::Duration max_lease = absl::Minutes(10);
  int64_t max_sessions = 4096;
  int64_t max_buffers_per_session = 1024;
  int64_t max_buffer_bytes = int64_t{64} << 30;
};

struct SessionStats {
  int64_t sessions = 0;
  int64_t buffers = 0;
  int64_t buffer_bytes = 0;
};

class SessionManager {
 public:
  explicit SessionManager(const SessionLimits& limits) : limits_(limits) {}

  // Opens a session with `lease` (0 = default; clamped to max_lease).
  // Returns its id; *granted receives the lease.
  absl::StatusOr<std::string> Open(absl::string_view client_name,
                                   absl::Duration lease, absl::Time now,
                                   absl::Duration* granted);

  // Renews the lease; NOT_FOUND for an unknown or expired session.
  absl::StatusOr<absl::Duration> Touch(absl::string_view session_id,
                                       absl::Time now);

  // Closes a session and releases its buffers; returns how many.
  absl::StatusOr<int64_t> Close(absl::string_view session_id);

  // Adds `memory` as a new buffer of the session (renewing it).
  absl::StatusOr<std::shared_ptr<Buffer>> AddBuffer(
      absl::string_view session_id, std::unique_ptr<Memory> memory,
      absl::Time now);

  // The buffer `buffer_id`; `field` names it in the NOT_FOUND error.
  absl::StatusOr<std::shared_ptr<Buffer>> GetBuffer(absl::string_view field,
                                                    uint64_t buffer_id) const;

  // Releases a buffer of the session.
  absl::Status ReleaseBuffer(absl::string_view session_id, uint64_t buffer_id,
                             absl::Time now);

  // Releases every session whose lease ended before `now`; returns how many.
  int64_t Reap(absl::Time now);

  // Releases everything (daemon shutdown).
  void Clear();

  SessionStats Stats() const;
  const SessionLimits& limits() const { return limits_; }

 private:
  struct Session {
    std::string client_name;
    absl::Duration lease;
    absl::Time expires;
    absl::flat_hash_set<uint64_t> buffers;
  };

  // Removes the session's buffers from buffers_; returns them.
  void DropSessionLocked(Session& session,
                         std::vector<std::shared_ptr<Buffer>>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Session*> FindLocked(absl::string_view session_id,
                                      absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SessionLimits limits_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::shared_ptr<Buffer>> buffers_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_buffer_id_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t buffer_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_SESSIONS_H_
