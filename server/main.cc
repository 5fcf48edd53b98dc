// kvdepotd: parses flags, sets up logging, starts the daemon library and
// drains it on SIGTERM or SIGINT (exit 0). Exit 2 for a bad flag, value or
// config file; 1 when it cannot start otherwise (e.g. the address is taken).
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/malloc_tuning.h"
#include "server/backend/cuda_env.h"
#include "server/command_line.h"
#include "server/daemon.h"
#include "server/log_limiter.h"
#include "server/logging.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(
    std::string, listen, "",
    "Listen address: empty = Unix socket "
    "$XDG_RUNTIME_DIR/kvdepot/kvdepotd.sock "
    "or /tmp/kvdepot-$UID/kvdepotd.sock; /path or unix:/path = that socket; "
    "host:port = TCP (opt-in; beyond loopback only with mutual TLS).");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain for TCP with mutual TLS (required, with "
          "--tls_key and --tls_client_ca, to listen beyond loopback).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM roots that client certificates must chain to.");
ABSL_FLAG(int64_t, tls_refresh_s, 60,
          "How often the TLS files are re-read (rotation without restart).");
ABSL_FLAG(std::string, backend, "auto",
          "auto (CUDA when a GPU is visible, else CPU), cpu or cuda.");
ABSL_FLAG(std::string, config, "",
          "Optional textproto kvdepot.v1.DaemonConfig (pools to create).");
ABSL_FLAG(std::string, metrics_address, "",
          "host:port serving Prometheus metrics at /metrics over HTTP "
          "(e.g. 0.0.0.0:9400); empty = off.");
ABSL_FLAG(std::string, log_level, "info",
          "trace, debug (one line per data RPC), info, warn, error or off.");
ABSL_FLAG(std::string, log_format, "text",
          "Logs on stderr as text lines or json (one object per line); "
          "timestamps are ISO 8601 with the zone offset.");
ABSL_FLAG(bool, shm_group_access, false,
          "No effect (kept so old command lines start): memory is handed "
          "over as memfds on the companion socket, never named.");
ABSL_FLAG(int64_t, socket_group, -1,
          "Group id of the sockets (mode 0660) and of the default socket "
          "directory (then 0750, for a volume shared with workers); -1 = "
          "the daemon's own, directory 0700.");
ABSL_FLAG(int64_t, admin_gid, -1,
          "Group id whose members are admins (DeletePool of any pool, "
          "Drain) besides the daemon's uid and root; -1 = none.");
ABSL_FLAG(bool, legacy_cuda_ipc, false,
          "CUDA backend: share pools and buffers by legacy CUDA IPC handles "
          "(bearer tokens anyone who sees them can open; SPEC §11) and "
          "accept clients' IPC handles. Without it pools and buffers are "
          "VMM allocations handed over as descriptors on the companion "
          "socket, and handles are refused.");
ABSL_FLAG(int64_t, cuda_wait_timeout_ms, 10000,
          "CUDA backend: how long a request waits (on the host) for the "
          "client's wait event before it fails with DEADLINE_EXCEEDED; only "
          "that request fails.");
ABSL_FLAG(int64_t, cuda_memory_reserve_bytes, int64_t{1} << 30,
          "CUDA backend: device memory left to others; pools and buffers "
          "may take what was free at start minus this (RESOURCE_EXHAUSTED "
          "beyond). -1 = no device budget.");
ABSL_FLAG(bool, step_graphs, true,
          "CUDA backend, step path: launch each step as one CUDA graph "
          "(captured, and updated in place while the batch shape stays the "
          "same) instead of ~12 stream operations per layer, which spin in "
          "the driver once the work stream's launch queue is full.");
ABSL_FLAG(bool, step_pdl, true,
          "CUDA backend, step path: launch a phase's kernels after its first "
          "with Programmatic Dependent Launch (each launched while the "
          "previous one drains, waiting for it on the GPU).");
ABSL_FLAG(int32_t, step_timing_every, 16,
          "CUDA backend, step path: every Nth step stamps each phase with "
          "the GPU timer (flag passed to the phase's kernels done) for the "
          "kvdepot_step_phase_us histograms and StepStatus' handoff_p50_us; "
          "0 = never. Timed steps have their own CUDA graph.");
ABSL_FLAG(int, max_step_streams, 64,
          "Step path: StepStream calls and step rings open at once in the "
          "daemon, all sessions together; one more is refused at once with "
          "RESOURCE_EXHAUSTED.");
ABSL_FLAG(int, max_step_streams_per_session, 4,
          "Step path: StepStream calls and step rings one session may have "
          "open at once; one more is refused at once with "
          "RESOURCE_EXHAUSTED.");
ABSL_FLAG(bool, cuda_blocking_sync, true,
          "CUDA backend: host threads waiting for the GPU sleep "
          "(cudaDeviceScheduleBlockingSync) instead of spinning a core.");
ABSL_FLAG(int32_t, malloc_keep_freed_mb, 64,
          "Freed memory each glibc malloc arena keeps for reuse, in MiB "
          "(1-2047), instead of returning it to the kernel after every "
          "request (common/malloc_tuning.h says why); 0 = glibc's "
          "defaults.");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{64} << 20,
          "Largest gRPC message received or sent.");
ABSL_FLAG(bool, grpc_reflection, true,
          "Serve gRPC server reflection (grpcurl list/describe).");
ABSL_FLAG(int, max_threads, 64,
          "gRPC threads in all; calls beyond them get RESOURCE_EXHAUSTED.");
ABSL_FLAG(int, max_streams_per_connection, 32,
          "Calls in flight on one client connection.");
ABSL_FLAG(int64_t, max_pool_bytes, int64_t{1} << 40, "Largest pool.");
ABSL_FLAG(int64_t, max_pools, 1024, "Pools at once, all clients together.");
ABSL_FLAG(int64_t, max_descriptors_per_connection, 256,
          "Descriptors the daemon holds for one companion connection (one "
          "per buffer of its session, allocated or imported).");
ABSL_FLAG(int, max_companion_connections_per_uid, 64,
          "Companion connections one peer uid may hold (of the daemon's 256); "
          "0 = no per-uid cap.");
ABSL_FLAG(int, max_connections_per_uid, 256,
          "gRPC connections one peer uid may hold on the Unix socket at "
          "once, and TCP clients (plain loopback or mutual TLS) together; "
          "the next is closed at once. 0 = no cap.");
ABSL_FLAG(int64_t, client_log_lines_per_second,
          kvdepot::kDefaultClientLogLinesPerSecond,
          "Log lines clients may cause per second, for each kind (failed "
          "calls; sessions and other client events; refused connections; "
          "gRPC's own lines, such as a failed TLS handshake), "
          "one client (uid or TLS subject; all unauthenticated callers "
          "together) at most half of them, bursts of one second's worth; "
          "the rest are dropped and counted "
          "(kvdepot_log_lines_dropped_total). 0 = no limit.");
ABSL_FLAG(int, companion_hello_timeout_ms, 10000,
          "How long a new companion connection may take to send its Hello "
          "before it is closed (> 0).");
ABSL_FLAG(int64_t, max_descriptors, 0,
          "Descriptors the CPU backend's pools and buffers (allocated or "
          "imported) may hold together; 0 = the soft RLIMIT_NOFILE, raised "
          "to the hard limit at start, less a quarter of it (at least 512, "
          "at most 8192) kept for connections.");
ABSL_FLAG(int64_t, max_verify_streams_per_client, 2,
          "Verify streams one client (uid, TLS subject, anonymous session) "
          "may run at once.");
ABSL_FLAG(int64_t, max_buffer_bytes, int64_t{16} << 30,
          "Largest AllocateBuffer.");
ABSL_FLAG(int64_t, memory_budget_bytes, 0,
          "Bytes all pools and buffers (own and imported) may hold on the CPU "
          "backend; 0 = what is available at start: cgroup v2 memory.max - "
          "memory.current, v1 limit - usage, else MemAvailable.");
ABSL_FLAG(int64_t, memory_budget_per_client_bytes, 0,
          "Bytes one client (a uid; an anonymous session) may hold of the "
          "memory budget; 0 = no per-client cap.");
ABSL_FLAG(int64_t, max_reply_bytes, int64_t{1} << 30,
          "Bytes of inline reply data (rows, cast-back and index outputs "
          "returned in replies) the daemon may hold until they are sent, all "
          "calls together; a call beyond it gets RESOURCE_EXHAUSTED. Must be "
          "> 0.");
ABSL_FLAG(int64_t, grpc_memory_bytes, int64_t{1} << 30,
          "gRPC's memory quota: bytes its transports may hold of requests "
          "still arriving, all connections together (past it gRPC grants no "
          "more flow-control window until memory is freed). At least "
          "--max_message_bytes.");
ABSL_FLAG(int64_t, max_reply_bytes_per_client, int64_t{256} << 20,
          "The same for one client (a uid, a TLS subject, an anonymous "
          "session); 0 = no per-client cap.");
ABSL_FLAG(std::string, memory_cgroup_root, "/sys/fs/cgroup",
          "Where the cgroup hierarchy is mounted (read for the memory "
          "budget).");
ABSL_FLAG(std::string, memory_self_cgroup, "/proc/self/cgroup",
          "The daemon's cgroup membership file (read for the memory budget).");
ABSL_FLAG(std::string, memory_meminfo, "/proc/meminfo",
          "The meminfo file (MemAvailable when no cgroup limits).");
ABSL_FLAG(int64_t, lease_ms, 10000, "Default session lease.");
ABSL_FLAG(int64_t, max_lease_ms, 600000, "Longest session lease granted.");
ABSL_FLAG(int64_t, reap_interval_ms, 500,
          "How often expired sessions are released.");
ABSL_FLAG(int64_t, drain_grace_ms, 200,
          "On SIGTERM, how long new calls keep getting UNAVAILABLE after the "
          "in-flight ones finished, before the socket closes.");
ABSL_FLAG(int64_t, testonly_verify_block_delay_ms, 0,
          "Tests only: Verify sleeps this long per block.");
ABSL_FLAG(std::string, serving_model, "callback",
          "gRPC serving model: callback (short calls inline on the thread "
          "that read them, long ones on a bounded worker pool) or sync.");
ABSL_FLAG(int, worker_threads, 8,
          "Callback model: threads running offloaded calls (large Store/"
          "Load, PrefillLoad, pool and buffer creation, every call that may "
          "wait for the GPU).");
ABSL_FLAG(int, ops_threads, 8,
          "Callback model: threads running Verify and Inspect scans; must "
          "exceed --max_verify_streams_per_client, so that no one client can "
          "hold every scan thread.");
ABSL_FLAG(int, max_queued_calls, 1024,
          "Callback model: offloaded calls waiting for a worker; beyond it a "
          "call gets RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, inline_max_rows, 1024,
          "Callback model, CPU backend: Store/Load rows up to which a call "
          "runs inline on the gRPC thread.");
ABSL_FLAG(bool, mutex_deadlock_detection, false,
          "Debugging: abseil's lock-order (deadlock) detection on every "
          "absl::Mutex, gRPC's included. The system abseil is built without "
          "NDEBUG, which turns it on: a global graph update on every lock, "
          "about 2 us of each RPC.");
ABSL_FLAG(int64_t, drain_timeout_s, 30,
          "On SIGTERM, how long in-flight calls may run before cancellation.");

namespace {

constexpr char kAbout[] =
    "kvdepotd: the kvdepot KV-cache daemon. It owns paged KV-cache pools\n"
    "(GPU memory, or sealed memfds on the CPU backend), hands them to\n"
    "workers as file descriptors on a companion socket, and serves store,\n"
    "load and index RPCs over gRPC (kvdepot.v1.KVCache) on a Unix socket\n"
    "(or TCP: loopback, or mutual TLS). Operate it with kvcachectl; see\n"
    "docs/DAEMON.md and docs/OPERATING.md.";

int UsageError(absl::string_view message) {
  std::cerr << "kvdepotd: " << message << " (see kvdepotd --help)\n";
  return kvdepot::kExitUsage;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("kvdepotd [--flag=value ...]");
  if (int rc = kvdepot::HandleHelpAndVersion(argc, argv, kAbout,
                                             "server/main.cc", std::cout);
      rc >= 0) {
    return rc;
  }
  if (absl::Status s = kvdepot::CheckFlagSyntax(argc, argv); !s.ok()) {
    return UsageError(s.message());
  }
  absl::ParseCommandLine(argc, argv);
  if (!absl::GetFlag(FLAGS_mutex_deadlock_detection)) {
    // Before any thread starts. A debug aid (off in NDEBUG builds of
    // abseil), not a check of anyone's input; tests keep it on.
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
  for (absl::Status s :
       {kvdepot::InitLogging(absl::GetFlag(FLAGS_log_level),
                             absl::GetFlag(FLAGS_log_format)),
        kvdepot::CheckAddressFlag("listen", absl::GetFlag(FLAGS_listen),
                                  /*unix_allowed=*/true),
        absl::GetFlag(FLAGS_metrics_address).empty()
            ? absl::OkStatus()
            : kvdepot::CheckAddressFlag("metrics_address",
                                        absl::GetFlag(FLAGS_metrics_address),
                                        /*unix_allowed=*/false)}) {
    if (!s.ok()) return UsageError(s.message());
  }
  const int64_t log_rate = absl::GetFlag(FLAGS_client_log_lines_per_second);
  if (log_rate < 0) {
    return UsageError("--client_log_lines_per_second must be >= 0");
  }
  kvdepot::SetClientLogRate(log_rate);
  if (const int32_t mb = absl::GetFlag(FLAGS_malloc_keep_freed_mb); mb != 0) {
    if (mb < 0 || mb > 2047) {
      return UsageError("--malloc_keep_freed_mb must be in [0, 2047]");
    }
    // A missed optimization, not a reason to refuse to start.
    if (absl::Status s = kvdepot::KeepFreedMemory(int64_t{mb} << 20); !s.ok()) {
      spdlog::warn("--malloc_keep_freed_mb={}: {}", mb,
                   std::string(s.message()));
    }
  }

  // Before any CUDA call: the driver reads these when it initializes.
  if (absl::GetFlag(FLAGS_backend) != "cpu") {
    if (absl::Status s = kvdepot::PrepareCudaEnvironment(); !s.ok()) {
      if (absl::GetFlag(FLAGS_backend) == "cuda") {
        spdlog::error("cannot start: --backend=cuda: {}",
                      std::string(s.message()));
        return kvdepot::kExitStartFailed;
      }
      spdlog::warn("{} (the CUDA backend will refuse to start)",
                   std::string(s.message()));
    }
  }

  // Block the drain signals in every thread; this one waits for them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A client vanishing mid-write must not kill the daemon.
  signal(SIGPIPE, SIG_IGN);

  kvdepot::DaemonOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.max_threads = absl::GetFlag(FLAGS_max_threads);
  options.max_streams_per_connection =
      absl::GetFlag(FLAGS_max_streams_per_connection);
  options.max_pools = absl::GetFlag(FLAGS_max_pools);
  options.max_descriptors_per_connection =
      absl::GetFlag(FLAGS_max_descriptors_per_connection);
  options.max_descriptors = absl::GetFlag(FLAGS_max_descriptors);
  options.max_companion_connections_per_uid =
      absl::GetFlag(FLAGS_max_companion_connections_per_uid);
  options.companion_hello_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_companion_hello_timeout_ms));
  if (options.max_companion_connections_per_uid < 0 ||
      options.companion_hello_timeout <= absl::ZeroDuration()) {
    return UsageError(
        "--max_companion_connections_per_uid must be >= 0 and "
        "--companion_hello_timeout_ms > 0");
  }
  options.max_connections_per_uid =
      absl::GetFlag(FLAGS_max_connections_per_uid);
  if (options.max_connections_per_uid < 0) {
    return UsageError("--max_connections_per_uid must be >= 0");
  }
  options.service.max_verify_streams_per_client =
      absl::GetFlag(FLAGS_max_verify_streams_per_client);
  options.tls.cert_path = absl::GetFlag(FLAGS_tls_cert);
  options.tls.key_path = absl::GetFlag(FLAGS_tls_key);
  options.tls.client_ca_path = absl::GetFlag(FLAGS_tls_client_ca);
  options.tls.refresh = absl::Seconds(absl::GetFlag(FLAGS_tls_refresh_s));
  options.backend = absl::GetFlag(FLAGS_backend);
  options.config_path = absl::GetFlag(FLAGS_config);
  options.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  options.socket_group = static_cast<gid_t>(absl::GetFlag(FLAGS_socket_group));
  options.admin_gid = static_cast<gid_t>(absl::GetFlag(FLAGS_admin_gid));
  options.legacy_cuda_ipc = absl::GetFlag(FLAGS_legacy_cuda_ipc);
  if (absl::GetFlag(FLAGS_cuda_wait_timeout_ms) <= 0) {
    return UsageError("--cuda_wait_timeout_ms must be > 0");
  }
  options.cuda_wait_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_cuda_wait_timeout_ms));
  options.cuda_memory_reserve_bytes =
      absl::GetFlag(FLAGS_cuda_memory_reserve_bytes);
  options.cuda_blocking_sync = absl::GetFlag(FLAGS_cuda_blocking_sync);
  options.step_graphs = absl::GetFlag(FLAGS_step_graphs);
  options.step_pdl = absl::GetFlag(FLAGS_step_pdl);
  if (absl::GetFlag(FLAGS_step_timing_every) < 0) {
    return UsageError("--step_timing_every must be >= 0 (0 = never)");
  }
  options.step_timing_every = absl::GetFlag(FLAGS_step_timing_every);
  options.max_step_streams = absl::GetFlag(FLAGS_max_step_streams);
  options.max_step_streams_per_session =
      absl::GetFlag(FLAGS_max_step_streams_per_session);
  if (options.max_step_streams < 1 ||
      options.max_step_streams_per_session < 1) {
    return UsageError(
        "--max_step_streams and --max_step_streams_per_session must be >= 1");
  }
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.grpc_reflection = absl::GetFlag(FLAGS_grpc_reflection);
  options.max_pool_bytes = absl::GetFlag(FLAGS_max_pool_bytes);
  options.memory_budget_bytes = absl::GetFlag(FLAGS_memory_budget_bytes);
  options.memory_budget_per_client_bytes =
      absl::GetFlag(FLAGS_memory_budget_per_client_bytes);
  options.memory_files.cgroup_root = absl::GetFlag(FLAGS_memory_cgroup_root);
  options.memory_files.self_cgroup = absl::GetFlag(FLAGS_memory_self_cgroup);
  options.memory_files.meminfo = absl::GetFlag(FLAGS_memory_meminfo);
  if (options.memory_budget_bytes < 0 ||
      options.memory_budget_per_client_bytes < 0) {
    return UsageError(
        "--memory_budget_bytes and --memory_budget_per_client_bytes must be "
        ">= 0");
  }
  options.max_reply_bytes = absl::GetFlag(FLAGS_max_reply_bytes);
  options.max_reply_bytes_per_client =
      absl::GetFlag(FLAGS_max_reply_bytes_per_client);
  options.grpc_memory_bytes = absl::GetFlag(FLAGS_grpc_memory_bytes);
  if (options.grpc_memory_bytes < options.max_message_bytes) {
    return UsageError(
        "--grpc_memory_bytes must be at least --max_message_bytes (a request "
        "that size could never arrive)");
  }
  if (options.max_reply_bytes <= 0 || options.max_reply_bytes_per_client < 0) {
    return UsageError(
        "--max_reply_bytes must be > 0 and --max_reply_bytes_per_client >= 0 "
        "(0 = no per-client cap)");
  }
  if (options.max_descriptors < 0) {
    return UsageError(
        "--max_descriptors must be >= 0 (0 = from RLIMIT_NOFILE)");
  }
  options.service.max_buffer_bytes = absl::GetFlag(FLAGS_max_buffer_bytes);
  options.service.max_inline_bytes = options.max_message_bytes;
  options.sessions.default_lease =
      absl::Milliseconds(absl::GetFlag(FLAGS_lease_ms));
  options.sessions.max_lease =
      absl::Milliseconds(absl::GetFlag(FLAGS_max_lease_ms));
  options.sessions.max_buffer_bytes = options.service.max_buffer_bytes;
  options.reap_interval =
      absl::Milliseconds(absl::GetFlag(FLAGS_reap_interval_ms));
  options.drain_timeout = absl::Seconds(absl::GetFlag(FLAGS_drain_timeout_s));
  options.service.verify_block_delay =
      absl::Milliseconds(absl::GetFlag(FLAGS_testonly_verify_block_delay_ms));
  options.drain_grace = absl::Milliseconds(absl::GetFlag(FLAGS_drain_grace_ms));
  options.serving.model = absl::GetFlag(FLAGS_serving_model);
  options.serving.worker_threads = absl::GetFlag(FLAGS_worker_threads);
  options.serving.ops_threads = absl::GetFlag(FLAGS_ops_threads);
  options.serving.max_queued_calls = absl::GetFlag(FLAGS_max_queued_calls);
  options.serving.inline_max_rows = absl::GetFlag(FLAGS_inline_max_rows);
  if (options.sessions.default_lease <= absl::ZeroDuration() ||
      options.reap_interval <= absl::ZeroDuration()) {
    return UsageError("--lease_ms and --reap_interval_ms must be > 0");
  }

  absl::StatusOr<std::unique_ptr<kvdepot::Daemon>> daemon =
      kvdepot::Daemon::Start(options);
  if (!daemon.ok()) {
    spdlog::error("cannot start: {}", std::string(daemon.status().message()));
    // Flag values and the config file are the operator's to fix (exit 2).
    const absl::StatusCode code = daemon.status().code();
    return code == absl::StatusCode::kInvalidArgument ||
                   code == absl::StatusCode::kNotFound
               ? kvdepot::kExitUsage
               : kvdepot::kExitStartFailed;
  }
  int sig = 0;
  sigwait(&signals, &sig);
  spdlog::info("signal {} received", sig);
  (*daemon)->Shutdown();
  return 0;
}
