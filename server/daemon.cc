#include "server/daemon.h"

#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/default_address.h"
#include "common/status_macros.h"
#include "server/backend/factory.h"
#include "server/grpc_listener.h"
#include "server/instrumented_backend.h"
#include "server/limits.h"
#include "server/log_limiter.h"
#include "server/reply_scope.h"
#include "server/tls.h"
#include "spdlog/spdlog.h"

namespace kvdepot {
namespace {

// OK when nothing listens on `path` (a stale file is removed);
// FAILED_PRECONDITION when a live daemon answers there.
absl::Status ClaimSocketPath(const std::string& path, int type) {
  struct sockaddr_un addr;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--listen: socket path \"", path, "\" is longer than ",
                     sizeof(addr.sun_path) - 1, " bytes"));
  }
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return absl::OkStatus();
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--listen: \"", path, "\" exists and is not a socket"));
  }
  const int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("socket(AF_UNIX) failed");
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int rc =
      connect(fd, reinterpret_cast<struct sockaddr*>(&addr), sizeof(addr));
  close(fd);
  if (rc == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--listen: another daemon is serving on \"", path, "\""));
  }
  spdlog::warn("removing stale socket {}", path);
  unlink(path.c_str());
  return absl::OkStatus();
}

// The default socket's directory is the daemon's own (SPEC §11): created
// with mode 0700 (0750 with `group`, for a shared volume), or, when it
// exists, accepted only as a real directory of this user that others cannot
// enter or write. Clients refuse a socket in a directory others can write,
// so serving from one would only fail later.
absl::Status PreparePrivateSocketDir(const std::string& dir, gid_t group) {
  const bool grouped = group != static_cast<gid_t>(-1);
  const mode_t want = grouped ? 0750 : 0700;
  if (mkdir(dir.c_str(), want) == 0) {
    if (grouped &&
        (chown(dir.c_str(), -1, group) != 0 || chmod(dir.c_str(), want) != 0)) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot give the socket directory \"", dir, "\" group ",
                       group, ": ", std::strerror(errno)));
    }
  } else if (errno != EEXIST) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create the socket directory \"", dir,
                     "\": ", std::strerror(errno)));
  }
  struct stat st;
  if (lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("the socket directory \"", dir, "\" is not a directory"));
  }
  const bool group_ok = grouped ? st.st_gid == group : true;
  if (st.st_uid != geteuid() || (st.st_mode & 07777) != want || !group_ok) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the socket directory \"%s\" has owner %d, group %d and mode %04o; "
        "it must belong to uid %d with mode %04o%s (remove it, or pass "
        "--listen)",
        dir, st.st_uid, st.st_gid, st.st_mode & 07777, geteuid(), want,
        grouped ? absl::StrCat(" and group ", group) : ""));
  }
  return absl::OkStatus();
}

// Collects the textproto parser's first error as "line L column C: reason"
// (1-based, as editors count).
class FirstError : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    if (error_.empty()) {
      error_ = absl::StrCat("line ", line + 1, " column ", column + 1, ": ",
                            message);
    }
  }
  const std::string& error() const { return error_; }

 private:
  std::string error_;
};

}  // namespace

Daemon::Daemon(const DaemonOptions& options) : options_(options) {}

namespace {

class WithoutReflectionOption final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>*
                         plugins) override {
    plugins->erase(
        std::remove_if(plugins->begin(), plugins->end(),
                       [](const std::unique_ptr<grpc::ServerBuilderPlugin>& p) {
                         return p->name() == "proto_server_reflection";
                       }),
        plugins->end());
  }
};

}  // namespace

std::unique_ptr<grpc::ServerBuilderOption> WithoutReflection() {
  return std::make_unique<WithoutReflectionOption>();
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(
    const DaemonOptions& options) {
  std::unique_ptr<Daemon> daemon(new Daemon(options));
  RETURN_IF_ERROR(daemon->Init());
  return daemon;
}

absl::Status Daemon::ApplyConfig() {
  if (options_.config_path.empty()) return absl::OkStatus();
  std::ifstream in(options_.config_path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("--config: cannot read \"",
                                            options_.config_path,
                                            "\": ", std::strerror(errno)));
  }
  std::stringstream text;
  text << in.rdbuf();
  v1::DaemonConfig config;
  google::protobuf::TextFormat::Parser parser;
  FirstError error;
  parser.RecordErrorsTo(&error);
  if (!parser.ParseFromString(text.str(), &config)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--config: \"", options_.config_path,
                     "\" is not a valid textproto kvdepot.v1.DaemonConfig: ",
                     error.error()));
  }
  AdminPolicy admin;
  admin.daemon_uid = geteuid();
  admin.uids.insert(config.admin_uids().begin(), config.admin_uids().end());
  admin.gids.insert(config.admin_gids().begin(), config.admin_gids().end());
  for (int i = 0; i < config.admin_tls_subjects_size(); ++i) {
    RETURN_IF_ERROR(
        CheckTlsSubject(absl::StrCat("--config admin_tls_subjects[", i, "]"),
                        config.admin_tls_subjects(i)));
    admin.tls_subjects.insert(config.admin_tls_subjects(i));
  }
  if (options_.admin_gid != static_cast<gid_t>(-1)) {
    admin.gids.insert(options_.admin_gid);
  }
  sessions_->set_admin_policy(std::move(admin));
  for (int i = 0; i < config.pools_size(); ++i) {
    absl::StatusOr<std::shared_ptr<Pool>> pool =
        pools_->Create(config.pools(i), geteuid());
    if (!pool.ok()) {
      return absl::Status(
          pool.status().code(),
          absl::StrCat("--config pools[", i, "]: ", pool.status().message()));
    }
    spdlog::info("rpc=config pool={} status=OK bytes={}", (*pool)->name,
                 (*pool)->layout.total_bytes);
  }
  for (int i = 0; i < config.grants_size(); ++i) {
    const v1::PoolGrant& g = config.grants(i);
    absl::StatusOr<std::shared_ptr<Pool>> pool =
        pools_->Get(absl::StrCat("--config grants[", i, "].pool"), g.pool());
    if (!pool.ok()) return pool.status();
    Acl acl;
    acl.uids.insert(g.uids().begin(), g.uids().end());
    acl.gids.insert(g.gids().begin(), g.gids().end());
    acl.anonymous = g.anonymous();
    for (int j = 0; j < g.tls_subjects_size(); ++j) {
      RETURN_IF_ERROR(CheckTlsSubject(
          absl::StrCat("--config grants[", i, "].tls_subjects[", j, "]"),
          g.tls_subjects(j)));
      acl.tls_subjects.insert(g.tls_subjects(j));
    }
    if (absl::Status s = (*pool)->Grant(acl); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--config grants[", i, "]: ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MemoryBudget>> Daemon::MakeMemoryBudget(
    const Backend& backend) const {
  if (backend.name() != "cpu") {
    // Device memory: the host's budget says nothing about it (the CUDA
    // backend's pools fail at cudaMalloc/cuMemCreate when the device is
    // full, which is an error, not a SIGBUS).
    spdlog::info("memory budget: none for the {} backend's device memory",
                 std::string(backend.name()));
    return nullptr;
  }
  int64_t total = options_.memory_budget_bytes;
  std::string source = "--memory_budget_bytes";
  if (total <= 0) {
    absl::StatusOr<AvailableMemory> available =
        ReadAvailableMemory(options_.memory_files);
    if (!available.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot tell how much memory the daemon may use (",
          available.status().message(), "); pass --memory_budget_bytes"));
    }
    total = available->bytes;
    source = available->source;
  }
  spdlog::info("memory budget: {} ({} bytes) from {}; per client {}",
               HumanBytes(total), total, source,
               options_.memory_budget_per_client_bytes > 0
                   ? HumanBytes(options_.memory_budget_per_client_bytes)
                   : std::string("unlimited"));
  return std::make_unique<MemoryBudget>(
      total, options_.memory_budget_per_client_bytes, source);
}

absl::Status Daemon::MakeDescriptorBudget() {
  ASSIGN_OR_RETURN(DescriptorLimit limit, RaiseDescriptorLimit());
  if (limit.soft != limit.soft_before) {
    spdlog::info("descriptors: RLIMIT_NOFILE soft limit raised from {} to {}",
                 limit.soft_before, limit.soft);
  } else if (limit.soft < limit.hard) {
    spdlog::warn(
        "descriptors: could not raise RLIMIT_NOFILE's soft limit {} to the "
        "hard limit {}",
        limit.soft, limit.hard);
  }
  const int64_t budget = options_.max_descriptors > 0
                             ? options_.max_descriptors
                             : DefaultDescriptorBudget(limit.soft);
  if (budget <= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "RLIMIT_NOFILE is ", limit.soft,
        " descriptors, too few to keep the reserve for connections and "
        "leave any for pools and buffers; raise it (ulimit -n) or pass "
        "--max_descriptors"));
  }
  if (budget >= limit.soft) {
    spdlog::warn(
        "descriptors: --max_descriptors = {} is not below RLIMIT_NOFILE ({}): "
        "clients can use up the daemon's descriptors (gRPC's TLS listener "
        "behind the TCP port then stops accepting for good)",
        budget, limit.soft);
  }
  spdlog::info(
      "descriptors: the CPU backend's pools and buffers may hold {} of the "
      "{} the daemon may open ({}); the rest is kept for connections",
      budget, limit.soft,
      options_.max_descriptors > 0 ? "--max_descriptors" : "default");
  descriptors_ = DescriptorBudget::Create(budget);
  return absl::OkStatus();
}

absl::Status Daemon::Init() {
  RETURN_IF_ERROR(MakeDescriptorBudget());
  BackendOptions backend_options;
  backend_options.descriptors = descriptors_;
  backend_options.legacy_cuda_ipc = options_.legacy_cuda_ipc;
  backend_options.cuda_wait_timeout = options_.cuda_wait_timeout;
  backend_options.cuda_memory_reserve_bytes =
      options_.cuda_memory_reserve_bytes;
  backend_options.cuda_blocking_sync = options_.cuda_blocking_sync;
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      MakeBackend(options_.backend, backend_options);
  if (!backend.ok()) return backend.status();
  metrics_ = std::make_unique<ServerMetrics>(KVCacheService::RpcNames());
  ASSIGN_OR_RETURN(memory_budget_, MakeMemoryBudget(**backend));
  backend_ = std::make_unique<InstrumentedBackend>(*std::move(backend),
                                                   metrics_.get());
  pools_ = std::make_unique<PoolRegistry>(
      backend_.get(), options_.max_pool_bytes, memory_budget_.get());
  pools_->set_max_pools(options_.max_pools);
  sessions_ = std::make_unique<SessionManager>(options_.sessions);
  // The mutual-TLS TCP port's relay (server/socket_relay.h) comes before the
  // service, whose Stats report its connections; it connects to gRPC's
  // listener only once the port accepts.
  if (options_.tls.any() &&
      UnixSocketPathOf(ResolveTarget(options_.listen)).empty()) {
    RETURN_IF_ERROR(MakeTlsSocketDir());
    ASSIGN_OR_RETURN(tls_relay_, SocketRelay::Start(tls_socket_path_));
  }
  ServiceOptions service_options = options_.service;
  service_options.tls_relay = tls_relay_.get();
  service_options.metrics = metrics_.get();
  service_options.memory_budget = memory_budget_.get();
  service_options.descriptors = descriptors_.get();
  service_ = std::make_unique<KVCacheService>(backend_.get(), pools_.get(),
                                              sessions_.get(), service_options);
  {
    KVCacheService* service = service_.get();
    tcp_sessions_ = std::make_unique<TcpSessionService>(
        sessions_.get(), [service] { return !service->draining(); },
        metrics_.get());
  }
  service_->set_drain_hook([this] {
    if (server_ != nullptr) {
      server_->GetHealthCheckService()->SetServingStatus(false);
    }
  });
  {
    AdminPolicy admin;  // ApplyConfig adds the configured ids
    admin.daemon_uid = geteuid();
    if (options_.admin_gid != static_cast<gid_t>(-1)) {
      admin.gids.insert(options_.admin_gid);
    }
    sessions_->set_admin_policy(std::move(admin));
  }
  RETURN_IF_ERROR(ApplyConfig());
  // Replies of both services (KVCache inline data, Step's PlanStep) are
  // admitted against one budget.
  if (options_.max_reply_bytes <= 0 ||
      options_.max_reply_bytes_per_client < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_reply_bytes = ", options_.max_reply_bytes,
                     " must be > 0 and max_reply_bytes_per_client = ",
                     options_.max_reply_bytes_per_client, " >= 0"));
  }
  reply_budget_ = std::make_unique<MemoryBudget>(
      options_.max_reply_bytes, options_.max_reply_bytes_per_client,
      "--max_reply_bytes", ReplyBudgetNames());
  spdlog::info(
      "replies waiting to be sent: at most {} ({} per client); requests "
      "still arriving: gRPC's quota {}",
      HumanBytes(options_.max_reply_bytes),
      options_.max_reply_bytes_per_client > 0
          ? HumanBytes(options_.max_reply_bytes_per_client)
          : std::string("no cap"),
      HumanBytes(options_.grpc_memory_bytes));
  {
    step::StepServerOptions so;
    so.graphs = options_.step_graphs;
    so.pdl = options_.step_pdl;
    so.timing_every = options_.step_timing_every;
    so.service.max_streams = options_.max_step_streams;
    so.service.max_streams_per_session = options_.max_step_streams_per_session;
    so.service.replies = reply_budget_.get();
    so.worker_threads = options_.serving.worker_threads;
    so.max_queued_calls = options_.serving.max_queued_calls;
    ASSIGN_OR_RETURN(step_, step::MakeStepServer(*backend_, pools_.get(),
                                                 sessions_.get(), so));
  }
  if (!options_.metrics_address.empty()) {
    KVCacheService* service = service_.get();
    const step::StepServer* steps = step_.get();
    absl::StatusOr<std::unique_ptr<MetricsServer>> m = MetricsServer::Start(
        options_.metrics_address,
        [service, steps] {
          v1::StatsResponse stats;
          service->FillStats(&stats);
          return RenderPrometheus(stats) + steps->RenderPrometheus();
        },
        [service] { return !service->draining(); });
    if (!m.ok()) return m.status();
    metrics_server_ = *std::move(m);
    spdlog::info("kvdepot metrics on http://{}/metrics",
                 metrics_server_->address());
  }

  target_ = ResolveTarget(options_.listen);
  socket_path_ = UnixSocketPathOf(target_);
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                   ServerCredentialsFor(target_, options_.tls));
  if (!socket_path_.empty()) {
    // The default socket's directory, and the directory of any socket
    // path that does not exist yet (e.g. a subdirectory of a volume shared
    // with workers, which Kubernetes creates 0777), are made private here.
    // An existing directory named by --listen is the operator's choice.
    const std::string dir =
        socket_path_.substr(0, std::max<size_t>(socket_path_.rfind('/'), 1));
    struct stat dir_st;
    if (socket_path_ == DefaultSocketPath() ||
        (lstat(dir.c_str(), &dir_st) != 0 && errno == ENOENT)) {
      RETURN_IF_ERROR(PreparePrivateSocketDir(dir, options_.socket_group));
    }
    RETURN_IF_ERROR(ClaimSocketPath(socket_path_, SOCK_STREAM));
    companion_path_ = CompanionSocketPathOf(socket_path_);
    RETURN_IF_ERROR(ClaimSocketPath(companion_path_, SOCK_SEQPACKET));
    // Before the gRPC socket: a client that sees that one finds this ready.
    CompanionOptions co;
    co.path = companion_path_;
    co.group = options_.socket_group;
    co.max_buffer_bytes = options_.service.max_buffer_bytes;
    co.budget = memory_budget_.get();
    co.max_descriptors_per_connection = options_.max_descriptors_per_connection;
    co.max_connections_per_uid = options_.max_companion_connections_per_uid;
    co.hello_timeout = options_.companion_hello_timeout;
    co.metrics = metrics_.get();
    KVCacheService* service = service_.get();
    co.accepting = [service] { return !service->draining(); };
    co.step_rings = step_->rings();
    absl::StatusOr<std::unique_ptr<CompanionServer>> companion =
        CompanionServer::Start(co, backend_.get(), pools_.get(),
                               sessions_.get());
    if (!companion.ok()) return companion.status();
    companion_ = *std::move(companion);
  }
  // The health service is a callback service in this gRPC (1.51).
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  if (!options_.grpc_reflection) builder.SetOption(WithoutReflection());
  // Every listener is the daemon's own (server/grpc_listener.h says why):
  // the Unix socket and plain loopback TCP hand their connections to gRPC;
  // a mutual-TLS TCP port relays them, bytes unchanged, to gRPC's TLS
  // listener on a Unix socket in a private directory
  // (server/socket_relay.h).
  const bool tls_tcp = tls_relay_ != nullptr;
  if (tls_tcp) {
    builder.AddListeningPort(absl::StrCat("unix:", tls_socket_path_),
                             credentials);
  }
  // A TCP port is this daemon's alone: no SO_REUSEPORT, so a second daemon
  // on the same port fails to start instead of sharing its connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // A connection that has not finished its handshake (TLS over TCP) within
  // this is closed: anyone who reaches the port could otherwise hold a
  // descriptor per connection for gRPC's default two minutes
  // (server/descriptors.h says why descriptors must never run out).
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             kServerHandshakeTimeoutMs);
  builder.SetMaxReceiveMessageSize(static_cast<int>(
      std::min<int64_t>(options_.max_message_bytes, INT32_MAX)));
  builder.SetMaxSendMessageSize(static_cast<int>(
      std::min<int64_t>(options_.max_message_bytes, INT32_MAX)));
  // Keep a second thread polling while one runs a handler, so the next
  // request does not wait for a poller to be woken (a thread wake-up costs
  // more than the whole request path on small VMs).
  builder.SetSyncServerOption(
      grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, 2);
  // Threads are bounded whatever clients do (e.g. thousands of streams they
  // never read): past the quota a call gets RESOURCE_EXHAUSTED, and the
  // calls already running, and new ones once threads free up, go on.
  grpc::ResourceQuota quota("kvdepotd");
  quota.SetMaxThreads(options_.max_threads);
  // Requests still arriving are bounded by this, all connections together
  // (docs/SPEC.md §11): per call --max_message_bytes and per connection
  // --max_streams_per_connection bound them only per connection.
  quota.Resize(static_cast<size_t>(options_.grpc_memory_bytes));
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             options_.max_streams_per_connection);
  // A Verify holds a scan thread while it runs: one client at its limit
  // must leave at least one for everybody else.
  if (options_.serving.model == "callback" &&
      options_.service.max_verify_streams_per_client > 0 &&
      options_.serving.ops_threads <=
          options_.service.max_verify_streams_per_client) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--ops_threads = ", options_.serving.ops_threads,
        " must exceed --max_verify_streams_per_client = ",
        options_.service.max_verify_streams_per_client,
        ": one client's scans could otherwise hold every scan thread"));
  }
  if (options_.grpc_memory_bytes < options_.max_message_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grpc_memory_bytes = ", options_.grpc_memory_bytes,
        " must be at least max_message_bytes = ", options_.max_message_bytes,
        " (a request that size could never arrive)"));
  }
  if (options_.max_connections_per_uid < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_connections_per_uid = ", options_.max_connections_per_uid,
        " must be >= 0"));
  }
  if (options_.max_companion_connections_per_uid < 0 ||
      options_.companion_hello_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_companion_connections_per_uid = ",
        options_.max_companion_connections_per_uid,
        " must be >= 0 and companion_hello_timeout = ",
        absl::FormatDuration(options_.companion_hello_timeout), " > 0"));
  }
  if (options_.service.scan_chunk_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "service.scan_chunk_bytes = ", options_.service.scan_chunk_bytes,
        " must be > 0"));
  }
  ServingOptions serving = options_.serving;
  serving.replies = reply_budget_.get();
  ASSIGN_OR_RETURN(serving_, MakeServing(service_.get(), serving));
  builder.RegisterService(serving_->service());
  builder.RegisterService(tcp_sessions_.get());
  builder.RegisterService(step_->service());  // the step path (SPEC §10)
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on \"", target_, "\""));
  }
  GrpcListenerOptions lo;
  lo.on_refused = [metrics = metrics_.get()] {
    metrics->RecordLimit(Limit::kConnections);
  };
  lo.max_connections_per_uid = options_.max_connections_per_uid;
  lo.on_refused_per_uid = [metrics = metrics_.get()] {
    metrics->RecordLimit(Limit::kConnectionsPerUid);
  };
  // The listener keeps its own once-a-second refusal line (it may log with
  // the descriptor table full); what it leaves out is counted here.
  lo.on_log_line_dropped = [] {
    CountDroppedClientLog(ClientLog::kRefusedConnection);
  };
  if (!socket_path_.empty()) {
    lo.unix_mode = 0660;
    lo.unix_group = options_.socket_group;
    ASSIGN_OR_RETURN(grpc_listener_,
                     GrpcListener::Start(socket_path_, server_.get(), lo));
  } else {
    const size_t colon = target_.rfind(':');
    int want = -1;
    if (colon == std::string::npos ||
        !absl::SimpleAtoi(absl::string_view(target_).substr(colon + 1),
                          &want)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--listen=", target_, ": not host:port"));
    }
    if (tls_tcp) {
      lo.hand_off = [relay = tls_relay_.get()](int fd) { relay->Add(fd); };
    }
    ASSIGN_OR_RETURN(grpc_listener_,
                     GrpcListener::StartTcp(std::string(HostOf(target_)), want,
                                            server_.get(), lo));
    target_ =
        absl::StrCat(target_.substr(0, colon), ":", grpc_listener_->port());
  }
  // grpc.health.v1 answers for "" (the whole server) and for the service's
  // own name; SetServingStatus(bool) below and on drain covers both.
  server_->GetHealthCheckService()->SetServingStatus(
      v1::KVCache::service_full_name(), true);
  server_->GetHealthCheckService()->SetServingStatus(true);
  reaper_ = std::thread([this] { ReapLoop(); });
  spdlog::info("kvdepot serving on {} companion={} backend={} serving={}",
               target_,
               companion_path_.empty() ? "none (TCP)" : companion_path_,
               std::string(backend_->name()), options_.serving.model);
  return absl::OkStatus();
}

absl::Status Daemon::MakeTlsSocketDir() {
  // $TMPDIR (an absolute path) or /tmp: writable in the manifests' pods,
  // whose root file system is read-only. mkdtemp makes it 0700.
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = absl::StrCat(tmp != nullptr && tmp[0] == '/' ? tmp : "/tmp",
                                 "/kvdepotd-tls-XXXXXX");
  if (mkdtemp(dir.data()) == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create the TLS listener's private directory \"",
                     dir, "\": ", std::strerror(errno)));
  }
  tls_dir_ = dir;
  tls_socket_path_ = absl::StrCat(dir, "/grpc-tls.sock");
  if (tls_socket_path_.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return absl::FailedPreconditionError(
        absl::StrCat("the TLS listener's socket path \"", tls_socket_path_,
                     "\" is too long for a Unix socket (shorten $TMPDIR)"));
  }
  return absl::OkStatus();
}

void Daemon::RemoveTlsSocketDir() {
  if (tls_dir_.empty()) return;
  unlink(tls_socket_path_.c_str());
  rmdir(tls_dir_.c_str());
  tls_dir_.clear();
}

void Daemon::ReapLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.reap_interval);
    if (stopping_) break;
    mu_.Unlock();
    const int64_t n = sessions_->Reap(absl::Now());
    if (n > 0) spdlog::info("rpc=reap status=OK sessions_released={}", n);
    ReportDroppedClientLogLines();
    mu_.Lock();
  }
}

void Daemon::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      mu_.Await(absl::Condition(&stopped_));
      return;
    }
    stopping_ = true;
  }
  // A start that failed part-way only releases what it made: nothing was
  // served, so there is nothing to drain and no "stopped" to report.
  const bool served = reaper_.joinable();
  if (served) spdlog::info("kvdepot draining");
  if (service_ != nullptr) service_->StartDraining();
  // TCP session streams end now (UNAVAILABLE): open, they would hold the
  // server's shutdown until its deadline.
  if (tcp_sessions_ != nullptr) tcp_sessions_->EndAll();
  // So do step streams (an idle one would hold the shutdown the same way).
  if (step_ != nullptr) step_->EndStreams();
  if (server_ != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(false);
    const absl::Time deadline = absl::Now() + options_.drain_timeout;
    while (service_->in_flight() > 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    absl::SleepFor(std::min(options_.drain_grace, deadline - absl::Now()));
    // No connection may be handed to the server once it shuts down.
    if (grpc_listener_ != nullptr) grpc_listener_->Stop();
    server_->Shutdown(absl::ToChronoTime(deadline));
    server_->Wait();
  }
  // After the server: its last frames (GOAWAY) still pass.
  if (tls_relay_ != nullptr) tls_relay_->Stop();
  RemoveTlsSocketDir();
  if (serving_ != nullptr) serving_->Shutdown();
  if (step_ != nullptr) step_->Shutdown();
  if (reaper_.joinable()) reaper_.join();
  if (companion_ != nullptr) companion_->Shutdown();
  metrics_server_.reset();
  if (sessions_ != nullptr) sessions_->Clear();
  if (pools_ != nullptr) pools_->Clear();
  if (!socket_path_.empty() && server_ != nullptr) unlink(socket_path_.c_str());
  if (served) {
    ReportDroppedClientLogLines(absl::ZeroDuration());  // every drop told
    spdlog::info("kvdepot stopped");
  }
  absl::MutexLock lock(&mu_);
  stopped_ = true;
}

Daemon::~Daemon() { Shutdown(); }

}  // namespace kvdepot
