// Client sessions and the buffers they own (SPEC §11).
//
// A peer session is opened on the companion socket with the peer's
// credentials and lives until that connection closes (CloseNumber). A
// stream session (TcpSessions.Open, the TCP path) carries the mutual-TLS
// subject of its client ("" = anonymous) and lives until its stream ends
// (CloseNumber). An anonymous lease session (OpenSession) holds a lease
// that requests naming it renew; Reap() releases the expired ones.
//
// A session id is "<number>.<32 hex>": a public number (for grants and
// lookup) and 128 random bits from getrandom, compared in constant time.
// Ids are never logged nor put into any error message.
//
// Buffers are owned by their session: only it may release or grant them;
// other sessions may name one in requests when its Acl allows them. A
// request holds a shared_ptr while it uses one, so a release during the
// request frees the memory only when the request is done.
#ifndef KVDEPOT_SERVER_SESSIONS_H_
#define KVDEPOT_SERVER_SESSIONS_H_

#include <sys/types.h>

#include <array>
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
#include "server/access.h"
#include "server/backend/backend.h"
#include "server/memory_budget.h"

namespace kvdepot {

struct Buffer {
  uint64_t id = 0;             // daemon-wide, > 0
  uint64_t owner_session = 0;  // session number
  // Its bytes in the memory budget; before `memory`, so it is given back
  // after the memory is freed.
  MemoryReservation reservation;
  std::unique_ptr<Memory> memory;  // released with the last reference
  Acl acl;                         // guarded by the SessionManager's lock
};

struct SessionLimits {
  absl::Duration default_lease = absl::Seconds(10);
  absl::Duration max_lease = absl::Minutes(10);
  int64_t max_sessions = 4096;  // all sessions together
  // Sessions of one client: peer sessions of one uid, stream sessions of
  // one TLS subject, and all anonymous sessions together.
  int64_t max_sessions_per_uid = 256;
  int64_t max_client_name_bytes = 256;  // Hello / OpenSession client_name
  int64_t max_buffers_per_session = 1024;
  int64_t max_buffer_bytes = int64_t{64} << 30;
};

struct SessionStats {
  int64_t sessions = 0;
  int64_t buffers = 0;
  int64_t buffer_bytes = 0;
};

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

struct OpenedSession {
  std::string id;       // secret
  uint64_t number = 0;  // public
};

class SessionManager {
 public:
  explicit SessionManager(const SessionLimits& limits) : limits_(limits) {}

  // REQUIRES: called before any session is opened.
  void set_admin_policy(AdminPolicy policy) { admin_ = std::move(policy); }
  const AdminPolicy& admin_policy() const { return admin_; }

  // A session of a companion-socket peer; no lease (CloseNumber ends it).
  absl::StatusOr<OpenedSession> OpenPeer(absl::string_view client_name,
                                         const PeerCredentials& peer);

  // A session that lives as long as a TCP stream (CloseNumber ends it): of
  // `tls_subject`, the client certificate's subject, or anonymous for "".
  // INVALID_ARGUMENT for a subject longer than kMaxTlsSubjectBytes.
  absl::StatusOr<OpenedSession> OpenStream(absl::string_view client_name,
                                           absl::string_view tls_subject);

  // An anonymous session with `lease` (0 = default; clamped to max_lease).
  // Returns its id; *granted receives the lease.
  absl::StatusOr<std::string> Open(absl::string_view client_name,
                                   absl::Duration lease, absl::Time now,
                                   absl::Duration* granted);

  // The caller a request's session id stands for (renewing an anonymous
  // lease). "" = no session (a Caller without one); an id that is malformed,
  // unknown or expired is UNAUTHENTICATED.
  absl::StatusOr<Caller> Authenticate(absl::string_view session_id,
                                      absl::Time now);

  // Renews the lease; UNAUTHENTICATED for an unknown or expired session.
  absl::StatusOr<absl::Duration> Touch(absl::string_view session_id,
                                       absl::Time now);

  // Closes a session and releases its buffers; returns how many.
  absl::StatusOr<int64_t> Close(absl::string_view session_id);
  // The same by number (the companion connection closed).
  int64_t CloseNumber(uint64_t number);

  // Adds `memory` as a new buffer of the caller's session; `reservation`
  // (its bytes in the memory budget) lives and dies with it.
  absl::StatusOr<std::shared_ptr<Buffer>> AddBuffer(
      const Caller& caller, std::unique_ptr<Memory> memory,
      MemoryReservation reservation = MemoryReservation());

  // The buffer `buffer_id` when the caller owns it or is granted it;
  // `field` names it in the error.
  absl::StatusOr<std::shared_ptr<Buffer>> GetBuffer(const Caller& caller,
                                                    absl::string_view field,
                                                    uint64_t buffer_id) const;

  // Releases a buffer of the caller's session.
  absl::Status ReleaseBuffer(const Caller& caller, uint64_t buffer_id);

  // Adds `grant` to the access list of a buffer of the caller's session.
  absl::Status GrantBuffer(const Caller& caller, uint64_t buffer_id,
                           const Acl& grant);

  // Buffers session `number` holds (0 for an unknown session).
  int64_t BufferCount(uint64_t number) const;

  // Releases every anonymous session whose lease ended before `now`.
  int64_t Reap(absl::Time now);

  // Releases everything (daemon shutdown).
  void Clear();

  SessionStats Stats() const;
  const SessionLimits& limits() const { return limits_; }

 private:
  using Secret = std::array<uint8_t, 16>;
  struct Session {
    Secret secret;
    std::string client_name;
    bool peer = false;
    bool stream = false;      // ends with its stream, no lease
    std::string tls_subject;  // stream sessions; "" = anonymous
    PeerCredentials creds;
    absl::Duration lease;
    absl::Time expires = absl::InfiniteFuture();
    absl::flat_hash_set<uint64_t> buffers;
  };

  // INVALID_ARGUMENT for a name longer than max_client_name_bytes (quoting
  // at most 64 bytes of it, escaped).
  absl::Status CheckClientName(absl::string_view name) const;
  absl::StatusOr<OpenedSession> OpenLocked(Session session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the session's buffers from buffers_; returns them.
  void DropSessionLocked(Session& session,
                         std::vector<std::shared_ptr<Buffer>>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The live session of `session_id` (renewing its lease), or
  // UNAUTHENTICATED; *number receives its number.
  absl::StatusOr<Session*> FindLocked(absl::string_view session_id,
                                      absl::Time now, uint64_t* number)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Caller CallerOf(uint64_t number, const Session& s) const;

  const SessionLimits limits_;
  AdminPolicy admin_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Session> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::shared_ptr<Buffer>> buffers_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_session_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_buffer_id_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t buffer_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_SESSIONS_H_
