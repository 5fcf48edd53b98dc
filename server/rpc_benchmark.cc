// RPC latency of a decode step over the Unix socket: Store and Load of 256
// V41 tokens whose data sits in a shared buffer, next to an empty RPC
// (Ping) and the bare kernel work (the CPU reference's Store/LoadSegments
// on the same inputs, called directly), all measured in the same run.
// Prints p50/p99/mean per request kind and the request overhead: p50 of the
// RPC minus p50 of its kernel work, as a ratio to the empty RPC.
//
//   bazel run -c opt //server:rpc_benchmark -- --iterations=2000
//
// By default the daemon runs in this process (its own server threads, a
// temporary socket) with --serving_model (callback or sync) and --backend
// (cpu, or cuda on a GPU host: the K/V then travel inline, staged by the
// daemon, and the kernel time is the daemon's own backend time from
// Stats); --address measures an external kvdepot instead. Ping is also
// measured with a callback-API client and on a channel with gRPC's minimal
// filter stack, to show what the client side costs.
//
// The gRPC floor (--grpc_floor): a bare gRPC server with one empty callback
// unary method (kvdepot's Ping answered inline, nothing else registered)
// measured with the same clients, so the report separates what gRPC itself
// costs from what kvdepot adds; also with one sync service next to it
// (gRPC then runs sync-CQ pollers), which is what the daemon had before.
// --server_process runs the servers in child processes, as a deployed
// daemon is: an in-process client shares gRPC's pollers with the server.
// There the floor is measured once more with its handler busy for as long
// as each kernel's p50: what any call that long costs beyond its work.
// From Stats, it also prints the daemon's handler time per call beyond its
// kernel time, so the overhead splits into handler, gRPC and client.
// The async floors (--floor_async): the same empty Ping on gRPC's async
// API, one thread on one completion queue, sleeping in Next or spinning on
// it with zero deadlines, and spinning with a callback or a sync service
// registered next to it (never called): whether a serving model of our
// own threads could beat the callback floor, and in which process.
// Last, clients that spin on their replies instead of sleeping (an async
// client polling its completion queue with zero timeouts; the socket
// ping-pong reading without blocking), against the daemon and the bare
// floor: how much of a round trip is the client's own wake-up. Then Ping,
// Store and Load once more through the client library polling for its
// replies (--reply_spin_us, ClientOptions.reply_spin), with the Store/Load
// overhead over that Ping.
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/kvdepot_client.h"
#include "kernels/format_host.h"
#include "kernels/quant.h"
#include "kernels/reference/reference.h"
#include "proto/wire.h"
#include "server/backend/cuda_env.h"
#include "server/daemon.h"
#include "spdlog/spdlog.h"
#include "tests/malloc_flag.h"
#include "tests/rpc_timing.h"

ABSL_FLAG(std::string, address, "",
          "Daemon to measure; empty = start one in-process on a temp socket.");
ABSL_FLAG(int, iterations, 2000, "Measured requests per kind.");
ABSL_FLAG(int, warmup, 200, "Unmeasured requests per kind first.");
ABSL_FLAG(int, tokens, 256, "Tokens per Store/Load (a decode step).");
ABSL_FLAG(std::string, json, "", "Also write the results to this JSON file.");
ABSL_FLAG(std::string, serving_model, "callback",
          "In-process daemon: gRPC serving model (callback | sync).");
ABSL_FLAG(bool, grpc_reflection, true,
          "In-process daemon: serve gRPC reflection (a sync service).");
ABSL_FLAG(int64_t, inline_max_rows, 1024,
          "In-process daemon: --inline_max_rows (0 = every Store/Load on a "
          "worker thread).");
ABSL_FLAG(bool, mutex_deadlock_detection, false,
          "Leave absl::Mutex's deadlock detection on (the system abseil is "
          "built without NDEBUG, so it is on unless turned off); kvdepotd "
          "turns it off, as this does by default for all its processes.");
ABSL_FLAG(bool, grpc_floor, true,
          "Also measure a bare gRPC server (one empty callback method) with "
          "the same clients, alone and next to a sync service.");
ABSL_FLAG(bool, floor_bdp_probe, true,
          "Experiment: GRPC_ARG_HTTP2_BDP_PROBE on the floor server and on "
          "every raw client's channel.");
ABSL_FLAG(bool, floor_lean_args, false,
          "Experiment: channelz off on the floor server and the raw "
          "clients, retries off on the raw clients.");
ABSL_FLAG(bool, floor_async, true,
          "Also measure a bare gRPC server on the async API (one thread on "
          "one completion queue): sleeping in Next; spinning on it; spinning "
          "with a callback service next to it; spinning with a sync one.");
ABSL_FLAG(int64_t, reply_spin_us, 10000,
          "Also measure Ping, Store and Load through a client that polls "
          "for its replies this long (ClientOptions.reply_spin); 0 = not.");
ABSL_FLAG(bool, server_process, true,
          "Run the daemon and the gRPC floor in child processes (as deployed) "
          "instead of in this one.");
#ifdef KVDEPOT_RPC_BENCHMARK_CUDA  // //server:rpc_benchmark_cuda
#define KVDEPOT_RPC_BENCHMARK_BACKEND "cuda"
#else
#define KVDEPOT_RPC_BENCHMARK_BACKEND "cpu"
#endif
ABSL_FLAG(std::string, backend, KVDEPOT_RPC_BENCHMARK_BACKEND,
          "In-process daemon: cpu, or cuda (GPU host; K/V sent inline).");

namespace kvdepot {
namespace {

constexpr int64_t kBlockSize = 64;
constexpr int64_t kNumBlocks = 1024;
constexpr int64_t kElements = 512;

// Latency rows and the socket ping-pong floor: tests/rpc_timing.h.
using Result = testing::Timing;
using testing::SocketPingPong;

Result Measure(const std::string& name, int warmup, int iterations,
               const std::function<absl::Status()>& call) {
  return testing::MeasureCalls(name, warmup, iterations, call);
}

// The gRPC floor's one method: kvdepot's Ping message types, answered
// inline with no work at all; or, with the metadata kFloorWorkKey = T,
// after busy-working T us (inline, as the daemon runs the CPU kernels): an
// empty RPC as long as a Store or Load, which separates what a long call
// costs in gRPC (and the OS) from what kvdepot's request adds.
constexpr char kFloorWorkKey[] = "kvdepot-bench-work-us";

// Busy-works as long as the call's kFloorWorkKey asks, if it does.
void WorkAsAsked(const grpc::ServerContextBase& ctx) {
  const auto& md = ctx.client_metadata();
  if (auto it = md.find(kFloorWorkKey); it != md.end()) {
    int64_t us = 0;
    if (absl::SimpleAtoi(
            absl::string_view(it->second.data(), it->second.size()), &us)) {
      const absl::Time end = absl::Now() + absl::Microseconds(us);
      while (absl::Now() < end) {
      }
    }
  }
}

class FloorService final : public v1::KVCache::CallbackService {
  grpc::ServerUnaryReactor* Ping(grpc::CallbackServerContext* ctx,
                                 const v1::PingRequest*,
                                 v1::PingResponse*) override {
    WorkAsAsked(*ctx);
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

// A bare server on `socket`: FloorService and, with `with_sync`, a sync
// service (TcpSessions, never called) whose presence makes gRPC poll sync
// completion queues next to the callback one.
struct FloorServer {
  FloorService service;
  v1::TcpSessions::Service sync_service;
  std::unique_ptr<grpc::Server> server;
};

std::unique_ptr<FloorServer> StartFloor(const std::string& socket,
                                        bool with_sync) {
  auto f = std::make_unique<FloorServer>();
  grpc::ServerBuilder builder;
  // The daemon's library links gRPC reflection, which would join this
  // server as a sync service.
  builder.SetOption(WithoutReflection());
  builder.AddListeningPort("unix:" + socket, grpc::InsecureServerCredentials());
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE,
                             absl::GetFlag(FLAGS_floor_bdp_probe) ? 1 : 0);
  if (absl::GetFlag(FLAGS_floor_lean_args)) {
    builder.AddChannelArgument(GRPC_ARG_ENABLE_CHANNELZ, 0);
  }
  builder.RegisterService(&f->service);
  if (with_sync) builder.RegisterService(&f->sync_service);
  f->server = builder.BuildAndStart();
  if (f->server == nullptr) return nullptr;
  return f;
}

// The floor on gRPC's async API: one thread owns the only completion queue
// and serves Ping on it (request, finish, request again), sleeping in Next
// or, with `spin`, polling it with a zero deadline (a core kept busy). No
// other method is requested: this server answers Ping only.
class AsyncFloorServer {
 public:
  // A service registered next to it and never called: a callback one
  // (gRPC then runs its own polling threads for callbacks) or a sync one
  // (its sync pollers).
  enum class Neighbour { kNone, kCallback, kSync };

  static std::unique_ptr<AsyncFloorServer> Start(const std::string& socket,
                                                 bool spin,
                                                 Neighbour neighbour) {
    auto f = std::unique_ptr<AsyncFloorServer>(new AsyncFloorServer());
    grpc::ServerBuilder builder;
    builder.SetOption(WithoutReflection());
    builder.AddListeningPort("unix:" + socket,
                             grpc::InsecureServerCredentials());
    builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE,
                               absl::GetFlag(FLAGS_floor_bdp_probe) ? 1 : 0);
    builder.RegisterService(&f->service_);
    if (neighbour == Neighbour::kCallback) {
      builder.RegisterService(&f->callback_neighbour_);
    }
    if (neighbour == Neighbour::kSync) {
      builder.RegisterService(&f->sync_neighbour_);
    }
    f->cq_ = builder.AddCompletionQueue();
    f->server_ = builder.BuildAndStart();
    if (f->server_ == nullptr) return nullptr;
    f->thread_ = std::thread([p = f.get(), spin] { p->Serve(spin); });
    return f;
  }

  ~AsyncFloorServer() {
    server_->Shutdown();
    cq_->Shutdown();
    thread_.join();
  }

 private:
  struct Call {
    grpc::ServerContext ctx;
    v1::PingRequest request;
    v1::PingResponse response;
    grpc::ServerAsyncResponseWriter<v1::PingResponse> writer{&ctx};
    bool finishing = false;
  };

  AsyncFloorServer() = default;

  void Request() {
    Call* call = new Call;
    service_.RequestPing(&call->ctx, &call->request, &call->writer, cq_.get(),
                         cq_.get(), call);
  }

  void Serve(bool spin) {
    Request();
    const gpr_timespec now = gpr_time_0(GPR_CLOCK_MONOTONIC);
    for (;;) {
      void* tag = nullptr;
      bool ok = false;
      if (spin) {
        const auto got = cq_->AsyncNext(&tag, &ok, now);
        if (got == grpc::CompletionQueue::TIMEOUT) continue;
        if (got == grpc::CompletionQueue::SHUTDOWN) return;
      } else if (!cq_->Next(&tag, &ok)) {
        return;
      }
      auto* call = static_cast<Call*>(tag);
      if (!ok || call->finishing) {
        delete call;
        continue;
      }
      Request();
      WorkAsAsked(call->ctx);
      call->finishing = true;
      call->writer.Finish(call->response, grpc::Status::OK, call);
    }
  }

  v1::KVCache::AsyncService service_;
  v1::TcpSessions::CallbackService callback_neighbour_;
  v1::TcpSessions::Service sync_neighbour_;
  std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  std::unique_ptr<grpc::Server> server_;
  std::thread thread_;
};

// A server in a child process, forked before this process starts any gRPC
// thread. It serves until the parent closes `release_fd` (or dies).
struct ChildServer {
  pid_t pid = -1;
  int release_fd = -1;
  std::string target;
};

// Write ends of earlier children's release pipes: a later child closes
// them, so each child sees EOF when the parent goes.
std::vector<int>& ParentFds() {
  static std::vector<int> fds;
  return fds;
}

// `serve(ready, wait)` runs in the child: it starts a server, calls
// ready(target), then wait(), then stops it.
using ServeFn = std::function<absl::Status(
    const std::function<void(const std::string&)>& ready,
    const std::function<void()>& wait)>;

absl::StatusOr<ChildServer> ForkServer(const ServeFn& serve) {
  int ready[2], release[2];
  if (pipe2(ready, O_CLOEXEC) != 0 || pipe2(release, O_CLOEXEC) != 0) {
    return absl::InternalError(std::strerror(errno));
  }
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(std::strerror(errno));
  if (pid == 0) {
    for (int fd : ParentFds()) close(fd);
    close(ready[0]);
    close(release[1]);
    absl::Status s = serve(
        [&](const std::string& target) {
          const std::string line = target + "\n";
          (void)!write(ready[1], line.data(), line.size());
          close(ready[1]);
        },
        [&] {
          char c;
          while (read(release[0], &c, 1) > 0) {
          }
        });
    if (!s.ok()) std::fprintf(stderr, "server: %s\n", s.ToString().c_str());
    _exit(s.ok() ? 0 : 1);
  }
  close(ready[1]);
  close(release[0]);
  std::string target;
  char c;
  while (read(ready[0], &c, 1) == 1 && c != '\n') target.push_back(c);
  close(ready[0]);
  if (target.empty()) {
    close(release[1]);
    waitpid(pid, nullptr, 0);
    return absl::UnavailableError("the server process did not start");
  }
  ParentFds().push_back(release[1]);
  return ChildServer{pid, release[1], target};
}

void Release(const ChildServer& c) {
  close(c.release_fd);
  waitpid(c.pid, nullptr, 0);
}

// Ping over `stub` with the sync API, or with the callback API (the
// calling thread waits for the callback).
absl::Status SyncPing(v1::KVCache::Stub* stub, int64_t work_us = -1) {
  grpc::ClientContext ctx;
  if (work_us >= 0) ctx.AddMetadata(kFloorWorkKey, absl::StrCat(work_us));
  v1::PingRequest req;
  v1::PingResponse resp;
  grpc::Status s = stub->Ping(&ctx, req, &resp);
  return s.ok() ? absl::OkStatus() : absl::UnavailableError(s.error_message());
}

absl::Status CallbackPing(v1::KVCache::Stub* stub) {
  grpc::ClientContext ctx;
  v1::PingRequest req;
  v1::PingResponse resp;
  grpc::Status status;
  absl::Notification done;
  stub->async()->Ping(&ctx, &req, &resp, [&](grpc::Status s) {
    status = std::move(s);
    done.Notify();
  });
  done.WaitForNotification();
  return status.ok() ? absl::OkStatus()
                     : absl::UnavailableError(status.error_message());
}

// Ping with the async API, this thread spinning on the completion queue
// (zero-timeout AsyncNext) instead of sleeping until the reply: the reply
// never waits for this thread's core to wake up.
absl::Status SpinningPing(v1::KVCache::Stub* stub, grpc::CompletionQueue* cq,
                          int64_t work_us = -1) {
  grpc::ClientContext ctx;
  if (work_us >= 0) ctx.AddMetadata(kFloorWorkKey, absl::StrCat(work_us));
  v1::PingRequest req;
  v1::PingResponse resp;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<v1::PingResponse>> call =
      stub->AsyncPing(&ctx, req, cq);
  int tag = 0;
  call->Finish(&resp, &status, &tag);
  const gpr_timespec now = gpr_time_0(GPR_CLOCK_MONOTONIC);
  for (;;) {
    void* got = nullptr;
    bool ok = false;
    switch (cq->AsyncNext(&got, &ok, now)) {
      case grpc::CompletionQueue::GOT_EVENT:
        if (got != &tag || !ok) return absl::InternalError("unexpected tag");
        return status.ok() ? absl::OkStatus()
                           : absl::UnavailableError(status.error_message());
      case grpc::CompletionQueue::TIMEOUT:
        continue;
      case grpc::CompletionQueue::SHUTDOWN:
        return absl::InternalError("completion queue shut down");
    }
  }
}

// The spinning client's row on `target` (a minimal-stack channel of its
// own, as the raw clients' fastest row).
Result MeasureSpinningPing(const std::string& target, const std::string& what,
                           int warmup, int iters, int64_t work_us = -1) {
  grpc::ChannelArguments args;
  args.SetInt("kvdepot.bench.channel", -1);
  args.SetInt(GRPC_ARG_MINIMAL_STACK, 1);
  auto stub = v1::KVCache::NewStub(grpc::CreateCustomChannel(
      target, grpc::InsecureChannelCredentials(), args));
  grpc::CompletionQueue cq;
  Result r = Measure(
      absl::StrCat(what, ", async client spinning, minimal-stack channel"),
      warmup, iters, [&] { return SpinningPing(stub.get(), &cq, work_us); });
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
  return r;
}

// Ping on `target` with the raw clients: a sync stub on a default channel,
// then sync and callback stubs on a minimal-stack channel. Each channel
// has a connection of its own. Appends three rows named after `what`.
void MeasurePingClients(const std::string& target, const std::string& what,
                        int warmup, int iters, std::vector<Result>* out) {
  static int channel_number = 0;
  auto stub_on = [&](bool minimal) {
    grpc::ChannelArguments args;
    args.SetInt("kvdepot.bench.channel", ++channel_number);
    if (minimal) args.SetInt(GRPC_ARG_MINIMAL_STACK, 1);
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE,
                absl::GetFlag(FLAGS_floor_bdp_probe) ? 1 : 0);
    if (absl::GetFlag(FLAGS_floor_lean_args)) {
      args.SetInt(GRPC_ARG_ENABLE_CHANNELZ, 0);
      args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
    }
    return v1::KVCache::NewStub(grpc::CreateCustomChannel(
        target, grpc::InsecureChannelCredentials(), args));
  };
  auto plain = stub_on(false);
  out->push_back(Measure(absl::StrCat(what, ", sync stub"), warmup, iters,
                         [&] { return SyncPing(plain.get()); }));
  auto minimal = stub_on(true);
  out->push_back(
      Measure(absl::StrCat(what, ", sync stub, minimal-stack channel"), warmup,
              iters, [&] { return SyncPing(minimal.get()); }));
  out->push_back(
      Measure(absl::StrCat(what, ", callback client, minimal-stack channel"),
              warmup, iters, [&] { return CallbackPing(minimal.get()); }));
}

// The async floors' shapes, in the order of their rows.
struct AsyncShape {
  const char* how;
  bool spin;
  AsyncFloorServer::Neighbour neighbour;
};
constexpr AsyncShape kAsyncShapes[] = {
    {"in Next", false, AsyncFloorServer::Neighbour::kNone},
    {"spinning", true, AsyncFloorServer::Neighbour::kNone},
    {"spinning, a callback service too", true,
     AsyncFloorServer::Neighbour::kCallback},
    {"spinning, a sync service too", true, AsyncFloorServer::Neighbour::kSync},
};
constexpr int kAsyncShapeCount = sizeof(kAsyncShapes) / sizeof(kAsyncShapes[0]);

DaemonOptions BenchDaemonOptions(const std::string& dir) {
  DaemonOptions options;
  options.listen = dir + "/kv.sock";
  options.backend = absl::GetFlag(FLAGS_backend);
  options.serving.model = absl::GetFlag(FLAGS_serving_model);
  options.grpc_reflection = absl::GetFlag(FLAGS_grpc_reflection);
  options.serving.inline_max_rows = absl::GetFlag(FLAGS_inline_max_rows);
  return options;
}

int Run() {
  spdlog::set_level(spdlog::level::warn);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  const int iters = absl::GetFlag(FLAGS_iterations);
  const bool floor = absl::GetFlag(FLAGS_grpc_floor);
  const bool in_child = absl::GetFlag(FLAGS_server_process);
  std::string address = absl::GetFlag(FLAGS_address);
  // A private directory: clients refuse sockets in world-writable ones.
  std::string dir = "/tmp/kvdepot-bench-XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  // Child processes first: fork copies only this thread, so it must come
  // before this process starts gRPC's.
  std::vector<ChildServer> children;
  std::string floor_targets[2];  // bare, next to a sync service
  if (floor && in_child) {
    for (int sync = 0; sync < 2; ++sync) {
      const std::string socket = absl::StrCat(dir, "/floor", sync, ".sock");
      absl::StatusOr<ChildServer> c =
          ForkServer([&](const auto& ready, const auto& wait) {
            std::unique_ptr<FloorServer> f = StartFloor(socket, sync == 1);
            if (f == nullptr) return absl::UnavailableError(socket);
            ready("unix:" + socket);
            wait();
            f->server->Shutdown();
            return absl::OkStatus();
          });
      if (!c.ok()) {
        std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
        return 1;
      }
      floor_targets[sync] = c->target;
      children.push_back(*std::move(c));
    }
  }
  // The async-API floors, one per shape.
  const bool async_floor = absl::GetFlag(FLAGS_floor_async);
  std::string async_targets[kAsyncShapeCount];
  for (int i = 0; async_floor && in_child && i < kAsyncShapeCount; ++i) {
    const std::string socket = absl::StrCat(dir, "/afloor", i, ".sock");
    const AsyncShape& shape = kAsyncShapes[i];
    absl::StatusOr<ChildServer> c =
        ForkServer([&](const auto& ready, const auto& wait) {
          std::unique_ptr<AsyncFloorServer> f =
              AsyncFloorServer::Start(socket, shape.spin, shape.neighbour);
          if (f == nullptr) return absl::UnavailableError(socket);
          ready("unix:" + socket);
          wait();
          return absl::OkStatus();
        });
    if (!c.ok()) {
      std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
      return 1;
    }
    async_targets[i] = c->target;
    children.push_back(*std::move(c));
  }
  std::unique_ptr<Daemon> daemon;
  if (address.empty() && in_child) {
    const DaemonOptions options = BenchDaemonOptions(dir);
    absl::StatusOr<ChildServer> c =
        ForkServer([&](const auto& ready, const auto& wait) -> absl::Status {
          absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(options);
          if (!d.ok()) return d.status();
          ready(options.listen);
          wait();
          (*d)->Shutdown();
          return absl::OkStatus();
        });
    if (!c.ok()) {
      std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
      return 1;
    }
    address = c->target;
    children.push_back(*std::move(c));
  }
  std::vector<Result> results;
  results.push_back(SocketPingPong(warmup, iters));
  // The floor rows. In this process they are measured before the daemon
  // starts: its health service and reflection plugin are process-wide and
  // would join every later server.
  const size_t floor_i = results.size();
  for (int sync = 0; floor && sync < 2; ++sync) {
    const char* what = sync == 0 ? "gRPC floor (bare callback server)"
                                 : "gRPC floor + a sync service";
    if (in_child) {
      MeasurePingClients(floor_targets[sync], what, warmup, iters, &results);
      continue;
    }
    const std::string socket = absl::StrCat(dir, "/floor", sync, ".sock");
    std::unique_ptr<FloorServer> f = StartFloor(socket, sync == 1);
    if (f == nullptr) {
      std::fprintf(stderr, "cannot start the gRPC floor on %s\n",
                   socket.c_str());
      return 1;
    }
    MeasurePingClients("unix:" + socket, what, warmup, iters, &results);
    f->server->Shutdown();
  }
  const size_t async_i = results.size();
  for (int i = 0; async_floor && i < kAsyncShapeCount; ++i) {
    const AsyncShape& shape = kAsyncShapes[i];
    const std::string what =
        absl::StrCat("gRPC floor (async server, thread ", shape.how, ")");
    std::unique_ptr<AsyncFloorServer> f;
    std::string target = async_targets[i];
    if (!in_child) {
      const std::string socket = absl::StrCat(dir, "/afloor", i, ".sock");
      f = AsyncFloorServer::Start(socket, shape.spin, shape.neighbour);
      if (f == nullptr) {
        std::fprintf(stderr, "cannot start the async floor on %s\n",
                     socket.c_str());
        return 1;
      }
      target = "unix:" + socket;
    }
    MeasurePingClients(target, what, warmup, iters, &results);
    results.push_back(MeasureSpinningPing(target, what, warmup, iters));
  }
  if (address.empty()) {
    const DaemonOptions options = BenchDaemonOptions(dir);
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(options);
    if (!d.ok()) {
      std::fprintf(stderr, "%s\n", d.status().ToString().c_str());
      return 1;
    }
    daemon = *std::move(d);
    address = options.listen;
  }
  ClientOptions copts;
  copts.address = address;
  copts.client_name = "rpc_benchmark";
  absl::StatusOr<std::unique_ptr<KVCacheClient>> c =
      KVCacheClient::Connect(copts);
  if (!c.ok()) {
    std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
    return 1;
  }
  const std::string pool = absl::StrCat("rpc-bench-", getpid());
  v1::CreatePoolRequest cp;
  cp.set_name(pool);
  cp.set_format("V41");
  cp.set_block_size(kBlockSize);
  cp.set_num_blocks(kNumBlocks);
  cp.set_num_layers(1);
  if (absl::StatusOr<v1::PoolInfo> p = (*c)->CreatePool(cp); !p.ok()) {
    std::fprintf(stderr, "%s\n", p.status().ToString().c_str());
    return 1;
  }
  const int tokens = absl::GetFlag(FLAGS_tokens);
  const int64_t kv_bytes = int64_t{tokens} * kElements * 2;
  // CPU: shared buffers (memfds mapped here). CUDA: the K/V travel inline
  // (this benchmark has no device buffers of its own).
  const bool inline_data = absl::GetFlag(FLAGS_backend) == "cuda";
  std::optional<BufferMapping> in, out;
  std::vector<uint8_t> host_in(static_cast<size_t>(kv_bytes));
  if (!inline_data) {
    absl::StatusOr<BufferMapping> i = (*c)->AllocateBuffer(kv_bytes);
    absl::StatusOr<BufferMapping> o = (*c)->AllocateBuffer(kv_bytes);
    if (!i.ok() || !o.ok()) {
      std::fprintf(stderr, "AllocateBuffer failed\n");
      return 1;
    }
    in.emplace(*std::move(i));
    out.emplace(*std::move(o));
  }
  uint8_t* kv_in = inline_data ? host_in.data() : in->data();
  std::mt19937 rng(301);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < int64_t{tokens} * kElements; ++i) {
    const uint16_t h = FloatToBf16(normal(rng));
    std::memcpy(kv_in + 2 * i, &h, 2);
  }
  // Decode step: one token for each of `tokens` sequences, slots scattered
  // over the pool.
  std::vector<int32_t> all(kBlockSize * kNumBlocks);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  std::vector<int32_t> slots(all.begin(), all.begin() + tokens);
  v1::StoreRequest store;
  store.set_pool(pool);
  store.set_num_tokens(tokens);
  EncodeInt32s(slots, store.mutable_slot_mapping());
  store.set_dtype(v1::INPUT_DTYPE_BF16);
  if (inline_data) {
    store.mutable_kv()->set_inline_data(host_in.data(), host_in.size());
  } else {
    *store.mutable_kv() = in->Slice(0, kv_bytes);
  }
  // Load of the same tokens, one segment each.
  std::vector<int32_t> segs;
  for (int i = 0; i < tokens; ++i) {
    const int32_t b = slots[i] / kBlockSize, t = slots[i] % kBlockSize;
    segs.insert(segs.end(), {b, t, t + 1, i});
  }
  v1::LoadRequest load;
  load.set_pool(pool);
  v1::Segments* s = load.mutable_segments();
  s->set_num_segments(tokens);
  EncodeInt32s(segs, s->mutable_segments());
  s->set_total_k(tokens);
  if (inline_data) {
    load.mutable_data()->set_inline_output(true);
  } else {
    *load.mutable_data() = out->Slice(0, kv_bytes);
  }
  // Load by block table: tokens / 64 sequences of 64 tokens.
  v1::LoadRequest load_bt;
  load_bt.set_pool(pool);
  v1::SequencePlan* sp = load_bt.mutable_sequences();
  const int seqs = std::max(1, tokens / static_cast<int>(kBlockSize));
  sp->set_num_seqs(seqs);
  EncodeInt32s(std::vector<int32_t>(seqs, kBlockSize), sp->mutable_seqlen_k());
  sp->set_max_blocks_per_seq(1);
  std::vector<int32_t> table(seqs);
  std::iota(table.begin(), table.end(), 7);
  EncodeInt32s(table, sp->mutable_block_table());
  if (inline_data) {
    load_bt.mutable_data()->set_inline_output(true);
  } else {
    *load_bt.mutable_data() =
        out->Slice(0, int64_t{seqs} * kBlockSize * kElements * 2);
  }

  KVCacheClient* client = c->get();
  // In-daemon time per request from the Stats counters, read before and
  // after each measured series: the backend calls' kernel time, and the
  // handler's time (the service's per-RPC latency, from its start to the
  // status; integer microseconds per call, so a short call counts low).
  struct DaemonTimes {
    int64_t store_kernel_us = 0, load_kernel_us = 0;
    int64_t handler_us[3] = {0, 0, 0};  // Ping, Store, Load
  };
  auto daemon_times = [&]() -> DaemonTimes {
    absl::StatusOr<v1::StatsResponse> st = client->Stats();
    if (!st.ok()) {
      std::fprintf(stderr, "Stats failed: %s\n",
                   st.status().ToString().c_str());
      std::exit(1);
    }
    DaemonTimes t;
    t.store_kernel_us = st->store_kernel_us();
    t.load_kernel_us = st->load_kernel_us();
    for (const v1::RpcStats& r : st->rpcs()) {
      const int i = r.rpc() == "Ping"    ? 0
                    : r.rpc() == "Store" ? 1
                    : r.rpc() == "Load"  ? 2
                                         : -1;
      if (i >= 0) t.handler_us[i] = r.total_latency_us();
    }
    return t;
  };
  const int calls = warmup + iters;
  const auto per_call = [&](int64_t before, int64_t after) {
    return static_cast<double>(after - before) / calls;
  };
  const size_t ping_i = results.size();
  DaemonTimes t0 = daemon_times();
  results.push_back(Measure("Ping (empty RPC, client library)", warmup, iters,
                            [&] { return client->Ping(); }));
  DaemonTimes t1 = daemon_times();
  const double ping_handler_us = per_call(t0.handler_us[0], t1.handler_us[0]);
  // The raw clients of the floor rows, on the daemon.
  MeasurePingClients(client->target(), "  Ping", warmup, iters, &results);
  t0 = daemon_times();
  const size_t store_i = results.size();
  results.push_back(
      Measure(absl::StrCat("Store ", tokens, " tokens V41 (shared buffer)"),
              warmup, iters, [&] { return client->Store(store).status(); }));
  t1 = daemon_times();
  const double store_daemon_kernel_us =
      per_call(t0.store_kernel_us, t1.store_kernel_us);
  const double store_handler_us = per_call(t0.handler_us[1], t1.handler_us[1]);
  t0 = t1;
  const size_t load_i = results.size();
  results.push_back(
      Measure(absl::StrCat("Load ", tokens, " tokens V41 (segments, buffer)"),
              warmup, iters, [&] { return client->Load(load).status(); }));
  t1 = daemon_times();
  const double load_daemon_kernel_us =
      per_call(t0.load_kernel_us, t1.load_kernel_us);
  const double load_handler_us = per_call(t0.handler_us[2], t1.handler_us[2]);
  results.push_back(Measure(absl::StrCat("Load ", seqs * kBlockSize,
                                         " tokens V41 (block table, buffer)"),
                            warmup, iters,
                            [&] { return client->Load(load_bt).status(); }));

  // The kernel work of the same requests, without the daemon: the CPU
  // backend runs exactly these reference calls on a pool of the same layout.
  const PoolLayout layout =
      *MakePoolLayout(*FormatFromName("V41"), kBlockSize, kNumBlocks, 1);
  std::vector<uint8_t> layer(static_cast<size_t>(layout.layer_bytes));
  std::vector<uint8_t> rows(static_cast<size_t>(kv_bytes));
  const Result store_kernel =
      Measure("  kernel: reference Store", warmup, iters, [&] {
        return Store(layout, layer.data(), kv_in, InputDtype::kBF16, slots);
      });
  const Result load_kernel =
      Measure("  kernel: reference LoadSegments", warmup, iters, [&] {
        return LoadSegments(layout, layer.data(), segs, tokens, rows.data(),
                            nullptr);
      });
  results.push_back(store_kernel);
  results.push_back(load_kernel);
  // The bare floor again (in its child process), its handler working as
  // long as each kernel.
  const size_t work_i = results.size();
  if (floor) {
    const std::string target = in_child ? floor_targets[0] : "";
    if (!target.empty()) {
      auto stub = v1::KVCache::NewStub(
          grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
      for (const Result* k : {&store_kernel, &load_kernel}) {
        const int64_t us = static_cast<int64_t>(k->p50_us + 0.5);
        results.push_back(
            Measure(absl::StrCat("gRPC floor, sync stub, handler busy ", us,
                                 " us (= p50 of", k->name.substr(9), ")"),
                    warmup, iters, [&] { return SyncPing(stub.get(), us); }));
      }
      results.push_back(Measure("gRPC floor, sync stub, handler busy 0 us",
                                warmup, iters,
                                [&] { return SyncPing(stub.get(), 0); }));
    }
  }
  // Clients that spin on their replies: the socket floor and Ping alike
  // (the servers still sleep between requests).
  const size_t spin_i = results.size();
  results.push_back(testing::SocketPingPongSpinning(warmup, iters));
  results.push_back(
      MeasureSpinningPing(client->target(), "Ping (raw)", warmup, iters));
  if (floor && in_child) {
    results.push_back(MeasureSpinningPing(
        floor_targets[0], "gRPC floor (bare callback server)", warmup, iters));
  }
  // The client library polling for its replies (ClientOptions.reply_spin):
  // Ping, Store and Load as above, on a client of its own.
  const size_t polled_i = results.size();
  std::unique_ptr<KVCacheClient> polled;
  if (const int64_t spin = absl::GetFlag(FLAGS_reply_spin_us); spin > 0) {
    ClientOptions popts = copts;
    popts.client_name = "rpc_benchmark-polling";
    popts.reply_spin = absl::Microseconds(spin);
    absl::StatusOr<std::unique_ptr<KVCacheClient>> pc =
        KVCacheClient::Connect(popts);
    if (!pc.ok()) {
      std::fprintf(stderr, "%s\n", pc.status().ToString().c_str());
      return 1;
    }
    polled = *std::move(pc);
    // The pool and the buffers belong to the first client's session: grant
    // them to this one's.
    std::vector<v1::GrantRequest> grants(1);
    grants[0].set_pool(pool);
    for (const std::optional<BufferMapping>* b : {&in, &out}) {
      if (!b->has_value()) continue;
      grants.emplace_back().set_buffer_id((*b)->id());
    }
    for (v1::GrantRequest& g : grants) {
      g.add_sessions(polled->session_number());
      if (absl::Status st = client->Grant(g); !st.ok()) {
        std::fprintf(stderr, "Grant: %s\n", st.ToString().c_str());
        return 1;
      }
    }
    results.push_back(Measure("Ping (client library polling for replies)",
                              warmup, iters, [&] { return polled->Ping(); }));
    results.push_back(
        Measure(absl::StrCat("Store ", tokens, " tokens V41 (client polling)"),
                warmup, iters, [&] { return polled->Store(store).status(); }));
    results.push_back(Measure(
        absl::StrCat("Load ", tokens, " tokens V41 (segments, client polling)"),
        warmup, iters, [&] { return polled->Load(load).status(); }));
  }
  // The spinning async floor (its server thread never sleeps) with a
  // client spinning too, its handler busy as long as each kernel: what a
  // long call costs beyond its work when neither side has to be woken.
  const size_t async_work_i = results.size();
  const bool async_work = async_floor && in_child;
  if (async_work) {
    for (const double p50 : {store_kernel.p50_us, load_kernel.p50_us, 0.0}) {
      const int64_t us = static_cast<int64_t>(p50 + 0.5);
      results.push_back(MeasureSpinningPing(
          async_targets[1],
          absl::StrCat("gRPC floor (async server, thread spinning), handler "
                       "busy ",
                       us, " us"),
          warmup, iters, us));
    }
  }
  std::printf("| request | p50 us | p99 us | mean us |\n|---|---|---|---|\n");
  for (const Result& r : results) {
    std::printf("| %s | %.1f | %.1f | %.1f |\n", r.name.c_str(), r.p50_us,
                r.p99_us, r.mean_us);
  }
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    if (FILE* f = std::fopen(path.c_str(), "w")) {
      std::fprintf(f, "[");
      for (size_t i = 0; i < results.size(); ++i) {
        std::fprintf(f,
                     "%s\n {\"name\": \"%s\", \"p50_us\": %.2f, "
                     "\"p99_us\": %.2f, \"mean_us\": %.2f}",
                     i ? "," : "", results[i].name.c_str(), results[i].p50_us,
                     results[i].p99_us, results[i].mean_us);
      }
      std::fprintf(f, "\n]\n");
      std::fclose(f);
    }
  }
  const size_t kStore = store_i, kLoad = load_i;
  const double ping = results[ping_i].p50_us;
  const double socket = results[0].p50_us;
  std::printf(
      "\nPing p50 over the same run's Unix-socket ping-pong p50: "
      "%.1f us / %.1f us = %.2fx\n",
      ping, socket, ping / socket);
  {
    const double spin_socket = results[spin_i].p50_us;
    const double spin_ping = results[spin_i + 1].p50_us;
    std::printf(
        "clients spinning on their replies: Ping %.1f us over the socket "
        "ping-pong %.1f us = %.2fx",
        spin_ping, spin_socket, spin_ping / spin_socket);
    if (results.size() > spin_i + 2) {
      std::printf("; the bare gRPC floor %.1f us = %.2fx",
                  results[spin_i + 2].p50_us,
                  results[spin_i + 2].p50_us / spin_socket);
    }
    std::printf("\n");
  }
  if (polled != nullptr) {
    const double p = results[polled_i].p50_us;
    const double st = results[polled_i + 1].p50_us - store_kernel.p50_us;
    const double ld = results[polled_i + 2].p50_us - load_kernel.p50_us;
    std::printf(
        "client library polling for its replies (reply_spin %lld us): Ping "
        "%.1f us = %.2fx the socket ping-pong (%.2fx the spinning one); "
        "overhead beyond the kernel (p50s): Store %.1f us = %.2fx that Ping, "
        "Load (segments) %.1f us = %.2fx\n",
        static_cast<long long>(absl::GetFlag(FLAGS_reply_spin_us)), p,
        p / socket, p / results[spin_i].p50_us, st, st / p, ld, ld / p);
  }
  if (async_work) {
    const double f0 = results[async_work_i + 2].p50_us;
    const double st = results[async_work_i].p50_us - store_kernel.p50_us;
    const double ld = results[async_work_i + 1].p50_us - load_kernel.p50_us;
    std::printf(
        "spinning async floor, spinning client, handler busy: beyond its "
        "work as long as Store %.1f us = %.2fx its empty call (%.1f us), as "
        "long as Load %.1f us = %.2fx\n",
        st, st / f0, f0, ld, ld / f0);
  }
  if (floor) {
    // Like for like: the sync stub on a default channel, on each server.
    const double bare = results[floor_i].p50_us;
    const double with_sync = results[floor_i + 3].p50_us;
    const double raw_ping = results[ping_i + 1].p50_us;
    std::printf(
        "gRPC floor p50 (bare callback server, sync stub) over the socket "
        "ping-pong: %.1f us = %.2fx\n"
        "  the same next to a sync service: %.1f us = %.2fx the bare floor\n"
        "  kvdepot's Ping on the same client: %.1f us = %.2fx the bare "
        "floor\n",
        bare, bare / socket, with_sync, with_sync / bare, raw_ping,
        raw_ping / bare);
  }
  if (async_floor) {
    // Rows per server: sync stub, minimal sync, minimal callback, spinning.
    for (int i = 0; i < kAsyncShapeCount; ++i) {
      const Result& sync_stub = results[async_i + 4 * i];
      const Result& spinning = results[async_i + 4 * i + 3];
      std::printf(
          "gRPC floor on the async API, its thread %s: sync stub %.1f us = "
          "%.2fx the socket ping-pong; spinning client %.1f us = %.2fx the "
          "spinning ping-pong\n",
          kAsyncShapes[i].how, sync_stub.p50_us, sync_stub.p50_us / socket,
          spinning.p50_us, spinning.p50_us / results[spin_i].p50_us);
    }
  }
  std::printf(
      "\nrequest overhead = p50(RPC) - p50(bare kernel work), ratio to "
      "p50(Ping):\n"
      "  Store: %.1f us = %.2fx Ping\n  Load (segments): %.1f us = %.2fx "
      "Ping\n",
      results[kStore].p50_us - store_kernel.p50_us,
      (results[kStore].p50_us - store_kernel.p50_us) / ping,
      results[kLoad].p50_us - load_kernel.p50_us,
      (results[kLoad].p50_us - load_kernel.p50_us) / ping);
  std::printf(
      "request overhead = mean(RPC) - mean(in-daemon kernel time from Stats), "
      "ratio to mean(Ping):\n"
      "  Store: %.1f us (kernel %.1f us) = %.2fx Ping\n"
      "  Load (segments): %.1f us (kernel %.1f us) = %.2fx Ping\n",
      results[kStore].mean_us - store_daemon_kernel_us, store_daemon_kernel_us,
      (results[kStore].mean_us - store_daemon_kernel_us) /
          results[ping_i].mean_us,
      results[kLoad].mean_us - load_daemon_kernel_us, load_daemon_kernel_us,
      (results[kLoad].mean_us - load_daemon_kernel_us) /
          results[ping_i].mean_us);
  std::printf(
      "in-daemon handler time (Stats latency, means): Ping %.1f us; Store "
      "%.1f us = kernel %.1f + %.1f; Load (segments) %.1f us = kernel %.1f "
      "+ %.1f\n",
      ping_handler_us, store_handler_us, store_daemon_kernel_us,
      store_handler_us - store_daemon_kernel_us, load_handler_us,
      load_daemon_kernel_us, load_handler_us - load_daemon_kernel_us);
  if (results.size() == work_i + 3) {
    const double f0 = results[work_i + 2].p50_us;
    std::printf(
        "gRPC floor with a busy handler, p50 beyond its work, ratio to the "
        "same floor's empty call (%.1f us): as long as Store %.1f us = "
        "%.2fx, as long as Load %.1f us = %.2fx\n",
        f0, results[work_i].p50_us - store_kernel.p50_us,
        (results[work_i].p50_us - store_kernel.p50_us) / f0,
        results[work_i + 1].p50_us - load_kernel.p50_us,
        (results[work_i + 1].p50_us - load_kernel.p50_us) / f0);
  }
  (void)client->DeletePool(pool);
  c->reset();
  daemon.reset();
  for (const ChildServer& child : children) Release(child);
  return 0;
}

}  // namespace
}  // namespace kvdepot

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  kvdepot::testing::ApplyMallocKeepFreedFlag();
  if (!absl::GetFlag(FLAGS_mutex_deadlock_detection)) {
    // As kvdepotd's main (server/main.cc); before any thread or fork.
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
  if (absl::GetFlag(FLAGS_backend) != "cpu") {
    // Before any CUDA call (the in-process daemon's backend checks it).
    if (absl::Status s = kvdepot::PrepareCudaEnvironment(); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
  }
  return kvdepot::Run();
}
