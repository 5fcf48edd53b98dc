#include "server/companion.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string_view>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/fd_passing.h"
#include "common/status_macros.h"
#include "common/step_ring.h"
#include "server/limits.h"
#include "server/log_limiter.h"
#include "spdlog/spdlog.h"

namespace kvdepot {
namespace {

// Requests whose success is logged by their handler with more detail (the
// peer's credentials, the ring's size): one line each, not two.
bool LogsItsOwnSuccess(std::string_view rpc) {
  return rpc == "Hello" || rpc == "OpenStepRing" || rpc == "CloseStepRing";
}

// Untrusted strings in log lines: escaped (no newlines) and truncated.
std::string ForLog(absl::string_view s) {
  return absl::CHexEscape(s.substr(0, 64));
}

// SO_RCVTIMEO of `fd`: `left` (rounded up to a microsecond), or none for
// an infinite duration. False when `left` has run out (or the call fails).
bool SetReceiveTimeout(int fd, absl::Duration left) {
  timeval tv{};
  if (left != absl::InfiniteDuration()) {
    if (left <= absl::ZeroDuration()) return false;
    const int64_t us = std::max<int64_t>(1, absl::ToInt64Microseconds(left));
    tv.tv_sec = us / 1000000;
    tv.tv_usec = us % 1000000;
  }
  return setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) == 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CompanionServer>> CompanionServer::Start(
    const CompanionOptions& options, Backend* backend, PoolRegistry* pools,
    SessionManager* sessions) {
  std::unique_ptr<CompanionServer> s(
      new CompanionServer(options, backend, pools, sessions));
  struct sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  if (options.path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "companion socket path \"", options.path, "\" is longer than ",
        sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::memcpy(addr.sun_path, options.path.data(), options.path.size());
  s->listen_fd_.reset(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!s->listen_fd_.valid() ||
      bind(s->listen_fd_.get(), reinterpret_cast<struct sockaddr*>(&addr),
           sizeof(addr)) != 0 ||
      listen(s->listen_fd_.get(), 128) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on the companion socket \"", options.path,
                     "\": ", std::strerror(errno)));
  }
  if (chmod(options.path.c_str(), 0660) != 0 ||
      (options.group != static_cast<gid_t>(-1) &&
       chown(options.path.c_str(), -1, options.group) != 0)) {
    const std::string err = std::strerror(errno);
    unlink(options.path.c_str());
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot set the mode/group of \"", options.path, "\": ", err));
  }
  CompanionServer* raw = s.get();
  s->acceptor_ = std::thread([raw] { raw->AcceptLoop(); });
  return s;
}

CompanionServer::~CompanionServer() { Shutdown(); }

void CompanionServer::ReapFinishedLocked() {
  for (auto it = conns_.begin(); it != conns_.end();) {
    if (it->second->done) {
      it->second->thread.join();
      conns_.erase(it++);
    } else {
      ++it;
    }
  }
}

void CompanionServer::AcceptLoop() {
  while (true) {
    UniqueFd fd(accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    if (!fd.valid()) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
          errno == ENOMEM) {
        // Out of descriptors: let a connection end before trying again.
        mu_.AwaitWithTimeout(absl::Condition(&stopping_),
                             absl::Milliseconds(50));
        continue;
      }
      spdlog::error("companion accept: {}", std::strerror(errno));
      return;
    }
    ReapFinishedLocked();
    struct ucred cred;
    socklen_t len = sizeof(cred);
    if (getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      continue;
    }
    if (static_cast<int>(conns_.size()) >= options_.max_connections) {
      if (AdmitClientLog(ClientLog::kRefusedConnection,
                         LogClient::Uid(cred.uid))) {
        spdlog::warn(
            "rpc=companion status=RESOURCE_EXHAUSTED connections={} "
            "reason=limit_companion_connections",
            conns_.size());
      }
      if (options_.metrics != nullptr) {
        options_.metrics->RecordLimit(Limit::kCompanionConnections);
      }
      continue;  // closed by `fd`
    }
    if (options_.max_connections_per_uid > 0) {
      int of_uid = 0;
      for (const auto& [id, c] : conns_) of_uid += c->creds.uid == cred.uid;
      if (of_uid >= options_.max_connections_per_uid) {
        if (AdmitClientLog(ClientLog::kRefusedConnection,
                           LogClient::Uid(cred.uid))) {
          spdlog::warn(
              "rpc=companion status=RESOURCE_EXHAUSTED uid={} connections={} "
              "reason=limit_companion_connections_per_uid",
              cred.uid, of_uid);
        }
        if (options_.metrics != nullptr) {
          options_.metrics->RecordLimit(Limit::kCompanionConnectionsPerUid);
        }
        continue;  // closed by `fd`
      }
    }
    auto conn = std::make_unique<Connection>();
    conn->creds = PeerCredentials{cred.pid, cred.uid, cred.gid};
    conn->fd = std::move(fd);
    Connection* c = conn.get();
    conns_.emplace(next_conn_++, std::move(conn));
    c->thread = std::thread([this, c] { Serve(c); });
  }
}

void CompanionServer::Serve(Connection* conn) {
  // Until its session is open, the connection's messages must come before
  // hello_deadline (SO_RCVTIMEO: a receive past it fails, and the
  // connection is closed).
  const absl::Time hello_deadline = absl::Now() + options_.hello_timeout;
  bool waiting_for_hello = true;
  while (true) {
    if (waiting_for_hello &&
        !SetReceiveTimeout(conn->fd.get(), hello_deadline - absl::Now())) {
      break;
    }
    absl::StatusOr<ReceivedMessage> msg =
        ReceiveMessage(conn->fd.get(), kMaxCompanionMessageBytes, 1);
    if (!msg.ok() &&
        msg.status().code() != absl::StatusCode::kInvalidArgument) {
      break;  // closed, broken, or no Hello in time
    }
    v1::CompanionReply reply;
    UniqueFd out_fd;
    v1::CompanionRequest req;
    if (!msg.ok()) {
      // Too long or too many descriptors: every descriptor is closed.
      reply.set_code(static_cast<int>(msg.status().code()));
      reply.set_message(std::string(msg.status().message()));
    } else if (!req.ParseFromString(msg->bytes)) {
      reply.set_code(static_cast<int>(absl::StatusCode::kInvalidArgument));
      reply.set_message("the message is not a kvdepot.v1.CompanionRequest");
    } else {
      reply = Handle(conn, req, std::move(msg->fds), &out_fd);
    }
    std::string bytes;
    reply.SerializeToString(&bytes);
    std::vector<int> fds;
    if (out_fd.valid()) fds.push_back(out_fd.get());
    if (!SendMessage(conn->fd.get(), bytes, fds).ok()) break;
    if (waiting_for_hello && conn->session != 0) {
      waiting_for_hello = false;
      if (!SetReceiveTimeout(conn->fd.get(), absl::InfiniteDuration())) break;
    }
  }
  if (waiting_for_hello && absl::Now() >= hello_deadline) {
    if (AdmitClientLog(ClientLog::kFailedCall, conn->log_client())) {
      spdlog::info(
          "rpc=companion status=DEADLINE_EXCEEDED pid={} uid={} reason=no "
          "Hello within {} ms",
          conn->creds.pid, conn->creds.uid,
          absl::ToInt64Milliseconds(options_.hello_timeout));
    }
  }
  if (conn->session != 0) {
    // The rings first: their threads stop before the session they serve
    // goes away.
    if (options_.step_rings != nullptr) {
      options_.step_rings->CloseRingsOf(conn->session);
    }
    const int64_t n = sessions_->CloseNumber(conn->session);
    if (AdmitClientLog(ClientLog::kClientEvent, conn->log_client())) {
      spdlog::info(
          "rpc=companion_close session={} status=OK buffers_released={}",
          conn->session, n);
    }
  }
  conn->session_id.clear();
  // The peer sees the end now (the descriptor itself is closed when the
  // connection is reaped, at the next accept or at shutdown).
  shutdown(conn->fd.get(), SHUT_RDWR);
  absl::MutexLock lock(&mu_);
  conn->done = true;
}

v1::CompanionReply CompanionServer::Handle(Connection* conn,
                                           const v1::CompanionRequest& req,
                                           std::vector<UniqueFd> fds,
                                           UniqueFd* fd_out) {
  v1::CompanionReply reply;
  absl::Status status;
  const char* rpc = "companion";
  if (req.kind_case() != v1::CompanionRequest::kImportBuffer && !fds.empty()) {
    status = absl::InvalidArgumentError(
        "only import_buffer carries a descriptor; the ones sent were closed");
  } else if (req.kind_case() == v1::CompanionRequest::kHello) {
    rpc = "Hello";
    status = Hello(conn, req.hello(), reply.mutable_hello());
  } else if (conn->session == 0) {
    status = absl::FailedPreconditionError(
        "send a Hello first: it opens the session of this connection");
  } else {
    absl::StatusOr<Caller> caller =
        sessions_->Authenticate(conn->session_id, absl::Now());
    if (!caller.ok()) {
      status = caller.status();
    } else {
      switch (req.kind_case()) {
        case v1::CompanionRequest::kMapPool:
          rpc = "MapPool";
          status = MapPool(*caller, req.map_pool(), &reply, fd_out);
          break;
        case v1::CompanionRequest::kAllocateBuffer:
          rpc = "AllocateBuffer";
          status =
              AllocateBuffer(*caller, req.allocate_buffer(), &reply, fd_out);
          break;
        case v1::CompanionRequest::kImportBuffer:
          rpc = "ImportBuffer";
          if (fds.size() != 1) {
            status = absl::InvalidArgumentError(absl::StrCat(
                "import_buffer carries ", fds.size(),
                " descriptors; it needs exactly one (a memfd, or a CUDA VMM "
                "export on the cuda backend)"));
          } else {
            status = ImportBuffer(*caller, req.import_buffer(),
                                  std::move(fds[0]), reply.mutable_buffer());
          }
          break;
        case v1::CompanionRequest::kOpenStepRing:
          rpc = "OpenStepRing";
          status = OpenStepRing(*caller, *conn, req.open_step_ring(), &reply,
                                fd_out);
          break;
        case v1::CompanionRequest::kCloseStepRing:
          rpc = "CloseStepRing";
          status = options_.step_rings == nullptr
                       ? absl::NotFoundError(
                             "close_step_ring.ring_id: this daemon serves no "
                             "step path")
                       : options_.step_rings->CloseRing(
                             *caller, req.close_step_ring().ring_id());
          // A reply is never empty (an empty SEQPACKET message reads as
          // the peer's close): the closed ring's id.
          reply.mutable_step_ring()->set_ring_id(
              req.close_step_ring().ring_id());
          break;
        default:
          status = absl::InvalidArgumentError(
              "kind: set hello, map_pool, allocate_buffer, import_buffer, "
              "open_step_ring or close_step_ring");
      }
    }
  }
  if (!status.ok()) {
    reply.clear_kind();
    reply.clear_fd_size();
    reply.clear_fd_device();
    fd_out->reset();
    reply.set_code(static_cast<int>(status.code()));
    reply.set_message(std::string(status.message()));
    if (std::optional<Limit> limit = LimitOf(status);
        limit.has_value() && options_.metrics != nullptr) {
      options_.metrics->RecordLimit(*limit);
    }
    if (AdmitClientLog(ClientLog::kFailedCall, conn->log_client())) {
      spdlog::info("rpc={} session={} status={} error=\"{}\"", rpc,
                   conn->session, absl::StatusCodeToString(status.code()),
                   ForLog(status.message()));
    }
  } else if (!LogsItsOwnSuccess(rpc) &&
             AdmitClientLog(ClientLog::kClientEvent, conn->log_client())) {
    spdlog::info("rpc={} session={} status=OK", rpc, conn->session);
  }
  return reply;
}

absl::Status CompanionServer::Hello(Connection* conn, const v1::Hello& hello,
                                    v1::HelloReply* out) {
  if (conn->session != 0) {
    return absl::FailedPreconditionError(
        "this connection already has a session (one Hello per connection)");
  }
  ASSIGN_OR_RETURN(OpenedSession opened,
                   sessions_->OpenPeer(hello.client_name(), conn->creds));
  conn->session = opened.number;
  conn->session_id = opened.id;
  out->set_session_id(opened.id);
  out->set_session_number(opened.number);
  out->set_uid(conn->creds.uid);
  out->set_gid(conn->creds.gid);
  out->set_pid(conn->creds.pid);
  if (AdmitClientLog(ClientLog::kClientEvent, conn->log_client())) {
    spdlog::info("rpc=Hello session={} uid={} gid={} pid={} client=\"{}\"",
                 opened.number, conn->creds.uid, conn->creds.gid,
                 conn->creds.pid, ForLog(hello.client_name()));
  }
  return absl::OkStatus();
}

absl::Status CompanionServer::MapPool(const Caller& caller,
                                      const v1::MapPoolRequest& r,
                                      v1::CompanionReply* reply,
                                      UniqueFd* fd_out) {
  v1::PoolInfo* out = reply->mutable_pool();
  ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, pools_->Get("name", r.name()));
  RETURN_IF_ERROR(pool->CheckUse(caller, "name"));
  {
    absl::ReaderMutexLock lock(&pool->mu);
    ASSIGN_OR_RETURN(*fd_out, pool->memory->ExportFd());
    reply->set_fd_size(pool->memory->fd_size());
    reply->set_fd_device(pool->memory->device());
  }
  pool->ToProto(out);
  return absl::OkStatus();
}

// What a new buffer, allocated or imported, must pass first: the daemon
// takes new work, the size is within --max_buffer_bytes and the connection
// may hold one more descriptor.
absl::Status CompanionServer::CheckNewBuffer(const Caller& caller,
                                             absl::string_view field,
                                             int64_t size) const {
  if (!accepting()) {
    return absl::UnavailableError("kvdepot is draining: no new buffers");
  }
  if (size <= 0 || size > options_.max_buffer_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " = ", size, " is outside [1, ",
                     options_.max_buffer_bytes, "] (--max_buffer_bytes)"));
  }
  // Requests of one connection run one at a time: no other can add a
  // buffer between this count and the AddBuffer that follows.
  const int64_t held = sessions_->BufferCount(caller.session);
  if (held >= options_.max_descriptors_per_connection) {
    return LimitExceeded(
        Limit::kDescriptorsPerConnection,
        absl::StrCat(field, ": this companion connection already holds ", held,
                     " descriptors (one per buffer), the most one connection "
                     "may hold (--max_descriptors_per_connection = ",
                     options_.max_descriptors_per_connection,
                     "); release a buffer first"));
  }
  return absl::OkStatus();
}

absl::Status CompanionServer::AllocateBuffer(const Caller& caller,
                                             const v1::AllocateBufferRequest& r,
                                             v1::CompanionReply* reply,
                                             UniqueFd* fd_out) {
  v1::BufferInfo* out = reply->mutable_buffer();
  RETURN_IF_ERROR(CheckNewBuffer(caller, "allocate_buffer.size", r.size()));
  ASSIGN_OR_RETURN(
      MemoryReservation reservation,
      MemoryReservation::Open(options_.budget, BudgetClientOf(caller), r.size(),
                              "allocate_buffer.size"));
  ASSIGN_OR_RETURN(std::unique_ptr<Memory> memory,
                   backend_->Allocate(r.size(), ""));
  ASSIGN_OR_RETURN(UniqueFd fd, memory->ExportFd());
  reply->set_fd_size(memory->fd_size());
  reply->set_fd_device(memory->device());
  ASSIGN_OR_RETURN(
      std::shared_ptr<Buffer> buffer,
      sessions_->AddBuffer(caller, std::move(memory), std::move(reservation)));
  out->set_buffer_id(buffer->id);
  out->set_size(buffer->memory->size());
  *fd_out = std::move(fd);
  return absl::OkStatus();
}

absl::Status CompanionServer::ImportBuffer(const Caller& caller,
                                           const v1::ImportMemfdRequest& r,
                                           UniqueFd fd, v1::BufferInfo* out) {
  RETURN_IF_ERROR(CheckNewBuffer(caller, "import_buffer.size", r.size()));
  // Imported memory counts in the importing client's budget: the daemon
  // maps it and would be the one to fault on it.
  ASSIGN_OR_RETURN(
      MemoryReservation reservation,
      MemoryReservation::Open(options_.budget, BudgetClientOf(caller), r.size(),
                              "import_buffer.size"));
  ASSIGN_OR_RETURN(std::unique_ptr<Memory> memory,
                   backend_->ImportFd(std::move(fd), r.size()));
  ASSIGN_OR_RETURN(
      std::shared_ptr<Buffer> buffer,
      sessions_->AddBuffer(caller, std::move(memory), std::move(reservation)));
  out->set_buffer_id(buffer->id);
  out->set_size(buffer->memory->size());
  return absl::OkStatus();
}

absl::Status CompanionServer::OpenStepRing(const Caller& caller,
                                           const Connection& conn,
                                           const v1::OpenStepRingRequest& r,
                                           v1::CompanionReply* reply,
                                           UniqueFd* fd_out) {
  if (options_.step_rings == nullptr) {
    return absl::FailedPreconditionError(
        "open_step_ring: this daemon serves no step path");
  }
  if (!accepting()) {
    return absl::UnavailableError("kvdepot is draining: no new step rings");
  }
  const int64_t slots = r.slots() == 0 ? 4 : r.slots();
  const int64_t request_bytes =
      r.request_bytes() == 0 ? int64_t{1} << 20 : r.request_bytes();
  RETURN_IF_ERROR(
      CheckStepRingGeometry("open_step_ring", slots, request_bytes));
  const int64_t bytes = StepRingBytes(slots, request_bytes);
  ASSIGN_OR_RETURN(
      MemoryReservation reservation,
      MemoryReservation::Open(options_.budget, BudgetClientOf(caller), bytes,
                              "open_step_ring.request_bytes"));
  ASSIGN_OR_RETURN(
      *fd_out,
      options_.step_rings->OpenRing(
          caller, conn.session_id, static_cast<int32_t>(slots), request_bytes,
          std::move(reservation), reply->mutable_step_ring()));
  reply->set_fd_size(bytes);
  reply->set_fd_device("cpu");
  return absl::OkStatus();
}

void CompanionServer::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      mu_.Await(absl::Condition(&stopped_));
      return;
    }
    stopping_ = true;
    // Wakes the acceptor (accept fails) and every connection thread.
    if (listen_fd_.valid()) shutdown(listen_fd_.get(), SHUT_RDWR);
    for (auto& [id, c] : conns_) shutdown(c->fd.get(), SHUT_RDWR);
  }
  if (acceptor_.joinable()) acceptor_.join();
  absl::flat_hash_map<uint64_t, std::unique_ptr<Connection>> conns;
  {
    absl::MutexLock lock(&mu_);
    conns.swap(conns_);
  }
  for (auto& [id, c] : conns) c->thread.join();
  listen_fd_.reset();
  unlink(options_.path.c_str());
  absl::MutexLock lock(&mu_);
  stopped_ = true;
}

}  // namespace kvdepot
