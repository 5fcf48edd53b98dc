// The companion socket (SPEC §11): a SOCK_SEQPACKET Unix socket next to the
// gRPC one where clients open their session and receive memory as
// descriptors.
//
// Each connection is served by its own thread (at most max_connections,
// and max_connections_per_uid of one peer uid, so no uid can take every
// connection from the others; more are closed at once). Its first message,
// within hello_timeout (else the connection is closed: idle connections
// hold no slot for long), is a Hello: the daemon
// records the peer's SO_PEERCRED credentials and opens a session that ends
// when the connection closes, releasing its buffers. Later messages map a
// pool (access checked), allocate a buffer or import the client's memfd
// (validated, common/memfd.h) or open a step ring (common/step_ring.h; its
// rings close with the connection). Each message is one CompanionRequest;
// each answer one CompanionReply, with a descriptor for pools, allocations
// and rings.
#ifndef KVDEPOT_SERVER_COMPANION_H_
#define KVDEPOT_SERVER_COMPANION_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/unique_fd.h"
#include "kvdepot/v1/kvdepot.pb.h"
#include "server/backend/backend.h"
#include "server/log_limiter.h"
#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/pools.h"
#include "server/sessions.h"
#include "server/step_ring_host.h"

namespace kvdepot {

// Largest CompanionRequest accepted.
inline constexpr size_t kMaxCompanionMessageBytes = 64 << 10;

struct CompanionOptions {
  std::string path;  // the socket file (claimed by the caller)
  gid_t group = -1;  // chown the socket to this group; -1 = keep
  int max_connections = 256;
  int max_connections_per_uid = 64;  // 0 = no per-uid cap
  absl::Duration hello_timeout = absl::Seconds(10);
  // Descriptors the daemon holds for one connection: one memfd (or VMM
  // export) per buffer its session holds, allocated or imported.
  int64_t max_descriptors_per_connection = 256;
  int64_t max_buffer_bytes = int64_t{16} << 30;
  // Counts refusals by limit (null = not counted).
  ServerMetrics* metrics = nullptr;
  // What allocated and imported buffers are admitted against, counted for
  // their session's client (BudgetClientOf); null = no admission.
  MemoryBudget* budget = nullptr;
  // False while draining: new sessions, allocations and imports are
  // refused with UNAVAILABLE. Null = always accepting.
  // (Hello is answered while draining too: a session is no work, and an
  // operator's status probe needs one to learn that the daemon drains.)
  std::function<bool()> accepting;
  // Opens and closes step rings (open_step_ring); null = refused with
  // FAILED_PRECONDITION. Must outlive the server.
  StepRingHost* step_rings = nullptr;
};

class CompanionServer {
 public:
  static absl::StatusOr<std::unique_ptr<CompanionServer>> Start(
      const CompanionOptions& options, Backend* backend, PoolRegistry* pools,
      SessionManager* sessions);

  CompanionServer(const CompanionServer&) = delete;
  CompanionServer& operator=(const CompanionServer&) = delete;
  ~CompanionServer();  // Shutdown()

  // Stops accepting, closes every connection (their sessions end), joins
  // the threads and removes the socket file. Idempotent.
  void Shutdown();

 private:
  struct Connection {
    UniqueFd fd;
    std::thread thread;
    bool done = false;  // guarded by mu_
    PeerCredentials creds;
    uint64_t session = 0;    // 0 until Hello
    std::string session_id;  // secret; never logged

    // The client whose share of log lines this connection's lines take.
    LogClient log_client() const { return LogClient::Uid(creds.uid); }
  };

  CompanionServer(const CompanionOptions& options, Backend* backend,
                  PoolRegistry* pools, SessionManager* sessions)
      : options_(options),
        backend_(backend),
        pools_(pools),
        sessions_(sessions) {}

  void AcceptLoop();
  void Serve(Connection* conn);
  // One request of a connection; *fd_out receives a descriptor to send.
  v1::CompanionReply Handle(Connection* conn, const v1::CompanionRequest& req,
                            std::vector<UniqueFd> fds, UniqueFd* fd_out);
  absl::Status Hello(Connection* conn, const v1::Hello& hello,
                     v1::HelloReply* out);
  // Set reply's pool or buffer, fd_size and fd_device.
  absl::Status MapPool(const Caller& caller, const v1::MapPoolRequest& r,
                       v1::CompanionReply* reply, UniqueFd* fd_out);
  absl::Status CheckNewBuffer(const Caller& caller, absl::string_view field,
                              int64_t size) const;
  absl::Status AllocateBuffer(const Caller& caller,
                              const v1::AllocateBufferRequest& r,
                              v1::CompanionReply* reply, UniqueFd* fd_out);
  absl::Status ImportBuffer(const Caller& caller,
                            const v1::ImportMemfdRequest& r, UniqueFd fd,
                            v1::BufferInfo* out);
  absl::Status OpenStepRing(const Caller& caller, const Connection& conn,
                            const v1::OpenStepRingRequest& r,
                            v1::CompanionReply* reply, UniqueFd* fd_out);
  bool accepting() const { return !options_.accepting || options_.accepting(); }
  // Joins connection threads that finished.
  void ReapFinishedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CompanionOptions options_;
  Backend* const backend_;
  PoolRegistry* const pools_;
  SessionManager* const sessions_;
  UniqueFd listen_fd_;
  std::thread acceptor_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_conn_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Connection>> conns_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_COMPANION_H_
