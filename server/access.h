// Who is calling and what they may touch (SPEC §11).
//
// A Caller is resolved from the session a request carries: a peer session
// (created on the companion socket, with the peer's SO_PEERCRED uid/gid),
// an anonymous session (OpenSession, the TCP path) or none. Objects carry an
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

namespace kvdepot {

struct Caller {
  uint64_t session = 0;  // public session number; 0 = no session
  bool peer = false;     // credentials known (companion socket)
  uid_t uid = 0;         // valid when peer
  gid_t gid = 0;         // valid when peer
  bool admin = false;

  bool authenticated() const { return session != 0; }
};

// Whom a caller's memory counts against in the memory budget: its uid for
// a peer session ("uid 1000"), else its session ("session 7").
std::string BudgetClientOf(const Caller& c);

// An access list: who besides the owner may use an object.
struct Acl {
  absl::flat_hash_set<uid_t> uids;
  absl::flat_hash_set<gid_t> gids;
  absl::flat_hash_set<uint64_t> sessions;
  bool anonymous = false;  // anonymous sessions too (config only)

  bool Allows(const Caller& c) const;
  void Merge(const Acl& other);
};

// Who is admin: the daemon's own uid, root, and the configured ids.
struct AdminPolicy {
  uid_t daemon_uid = 0;
  absl::flat_hash_set<uid_t> uids;
  absl::flat_hash_set<gid_t> gids;

  bool IsAdmin(uid_t uid, gid_t gid) const;
};

// UNAUTHENTICATED unless the caller has a session (the message never
// contains an id).
absl::Status RequireSession(const Caller& c);
// PERMISSION_DENIED unless the caller is admin; `what` names the call.
absl::Status RequireAdmin(const Caller& c, absl::string_view what);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_ACCESS_H_
