#include "server/sessions.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/shm.h"

namespace kvdepot {
namespace {
constexpr int kSessionIdBytes = 16;
}  // namespace

absl::StatusOr<std::string> SessionManager::Open(absl::string_view client_name,
                                                 absl::Duration lease,
                                                 absl::Time now,
                                                 absl::Duration* granted) {
  if (lease < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lease_ms = ", absl::ToInt64Milliseconds(lease), " must be >= 0"));
  }
  if (lease == absl::ZeroDuration()) lease = limits_.default_lease;
  lease = std::min(lease, limits_.max_lease);
  absl::StatusOr<std::string> id = RandomHex(kSessionIdBytes);
  if (!id.ok()) return id.status();
  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(sessions_.size()) >= limits_.max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("too many sessions (", limits_.max_sessions, ")"));
  }
  Session& s = sessions_[*id];
  s.client_name = std::string(client_name);
  s.lease = lease;
  s.expires = now + lease;
  *granted = lease;
  return id;
}

absl::StatusOr<SessionManager::Session*> SessionManager::FindLocked(
    absl::string_view session_id, absl::Time now) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end() || it->second.expires < now) {
    return absl::NotFoundError(absl::StrCat(
        "session_id = \"", session_id, "\" is unknown or its lease expired"));
  }
  it->second.expires = now + it->second.lease;
  return &it->second;
}

absl::StatusOr<absl::Duration> SessionManager::Touch(
    absl::string_view session_id, absl::Time now) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Session*> s = FindLocked(session_id, now);
  if (!s.ok()) return s.status();
  return (*s)->lease;
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
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session_id = \"", session_id, "\" is unknown"));
  }
  DropSessionLocked(it->second, &dropped);
  sessions_.erase(it);
  return static_cast<int64_t>(dropped.size());
}

absl::StatusOr<std::shared_ptr<Buffer>> SessionManager::AddBuffer(
    absl::string_view session_id, std::unique_ptr<Memory> memory,
    absl::Time now) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Session*> s = FindLocked(session_id, now);
  if (!s.ok()) return s.status();
  if (static_cast<int64_t>((*s)->buffers.size()) >=
      limits_.max_buffers_per_session) {
    return absl::ResourceExhaustedError(
        absl::StrCat("session \"", session_id, "\" already holds ",
                     limits_.max_buffers_per_session, " buffers"));
  }
  auto buffer = std::make_shared<Buffer>();
  buffer->id = next_buffer_id_++;
  buffer->session_id = std::string(session_id);
  buffer->memory = std::move(memory);
  buffer_bytes_ += buffer->memory->size();
  (*s)->buffers.insert(buffer->id);
  buffers_[buffer->id] = buffer;
  return buffer;
}

absl::StatusOr<std::shared_ptr<Buffer>> SessionManager::GetBuffer(
    absl::string_view field, uint64_t buffer_id) const {
  absl::MutexLock lock(&mu_);
  auto it = buffers_.find(buffer_id);
  if (it == buffers_.end()) {
    return absl::NotFoundError(
        absl::StrCat(field, " = ", buffer_id, " is not a live buffer"));
  }
  return it->second;
}

absl::Status SessionManager::ReleaseBuffer(absl::string_view session_id,
                                           uint64_t buffer_id, absl::Time now) {
  std::shared_ptr<Buffer> dropped;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Session*> s = FindLocked(session_id, now);
  if (!s.ok()) return s.status();
  if (!(*s)->buffers.contains(buffer_id)) {
    return absl::NotFoundError(absl::StrCat(
        "buffer_id = ", buffer_id, " is not a buffer of this session"));
  }
  (*s)->buffers.erase(buffer_id);
  auto it = buffers_.find(buffer_id);
  buffer_bytes_ -= it->second->memory->size();
  dropped = std::move(it->second);
  buffers_.erase(it);
  return absl::OkStatus();
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
