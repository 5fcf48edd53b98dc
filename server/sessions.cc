#include "server/sessions.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/backend/inline_call.h"
#include "server/limits.h"
#include "server/logging.h"

namespace kvdepot {
namespace {

// The one message for every id that does not name a live session: it
// never contains the id.
absl::Status UnknownSession() {
  return absl::UnauthenticatedError(
      "the session id is malformed, unknown or its session has ended");
}

absl::Status FillRandom(uint8_t* out, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(out + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(
          absl::StrCat("getrandom: ", std::strerror(errno)));
    }
    got += static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

// Parses "<number>.<32 hex>"; false for anything else.
bool ParseId(absl::string_view id, uint64_t* number,
             std::array<uint8_t, 16>* secret) {
  const size_t dot = id.find('.');
  if (dot == absl::string_view::npos || dot == 0 || dot > 20) return false;
  if (!absl::SimpleAtoi(id.substr(0, dot), number) || *number == 0) {
    return false;
  }
  const absl::string_view hex = id.substr(dot + 1);
  if (hex.size() != 32) return false;
  for (size_t i = 0; i < 16; ++i) {
    int v = 0;
    for (int k = 0; k < 2; ++k) {
      const char c = hex[2 * i + k];
      int d;
      if (c >= '0' && c <= '9') {
        d = c - '0';
      } else if (c >= 'a' && c <= 'f') {
        d = c - 'a' + 10;
      } else {
        return false;
      }
      v = v * 16 + d;
    }
    (*secret)[i] = static_cast<uint8_t>(v);
  }
  return true;
}

// Compares without an early exit, so timing does not tell how many leading
// bytes of a guess were right.
bool ConstantTimeEqual(const std::array<uint8_t, 16>& a,
                       const std::array<uint8_t, 16>& b) {
  volatile uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = static_cast<uint8_t>(diff | (a[i] ^ b[i]));
  }
  return diff == 0;
}

}  // namespace

absl::Status SessionManager::CheckClientName(absl::string_view name) const {
  if (static_cast<int64_t>(name.size()) > limits_.max_client_name_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "client_name = \"", EscapeForLog(name, 64), "\" has ", name.size(),
        " bytes, more than ", limits_.max_client_name_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<OpenedSession> SessionManager::OpenLocked(Session session) {
  if (static_cast<int64_t>(sessions_.size()) >= limits_.max_sessions) {
    return LimitExceeded(
        Limit::kSessions,
        absl::StrCat("too many sessions (", limits_.max_sessions, ")"));
  }
  if (session.peer) {
    int64_t of_uid = 0;
    for (const auto& [number, other] : sessions_) {
      if (other.peer && other.creds.uid == session.creds.uid) ++of_uid;
    }
    if (of_uid >= limits_.max_sessions_per_uid) {
      return LimitExceeded(
          Limit::kSessionsPerClient,
          absl::StrCat("uid ", session.creds.uid, " already has ", of_uid,
                       " sessions (at most ", limits_.max_sessions_per_uid,
                       " per uid)"));
    }
  } else if (!session.tls_subject.empty()) {
    int64_t of_subject = 0;
    for (const auto& [number, other] : sessions_) {
      if (other.tls_subject == session.tls_subject) ++of_subject;
    }
    if (of_subject >= limits_.max_sessions_per_uid) {
      return LimitExceeded(
          Limit::kSessionsPerClient,
          absl::StrCat("tls subject \"", EscapeForLog(session.tls_subject, 64),
                       "\" already has ", of_subject, " sessions (at most ",
                       limits_.max_sessions_per_uid, " per client)"));
    }
  } else {
    // Anonymous sessions (OpenSession, plain loopback TCP) name nobody: all
    // of them together are one client, so whoever can reach the socket
    // cannot take every session from the workers.
    int64_t anonymous = 0;
    for (const auto& [number, other] : sessions_) {
      if (!other.peer && other.tls_subject.empty()) ++anonymous;
    }
    if (anonymous >= limits_.max_sessions_per_uid) {
      return LimitExceeded(
          Limit::kSessionsPerClient,
          absl::StrCat("there are already ", anonymous,
                       " anonymous sessions (at most ",
                       limits_.max_sessions_per_uid,
                       " together); open a session on the Unix socket or "
                       "with a TLS client certificate"));
    }
  }
  OpenedSession opened;
  opened.number = next_session_++;
  opened.id =
      absl::StrCat(opened.number, ".",
                   absl::BytesToHexString(absl::string_view(
                       reinterpret_cast<const char*>(session.secret.data()),
                       session.secret.size())));
  sessions_.emplace(opened.number, std::move(session));
  return opened;
}

absl::StatusOr<OpenedSession> SessionManager::OpenPeer(
    absl::string_view client_name, const PeerCredentials& peer) {
  RETURN_IF_ERROR(CheckClientName(client_name));
  Session s;
  if (absl::Status st = FillRandom(s.secret.data(), s.secret.size());
      !st.ok()) {
    return st;
  }
  s.client_name = std::string(client_name);
  s.peer = true;
  s.creds = peer;
  absl::MutexLock lock(&mu_);
  return OpenLocked(std::move(s));
}

absl::StatusOr<OpenedSession> SessionManager::OpenStream(
    absl::string_view client_name, absl::string_view tls_subject) {
  RETURN_IF_ERROR(CheckClientName(client_name));
  if (tls_subject.size() > kMaxTlsSubjectBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the client certificate's subject has ", tls_subject.size(),
        " bytes, more than ", kMaxTlsSubjectBytes));
  }
  Session s;
  if (absl::Status st = FillRandom(s.secret.data(), s.secret.size());
      !st.ok()) {
    return st;
  }
  s.client_name = std::string(client_name);
  s.stream = true;
  s.tls_subject = std::string(tls_subject);
  absl::MutexLock lock(&mu_);
  return OpenLocked(std::move(s));
}

absl::StatusOr<std::string> SessionManager::Open(absl::string_view client_name,
                                                 absl::Duration lease,
                                                 absl::Time now,
                                                 absl::Duration* granted) {
  if (lease < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lease_ms = ", absl::ToInt64Milliseconds(lease), " must be >= 0"));
  }
  RETURN_IF_ERROR(CheckClientName(client_name));
  if (lease == absl::ZeroDuration()) lease = limits_.default_lease;
  lease = std::min(lease, limits_.max_lease);
  Session s;
  if (absl::Status st = FillRandom(s.secret.data(), s.secret.size());
      !st.ok()) {
    return st;
  }
  s.client_name = std::string(client_name);
  s.lease = lease;
  s.expires = now + lease;
  absl::MutexLock lock(&mu_);
  absl::StatusOr<OpenedSession> opened = OpenLocked(std::move(s));
  if (!opened.ok()) return opened.status();
  *granted = lease;
  return opened->id;
}

absl::StatusOr<SessionManager::Session*> SessionManager::FindLocked(
    absl::string_view session_id, absl::Time now, uint64_t* number) {
  std::array<uint8_t, 16> secret;
  if (!ParseId(session_id, number, &secret)) return UnknownSession();
  auto it = sessions_.find(*number);
  if (it == sessions_.end() || !ConstantTimeEqual(it->second.secret, secret) ||
      it->second.expires < now) {
    return UnknownSession();
  }
  if (!it->second.peer && !it->second.stream) {
    it->second.expires = now + it->second.lease;
  }
  return &it->second;
}

Caller SessionManager::CallerOf(uint64_t number, const Session& s) const {
  Caller c;
  c.session = number;
  c.peer = s.peer;
  if (s.peer) {
    c.uid = s.creds.uid;
    c.gid = s.creds.gid;
    c.admin = admin_.IsAdmin(s.creds.uid, s.creds.gid);
  } else if (!s.tls_subject.empty()) {
    c.tls_subject = s.tls_subject;
    c.admin = admin_.IsAdminSubject(s.tls_subject);
  }
  return c;
}

absl::StatusOr<Caller> SessionManager::Authenticate(
    absl::string_view session_id, absl::Time now) {
  if (session_id.empty()) return Caller{};
  absl::MutexLock lock(&mu_);
  uint64_t number = 0;
  absl::StatusOr<Session*> s = FindLocked(session_id, now, &number);
  if (!s.ok()) return s.status();
  return CallerOf(number, **s);
}

absl::StatusOr<absl::Duration> SessionManager::Touch(
    absl::string_view session_id, absl::Time now) {
  absl::MutexLock lock(&mu_);
  uint64_t number = 0;
  absl::StatusOr<Session*> s = FindLocked(session_id, now, &number);
  if (!s.ok()) return s.status();
  return (*s)->peer || (*s)->stream ? absl::InfiniteDuration() : (*s)->lease;
}

void SessionManager::DropSessionLocked(
    Session& session, std::vector<std::shared_ptr<Buffer>>* dropped) {
  for (uint64_t id : session.buffers) {
    auto it = buffers_.find(id);
    if (it == buffers_.end()) continue;
    buffer_bytes_ -= it->second->memory->size();
    dropped->push_back(std::move(it->second));
    buffers_.erase(it);
  }
  session.buffers.clear();
}

absl::StatusOr<int64_t> SessionManager::Close(absl::string_view session_id) {
  std::vector<std::shared_ptr<Buffer>> dropped;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  uint64_t number = 0;
  absl::StatusOr<Session*> s =
      FindLocked(session_id, absl::InfinitePast(), &number);
  if (!s.ok()) return s.status();
  DropSessionLocked(**s, &dropped);
  sessions_.erase(number);
  return static_cast<int64_t>(dropped.size());
}

int64_t SessionManager::CloseNumber(uint64_t number) {
  std::vector<std::shared_ptr<Buffer>> dropped;
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(number);
  if (it == sessions_.end()) return 0;
  DropSessionLocked(it->second, &dropped);
  sessions_.erase(it);
  return static_cast<int64_t>(dropped.size());
}

absl::StatusOr<std::shared_ptr<Buffer>> SessionManager::AddBuffer(
    const Caller& caller, std::unique_ptr<Memory> memory,
    MemoryReservation reservation) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(caller.session);
  if (!caller.authenticated() || it == sessions_.end()) {
    return UnknownSession();
  }
  Session& s = it->second;
  if (static_cast<int64_t>(s.buffers.size()) >=
      limits_.max_buffers_per_session) {
    return LimitExceeded(
        Limit::kBuffersPerSession,
        absl::StrCat("this session already holds ",
                     limits_.max_buffers_per_session, " buffers"));
  }
  // Device memory is freed off gRPC's threads (see pools.cc).
  std::shared_ptr<Buffer> buffer(new Buffer, [](Buffer* b) {
    DeleteOffInline(b, b->memory != nullptr && b->memory->device() != "cpu");
  });
  buffer->id = next_buffer_id_++;
  buffer->owner_session = caller.session;
  buffer->reservation = std::move(reservation);
  buffer->memory = std::move(memory);
  buffer_bytes_ += buffer->memory->size();
  s.buffers.insert(buffer->id);
  buffers_[buffer->id] = buffer;
  return buffer;
}

absl::StatusOr<std::shared_ptr<Buffer>> SessionManager::GetBuffer(
    const Caller& caller, absl::string_view field, uint64_t buffer_id) const {
  absl::MutexLock lock(&mu_);
  auto it = buffers_.find(buffer_id);
  if (it == buffers_.end()) {
    return absl::NotFoundError(
        absl::StrCat(field, " = ", buffer_id, " is not a live buffer"));
  }
  const Buffer& b = *it->second;
  if (!caller.authenticated()) {
    return absl::UnauthenticatedError(
        absl::StrCat(field, " = ", buffer_id,
                     ": buffers can only be used with a session (session_id)"));
  }
  if (b.owner_session != caller.session && !b.acl.Allows(caller)) {
    return absl::PermissionDeniedError(
        absl::StrCat(field, " = ", buffer_id,
                     " belongs to another session that did not grant it "
                     "to this one"));
  }
  return it->second;
}

absl::Status SessionManager::ReleaseBuffer(const Caller& caller,
                                           uint64_t buffer_id) {
  std::shared_ptr<Buffer> dropped;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  auto s = sessions_.find(caller.session);
  if (!caller.authenticated() || s == sessions_.end()) return UnknownSession();
  if (!s->second.buffers.contains(buffer_id)) {
    return absl::NotFoundError(absl::StrCat(
        "buffer_id = ", buffer_id, " is not a buffer of this session"));
  }
  s->second.buffers.erase(buffer_id);
  auto it = buffers_.find(buffer_id);
  buffer_bytes_ -= it->second->memory->size();
  dropped = std::move(it->second);
  buffers_.erase(it);
  return absl::OkStatus();
}

absl::Status SessionManager::GrantBuffer(const Caller& caller,
                                         uint64_t buffer_id, const Acl& grant) {
  absl::MutexLock lock(&mu_);
  auto s = sessions_.find(caller.session);
  if (!caller.authenticated() || s == sessions_.end()) return UnknownSession();
  if (!s->second.buffers.contains(buffer_id)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "buffer_id = ", buffer_id,
        " is not a buffer of this session: only its owner may grant it"));
  }
  Acl g = grant;
  g.anonymous = false;  // anonymous access comes from the config only
  Acl& acl = buffers_[buffer_id]->acl;
  RETURN_IF_ERROR(
      CheckGrantFits(acl, g, absl::StrCat("buffer_id = ", buffer_id)));
  acl.Merge(g);
  return absl::OkStatus();
}

int64_t SessionManager::BufferCount(uint64_t number) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(number);
  return it == sessions_.end()
             ? 0
             : static_cast<int64_t>(it->second.buffers.size());
}

int64_t SessionManager::Reap(absl::Time now) {
  std::vector<std::shared_ptr<Buffer>> dropped;
  int64_t reaped = 0;
  absl::MutexLock lock(&mu_);
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (it->second.expires < now) {
      DropSessionLocked(it->second, &dropped);
      sessions_.erase(it++);
      ++reaped;
    } else {
      ++it;
    }
  }
  return reaped;
}

void SessionManager::Clear() {
  std::vector<std::shared_ptr<Buffer>> dropped;
  absl::MutexLock lock(&mu_);
  for (auto& [id, session] : sessions_) DropSessionLocked(session, &dropped);
  sessions_.clear();
}

SessionStats SessionManager::Stats() const {
  absl::MutexLock lock(&mu_);
  SessionStats st;
  st.sessions = static_cast<int64_t>(sessions_.size());
  st.buffers = static_cast<int64_t>(buffers_.size());
  st.buffer_bytes = buffer_bytes_;
  return st;
}

}  // namespace kvdepot
