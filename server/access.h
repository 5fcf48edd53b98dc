// Who is calling and what they may touch (SPEC §11).
//
// A Caller is resolved from the session a request carries: a peer session
// (created on the companion socket, with the peer's SO_PEERCRED uid/gid),
// a TCP session stream (TcpSessions.Open; identified by the mutual-TLS
// client certificate's subject, or anonymous on plain loopback TCP), an
// anonymous lease session (OpenSession) or none. Objects carry an
// owner and an Acl; the admin identity (the daemon's uid, root, and the
// configured admin uids/gids) may delete any pool and Drain.
//
// Only the peer's primary gid is known (SO_PEERCRED); supplementary groups
// are not consulted.
#ifndef KVDEPOT_SERVER_ACCESS_H_
#define KVDEPOT_SERVER_ACCESS_H_

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/log_limiter.h"

namespace kvdepot {

struct Caller {
  uint64_t session = 0;  // public session number; 0 = no session
  bool peer = false;     // credentials known (companion socket)
  uid_t uid = 0;         // valid when peer
  gid_t gid = 0;         // valid when peer
  // The mutual-TLS client certificate's subject of a TCP session stream;
  // "" for peers and anonymous sessions.
  std::string tls_subject;
  bool admin = false;

  bool authenticated() const { return session != 0; }
  bool anonymous() const { return !peer && tls_subject.empty(); }
  // Whose share of the client log lines its lines take (log_limiter.h):
  // its uid, its TLS subject, or the unidentified share (anonymous
  // sessions, no session).
  LogClient log_client() const {
    if (peer) return LogClient::Uid(uid);
    if (!tls_subject.empty()) return LogClient::TlsSubject(tls_subject);
    return LogClient::Unidentified();
  }
};

// Longest TLS subject accepted (a session's identity, a grant), and the
// most subjects one Grant may add.
inline constexpr size_t kMaxTlsSubjectBytes = 1024;
inline constexpr int kMaxTlsSubjectsPerGrant = 64;

// The most uids, gids and sessions (each) one object's access list may
// hold through grants, and so one grant may name; TLS subjects: at most
// kMaxTlsSubjectsPerGrant in all. Unbounded, the owner of one pool could
// grow the daemon without end (every uid of 2^32 is a new entry: 20 M of
// them took 300 MB), and its list would be no access control anyone could
// read. A group (gids) names many users in one entry.
inline constexpr int kMaxAclEntries = 256;

// INVALID_ARGUMENT naming `field` unless `subject` has 1 to
// kMaxTlsSubjectBytes bytes.
absl::Status CheckTlsSubject(absl::string_view field,
                             absl::string_view subject);

// Who owns an object: a uid (peers; the daemon's uid for config pools) or,
// for objects a TLS session created, its certificate subject.
struct Owner {
  uid_t uid = 0;
  std::string tls_subject;  // non-empty: owned by this subject, not a uid

  bool Is(const Caller& c) const;
  // "uid 1000" or "tls subject \"CN=a\"" (escaped, at most 64 bytes).
  std::string Describe() const;
};

// How a caller is named in messages: "uid 1000", "tls subject \"CN=a\""
// (escaped, at most 64 bytes) or "anonymous".
std::string DescribeCaller(const Caller& c);

// Whom a caller's memory and its per-client limits count against: its uid
// for a peer session ("uid 1000"), its certificate subject for a TLS
// session ("tls CN=a,O=b"), else its session ("session 7").
std::string BudgetClientOf(const Caller& c);

// An access list: who besides the owner may use an object.
struct Acl {
  absl::flat_hash_set<uid_t> uids;
  absl::flat_hash_set<gid_t> gids;
  absl::flat_hash_set<uint64_t> sessions;
  absl::flat_hash_set<std::string> tls_subjects;  // TLS session identities
  // Every session that is not a peer's (anonymous and TLS; config only).
  bool anonymous = false;

  bool Allows(const Caller& c) const;
  void Merge(const Acl& other);
};

// OK when `acl` merged with `grant` stays within kMaxAclEntries of each id
// kind and kMaxTlsSubjectsPerGrant subjects; else RESOURCE_EXHAUSTED
// (Limit::kAclEntries) naming `object` ("pool \"p\"") and the kind.
absl::Status CheckGrantFits(const Acl& acl, const Acl& grant,
                            absl::string_view object);

// Who is admin: the daemon's own uid, root, and the configured ids.
struct AdminPolicy {
  uid_t daemon_uid = 0;
  absl::flat_hash_set<uid_t> uids;
  absl::flat_hash_set<gid_t> gids;
  absl::flat_hash_set<std::string> tls_subjects;  // config admin_tls_subjects

  bool IsAdmin(uid_t uid, gid_t gid) const;
  bool IsAdminSubject(absl::string_view tls_subject) const;
};

// UNAUTHENTICATED unless the caller has a session (the message never
// contains an id).
absl::Status RequireSession(const Caller& c);
// PERMISSION_DENIED unless the caller is admin; `what` names the call.
absl::Status RequireAdmin(const Caller& c, absl::string_view what);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_ACCESS_H_
