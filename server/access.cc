#include "server/access.h"

#include "absl/strings/str_cat.h"

namespace kvdepot {

std::string BudgetClientOf(const Caller& c) {
  return c.peer ? absl::StrCat("uid ", c.uid)
                : absl::StrCat("session ", c.session);
}

bool Acl::Allows(const Caller& c) const {
  if (!c.authenticated()) return false;
  if (sessions.contains(c.session)) return true;
  if (!c.peer) return anonymous;
  return uids.contains(c.uid) || gids.contains(c.gid);
}

void Acl::Merge(const Acl& other) {
  uids.insert(other.uids.begin(), other.uids.end());
  gids.insert(other.gids.begin(), other.gids.end());
  sessions.insert(other.sessions.begin(), other.sessions.end());
  anonymous = anonymous || other.anonymous;
}

bool AdminPolicy::IsAdmin(uid_t uid, gid_t gid) const {
  return uid == 0 || uid == daemon_uid || uids.contains(uid) ||
         gids.contains(gid);
}

absl::Status RequireSession(const Caller& c) {
  if (c.authenticated()) return absl::OkStatus();
  return absl::UnauthenticatedError(
      "this call needs a session: connect to the companion socket (Hello) "
      "and pass its session id (session_id, or metadata kvdepot-session-id)");
}

absl::Status RequireAdmin(const Caller& c, absl::string_view what) {
  if (!c.authenticated()) return RequireSession(c);
  if (c.admin) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat(what,
                   " needs the admin identity (the daemon's uid, root, "
                   "--admin_gid or the config's admin ids); this session's "
                   "uid ",
                   c.peer ? absl::StrCat(c.uid) : "is anonymous",
                   c.peer ? " is not admin" : ""));
}

}  // namespace kvdepot
