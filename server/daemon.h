// The daemon as a library: the gRPC server with the KVCache service, health
// (grpc.health.v1), reflection, the companion socket (sessions and memory
// descriptors, SPEC §11), the session reaper and graceful drain. The
// kvdepotd binary is a thin main around it; tests start it in-process too.
#ifndef KVDEPOT_SERVER_DAEMON_H_
#define KVDEPOT_SERVER_DAEMON_H_

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/server_builder_option.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backend/backend.h"
#include "server/companion.h"
#include "server/descriptors.h"
#include "server/grpc_listener.h"
#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/metrics_http.h"
#include "server/pools.h"
#include "server/service.h"
#include "server/service_tcp_session.h"
#include "server/serving.h"
#include "server/sessions.h"
#include "server/socket_relay.h"
#include "server/step/step_server.h"
#include "server/tls.h"

namespace kvdepot {

// How long a new connection may take to finish its handshake (TLS) before
// gRPC closes it (docs/DAEMON.md "Limits").
inline constexpr int kServerHandshakeTimeoutMs = 10000;

struct DaemonOptions {
  // "" = the default Unix socket (common/default_address.h); "/path" or
  // "unix:/path" = that socket (mode 0660); "host:port" = TCP (port 0 picks
  // a free one). A Unix socket gets its companion next to it
  // (CompanionSocketPathOf); TCP has none (anonymous sessions only).
  std::string listen;
  // TCP beyond loopback needs mutual TLS (server/tls.h).
  TlsOptions tls;
  std::string backend = "auto";  // auto | cpu | cuda
  std::string config_path;       // textproto DaemonConfig, or ""
  // "host:port" serves Prometheus GET /metrics over HTTP (port 0 picks a
  // free one); "" = off.
  std::string metrics_address;
  // The sockets' group (-1 = the daemon's): with a group, both sockets are
  // chowned to it and the default socket directory is 0750 with it (a
  // shared volume); without, the directory is 0700.
  gid_t socket_group = static_cast<gid_t>(-1);
  // Admin identity besides the daemon's uid and root (--admin_gid).
  gid_t admin_gid = static_cast<gid_t>(-1);
  // CUDA: share memory by legacy CUDA IPC handles (--legacy_cuda_ipc).
  bool legacy_cuda_ipc = false;
  // CUDA: the watchdog on a client's wait event, and the device memory
  // kept free for others (BackendOptions).
  absl::Duration cuda_wait_timeout = absl::Seconds(10);
  int64_t cuda_memory_reserve_bytes = int64_t{1} << 30;
  bool cuda_blocking_sync = true;  // BackendOptions::cuda_blocking_sync
  bool step_graphs = true;         // step::CudaEngineOptions::graphs
  bool step_pdl = true;            // step::CudaEngineOptions::pdl
  int step_timing_every = 16;      // step::CudaEngineOptions::timing_every
  // Open StepStreams in the daemon and per session (--max_step_streams,
  // --max_step_streams_per_session; docs/DAEMON.md "Limits").
  int max_step_streams = 64;
  int max_step_streams_per_session = 4;
  int64_t max_message_bytes = int64_t{64} << 20;
  // gRPC server reflection (grpcurl list/describe; --grpc_reflection). In
  // this gRPC (1.51) it is a sync service, so gRPC polls sync completion
  // queues next to the callback one; rpc_benchmark's floor rows measured
  // no cost from that (a bare callback server and the same next to a sync
  // service within noise, dev VM 2026-12-01), so it stays on by default.
  // (The Step service is on the callback API too since StepStream.)
  bool grpc_reflection = true;
  // gRPC threads in all (pollers and handlers), and calls in flight on one
  // connection (docs/DAEMON.md "Limits").
  int max_threads = 64;
  int max_streams_per_connection = 32;
  int64_t max_pool_bytes = int64_t{1} << 40;
  // Pools at once (all clients), and descriptors the daemon holds for one
  // companion connection (its buffers' memfds) (docs/DAEMON.md "Limits").
  int64_t max_pools = 1024;
  int64_t max_descriptors_per_connection = 256;
  // Companion connections of one peer uid (0 = no cap), and how long a new
  // one may take to send its Hello (docs/DAEMON.md "Limits").
  int max_companion_connections_per_uid = 64;
  absl::Duration companion_hello_timeout = absl::Seconds(10);
  // gRPC connections one peer uid may hold on the Unix socket (0 = no
  // cap; server/grpc_listener.h).
  int max_connections_per_uid = 256;
  // Descriptors the CPU backend's pools and buffers may hold together
  // (server/descriptors.h); 0 = DefaultDescriptorBudget of the soft
  // RLIMIT_NOFILE, which Init first raises to the hard limit.
  int64_t max_descriptors = 0;
  // The memory budget (SPEC §11) of the CPU backend: > 0 = this many bytes
  // (--memory_budget_bytes), 0 = what the system has available at start
  // (ReadAvailableMemory of memory_files). per_client: the most one client
  // (a uid, or an anonymous session) may hold; 0 = no per-client cap.
  int64_t memory_budget_bytes = 0;
  int64_t memory_budget_per_client_bytes = 0;
  SystemMemoryFiles memory_files;
  // Inline reply bytes the daemon may hold until they are sent, together
  // and per client (server/reply_scope.h); per client 0 = no cap. Both
  // backends: replies are host memory.
  int64_t max_reply_bytes = int64_t{1} << 30;
  // gRPC's memory quota (grpc::ResourceQuota::Resize): what its transports
  // may hold of requests still arriving, all connections together. Past it
  // gRPC stops granting flow-control window, so a client that sends most
  // of large messages and stops cannot grow the daemon further.
  int64_t grpc_memory_bytes = int64_t{1} << 30;
  int64_t max_reply_bytes_per_client = int64_t{256} << 20;
  absl::Duration reap_interval = absl::Milliseconds(500);
  absl::Duration drain_timeout = absl::Seconds(30);
  // After the in-flight calls finish, how long new calls keep getting
  // UNAVAILABLE from the service (so clients learn of the drain) before the
  // listener closes.
  absl::Duration drain_grace = absl::Milliseconds(200);
  SessionLimits sessions;
  ServiceOptions service;
  // The gRPC serving model and its worker pools (server/serving.h).
  ServingOptions serving;
};

// A ServerBuilder option that drops the reflection plugin: linking
// grpc++_reflection registers it for every server built in the process.
std::unique_ptr<grpc::ServerBuilderOption> WithoutReflection();

class Daemon {
 public:
  // Builds the backend, creates the configured pools and starts serving.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(
      const DaemonOptions& options);

  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;
  ~Daemon();  // Shutdown()

  // What clients dial: "unix:/path" or "host:port" (with the bound port).
  const std::string& target() const { return target_; }
  // "host:port" of /metrics with the bound port, or "" when off.
  std::string metrics_address() const {
    return metrics_server_ != nullptr ? metrics_server_->address() : "";
  }

  // The companion socket path, or "" (TCP).
  const std::string& companion_path() const { return companion_path_; }

  // Graceful drain, idempotent: health NOT_SERVING and new calls get
  // UNAVAILABLE; in-flight calls finish (cancelled after drain_timeout);
  // after drain_grace the listener closes, then sessions and pools are
  // released (shm unlinked) and the socket file removed.
  void Shutdown();

 private:
  explicit Daemon(const DaemonOptions& options);
  absl::Status Init();
  absl::Status ApplyConfig();
  // The CPU backend's memory budget (options or the system); null for
  // device memory.
  absl::StatusOr<std::unique_ptr<MemoryBudget>> MakeMemoryBudget(
      const Backend& backend) const;
  // Raises the soft RLIMIT_NOFILE and sizes descriptors_.
  absl::Status MakeDescriptorBudget();
  void ReapLoop();
  // The private directory of the TLS listener's socket, and its removal.
  absl::Status MakeTlsSocketDir();
  void RemoveTlsSocketDir();

  const DaemonOptions options_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<MemoryBudget> memory_budget_;  // null: not budgeted
  // Outlives the server and the serving layer, whose calls hold it.
  std::unique_ptr<MemoryBudget> reply_budget_;
  std::shared_ptr<DescriptorBudget> descriptors_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<PoolRegistry> pools_;
  std::unique_ptr<SessionManager> sessions_;
  std::unique_ptr<KVCacheService> service_;
  std::unique_ptr<TcpSessionService> tcp_sessions_;  // outlives server_
  std::unique_ptr<Serving> serving_;
  std::unique_ptr<step::StepServer> step_;  // the step path (SPEC §10)
  std::unique_ptr<grpc::Server> server_;
  // The Unix socket's acceptor (null: TCP); after server_, so it stops
  // before the server goes.
  std::unique_ptr<GrpcListener> grpc_listener_;
  // Mutual TLS over TCP: the relay to gRPC's TLS listener, its Unix socket
  // and that socket's private directory ("" otherwise).
  std::unique_ptr<SocketRelay> tls_relay_;
  std::string tls_dir_;
  std::string tls_socket_path_;
  std::unique_ptr<MetricsServer> metrics_server_;
  std::unique_ptr<CompanionServer> companion_;
  std::string companion_path_;  // "" for TCP
  std::string target_;
  std::string socket_path_;  // "" for TCP

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_DAEMON_H_
