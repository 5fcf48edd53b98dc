#include "server/access.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "server/limits.h"

namespace kvdepot {

namespace {

std::string QuoteSubject(absl::string_view subject) {
  return absl::StrCat("tls subject \"", absl::CHexEscape(subject.substr(0, 64)),
                      subject.size() > 64 ? "...\"" : "\"");
}

}  // namespace

std::string BudgetClientOf(const Caller& c) {
  if (c.peer) return absl::StrCat("uid ", c.uid);
  if (!c.tls_subject.empty()) return absl::StrCat("tls ", c.tls_subject);
  return absl::StrCat("session ", c.session);
}

absl::Status CheckTlsSubject(absl::string_view field,
                             absl::string_view subject) {
  if (subject.empty() || subject.size() > kMaxTlsSubjectBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " has ", subject.size(),
                     " bytes; a TLS subject has 1 to ", kMaxTlsSubjectBytes));
  }
  return absl::OkStatus();
}

bool Owner::Is(const Caller& c) const {
  if (!c.authenticated()) return false;
  if (!tls_subject.empty()) return c.tls_subject == tls_subject;
  return c.peer && c.uid == uid;
}

std::string Owner::Describe() const {
  return tls_subject.empty() ? absl::StrCat("uid ", uid)
                             : QuoteSubject(tls_subject);
}

std::string DescribeCaller(const Caller& c) {
  if (c.peer) return absl::StrCat("uid ", c.uid);
  if (!c.tls_subject.empty()) return QuoteSubject(c.tls_subject);
  return "anonymous";
}

bool Acl::Allows(const Caller& c) const {
  if (!c.authenticated()) return false;
  if (sessions.contains(c.session)) return true;
  if (!c.peer) {
    return anonymous ||
           (!c.tls_subject.empty() && tls_subjects.contains(c.tls_subject));
  }
  return uids.contains(c.uid) || gids.contains(c.gid);
}

namespace {

// Entries of `add` not yet in `have`, plus `have`'s.
template <typename Set>
int64_t UnionSize(const Set& have, const Set& add) {
  int64_t n = static_cast<int64_t>(have.size());
  for (const auto& v : add) n += have.contains(v) ? 0 : 1;
  return n;
}

}  // namespace

absl::Status CheckGrantFits(const Acl& acl, const Acl& grant,
                            absl::string_view object) {
  struct Kind {
    const char* name;
    int64_t size;
    int64_t limit;
  };
  const Kind kinds[] = {
      {"uids", UnionSize(acl.uids, grant.uids), kMaxAclEntries},
      {"gids", UnionSize(acl.gids, grant.gids), kMaxAclEntries},
      {"sessions", UnionSize(acl.sessions, grant.sessions), kMaxAclEntries},
      {"tls_subjects", UnionSize(acl.tls_subjects, grant.tls_subjects),
       kMaxTlsSubjectsPerGrant},
  };
  for (const Kind& k : kinds) {
    if (k.size > k.limit) {
      return LimitExceeded(
          Limit::kAclEntries,
          absl::StrCat(object, ": its access list would hold ", k.size, " ",
                       k.name, ", more than ", k.limit,
                       "; nothing was granted (grant a group instead of "
                       "many uids)"));
    }
  }
  return absl::OkStatus();
}

void Acl::Merge(const Acl& other) {
  uids.insert(other.uids.begin(), other.uids.end());
  gids.insert(other.gids.begin(), other.gids.end());
  sessions.insert(other.sessions.begin(), other.sessions.end());
  tls_subjects.insert(other.tls_subjects.begin(), other.tls_subjects.end());
  anonymous = anonymous || other.anonymous;
}

bool AdminPolicy::IsAdmin(uid_t uid, gid_t gid) const {
  return uid == 0 || uid == daemon_uid || uids.contains(uid) ||
         gids.contains(gid);
}

bool AdminPolicy::IsAdminSubject(absl::string_view tls_subject) const {
  return !tls_subject.empty() && tls_subjects.contains(tls_subject);
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
                   "--admin_gid or the config's admin ids); this session (",
                   DescribeCaller(c), ") is not admin"));
}

}  // namespace kvdepot
