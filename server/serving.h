// How the KVCache handlers (server/service.h) meet gRPC: the serving model.
//
// The default is gRPC's callback API: a request is handled on the thread
// that read it (no hand-off, no thread wake-up) when it is short; long
// work (Verify, Inspect, PrefillLoad, large Store/Load/index requests,
// pool and buffer creation and release, and on a device backend every call
// that may wait for the GPU) goes to a bounded WorkerPool, so a gRPC thread
// never blocks on GPU completion or on large CPU work. An inline call that
// would have to wait after all (a pool's lock or a staging buffer held by
// a call waiting for the GPU) is deferred and runs again on the pool
// (server/backend/inline_call.h). A full pool answers RESOURCE_EXHAUSTED
// at once. The sync API (one handler thread per call
// from gRPC's own pool) stays selectable for comparison (rpc_benchmark
// --serving=sync).
//
// Both open a ReplyScope (server/reply_scope.h) around every handler: the
// callback model keeps its reservations until the call is done (its reply
// sent, or the call failed or cancelled); the sync model, which cannot
// see that, until the handler returns.
#ifndef KVDEPOT_SERVER_SERVING_H_
#define KVDEPOT_SERVER_SERVING_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvdepot/v1/kvdepot.grpc.pb.h"
#include "server/memory_budget.h"
#include "server/service.h"

namespace kvdepot {

struct ServingOptions {
  std::string model = "callback";  // callback | sync
  // Threads and queue of the pool for offloaded data-path calls, and of
  // the one for Verify and Inspect (long scans that may wait on a slow
  // reader).
  int worker_threads = 8;
  int ops_threads = 8;
  int max_queued_calls = 1024;
  // Store/Load rows (tokens) up to which a request runs inline on the CPU
  // backend; index requests get 16x this many output entries.
  int64_t inline_max_rows = 1024;
  // Inline reply bytes admitted until each call is done
  // (server/reply_scope.h); null admits everything. Not owned.
  MemoryBudget* replies = nullptr;
};

// Owns the registered gRPC service and whatever threads the model needs.
class Serving {
 public:
  virtual ~Serving() = default;
  virtual grpc::Service* service() = 0;
  // Runs the calls still queued (they see the service draining) and joins
  // its threads. Call after grpc::Server::Wait: the server's shutdown waits
  // for the callbacks that the pool finishes, so the pool must run until
  // then.
  virtual void Shutdown() = 0;
};

// INVALID_ARGUMENT for an unknown model or bad sizes.
absl::StatusOr<std::unique_ptr<Serving>> MakeServing(
    KVCacheService* impl, const ServingOptions& options);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_SERVING_H_
