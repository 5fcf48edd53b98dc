// The kvdepot.v1.KVCache gRPC service: validates every request in full,
// then runs it on the backend. Errors are absl::Status inside and become
// grpc::Status once, in Run(). Every call logs one structured line
// (rpc, pool, status, latency_us) and updates the per-RPC counters.
#ifndef KVDEPOT_SERVER_SERVICE_H_
#define KVDEPOT_SERVER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kvdepot/v1/kvdepot.grpc.pb.h"
#include "server/backend/backend.h"
#include "server/client_slots.h"
#include "server/descriptors.h"
#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/pools.h"
#include "server/prefill_sources.h"
#include "server/sessions.h"
#include "server/socket_relay.h"

namespace kvdepot {

struct ServiceOptions {
  int64_t max_array_elements = int64_t{1} << 24;  // per packed int32 field
  int64_t max_inline_bytes = int64_t{64} << 20;   // inline reply data
  int64_t max_buffer_bytes = int64_t{16} << 30;   // AllocateBuffer size
  // Verify streams one client (uid, TLS subject, anonymous session) may
  // run at once; <= 0 = no limit.
  int64_t max_verify_streams_per_client = 2;
  // Where calls are counted (the daemon shares it with its backend and the
  // /metrics page); null = the service keeps its own.
  ServerMetrics* metrics = nullptr;
  // The daemon's memory budget, reported by Stats; null = none.
  const MemoryBudget* memory_budget = nullptr;
  // The descriptors pools and buffers hold, reported by Stats; null = none.
  const DescriptorBudget* descriptors = nullptr;
  // The mutual-TLS TCP port's relay, whose connections Stats reports; null
  // = no such port.
  const SocketRelay* tls_relay = nullptr;
  // Inspect and Verify copy at most this many bytes of a pool at a time
  // (one record at least); > 0.
  int64_t scan_chunk_bytes = int64_t{4} << 20;
  // Tests only: Verify sleeps this long per block, so a test can make a
  // scan outlast a client's deadline without a large pool.
  absl::Duration verify_block_delay = absl::ZeroDuration();
};

enum class Rpc : int {
  kOpenSession,
  kKeepAlive,
  kCloseSession,
  kCreatePool,
  kGetPool,
  kListPools,
  kDeletePool,
  kAllocateBuffer,
  kImportBuffer,
  kReleaseBuffer,
  kGrant,
  kStore,
  kLoad,
  kBuildPlan,
  kPrefillLoad,
  kConvertTopk,
  kSwaDecodeIndex,
  kPrefillIndex,
  kStats,
  kPing,
  kInspect,
  kVerify,
  kDrain,
  kCount,
};

// The handlers, independent of gRPC's serving model: server/serving.h
// adapts them to the callback API (the default) or the sync API.
class KVCacheService final {
 public:
  KVCacheService(Backend* backend, PoolRegistry* pools,
                 SessionManager* sessions, const ServiceOptions& options);

  // From now on every new call fails with UNAVAILABLE (graceful drain).
  void StartDraining() { draining_.store(true); }
  // Calls running now (in Run).
  int64_t in_flight() const { return in_flight_.load(); }
  // Soft drain (the Drain RPC): new work gets UNAVAILABLE, reads go on;
  // `hook` runs once when it starts (the daemon sets health NOT_SERVING).
  // Call before serving.
  void set_drain_hook(std::function<void()> hook) {
    drain_hook_ = std::move(hook);
  }
  bool draining() const { return draining_.load() || !accepting_.load(); }
  // The RPC names by Rpc index (for ServerMetrics).
  static std::vector<std::string> RpcNames();
  // Gauges and counters as the Stats RPC returns them (also /metrics).
  void FillStats(v1::StatsResponse* out) const;

  // Both serving models' contexts (grpc::ServerContext of the sync API,
  // grpc::CallbackServerContext of the callback API) are one of these.
  using Ctx = grpc::ServerContextBase;
  // Where Verify's progress messages go; false = the client went away.
  using ProgressWriter = std::function<bool(const v1::VerifyProgress&)>;
  grpc::Status OpenSession(Ctx*, const v1::OpenSessionRequest*,
                           v1::OpenSessionResponse*);
  grpc::Status KeepAlive(Ctx*, const v1::KeepAliveRequest*,
                         v1::KeepAliveResponse*);
  grpc::Status CloseSession(Ctx*, const v1::CloseSessionRequest*,
                            v1::CloseSessionResponse*);
  grpc::Status CreatePool(Ctx*, const v1::CreatePoolRequest*, v1::PoolInfo*);
  grpc::Status GetPool(Ctx*, const v1::GetPoolRequest*, v1::PoolInfo*);
  grpc::Status ListPools(Ctx*, const v1::ListPoolsRequest*,
                         v1::ListPoolsResponse*);
  grpc::Status DeletePool(Ctx*, const v1::DeletePoolRequest*,
                          v1::DeletePoolResponse*);
  grpc::Status AllocateBuffer(Ctx*, const v1::AllocateBufferRequest*,
                              v1::BufferInfo*);
  grpc::Status ImportBuffer(Ctx*, const v1::ImportBufferRequest*,
                            v1::BufferInfo*);
  grpc::Status ReleaseBuffer(Ctx*, const v1::ReleaseBufferRequest*,
                             v1::ReleaseBufferResponse*);
  grpc::Status Grant(Ctx*, const v1::GrantRequest*, v1::GrantResponse*);
  grpc::Status Store(Ctx*, const v1::StoreRequest*, v1::StoreResponse*);
  grpc::Status Load(Ctx*, const v1::LoadRequest*, v1::LoadResponse*);
  grpc::Status BuildPlan(Ctx*, const v1::BuildPlanRequest*,
                         v1::BuildPlanResponse*);
  grpc::Status PrefillLoad(Ctx*, const v1::PrefillLoadRequest*,
                           v1::PrefillLoadResponse*);
  grpc::Status ConvertTopk(Ctx*, const v1::ConvertTopkRequest*,
                           v1::ConvertTopkResponse*);
  grpc::Status SwaDecodeIndex(Ctx*, const v1::SwaDecodeIndexRequest*,
                              v1::SwaDecodeIndexResponse*);
  grpc::Status PrefillIndex(Ctx*, const v1::PrefillIndexRequest*,
                            v1::PrefillIndexResponse*);
  grpc::Status Stats(Ctx*, const v1::StatsRequest*, v1::StatsResponse*);
  grpc::Status Ping(Ctx*, const v1::PingRequest*, v1::PingResponse*);
  // Operations (service_ops.cc).
  grpc::Status Inspect(Ctx*, const v1::InspectRequest*, v1::InspectResponse*);
  grpc::Status Verify(Ctx*, const v1::VerifyRequest*,
                      const ProgressWriter& write);
  grpc::Status Verify(Ctx* ctx, const v1::VerifyRequest* r,
                      grpc::ServerWriter<v1::VerifyProgress>* writer) {
    return Verify(ctx, r, [writer](const v1::VerifyProgress& p) {
      return writer->Write(p);
    });
  }
  // Whether the backend's calls may wait for a device (GPU completion):
  // such calls never run on a gRPC thread.
  bool backend_waits_for_device() const { return backend_->name() != "cpu"; }
  grpc::Status Drain(Ctx*, const v1::DrainRequest*, v1::DrainResponse*);

 private:
  // Refuses while draining or past the deadline, resolves the caller from
  // `session_id` (or the call metadata kvdepot-session-id when empty), runs
  // `body(caller)`, logs, counts and converts the status.
  template <typename Body>
  grpc::Status Run(Rpc rpc, Ctx* ctx, absl::string_view pool,
                   absl::string_view session_id, Body&& body);

  // The caller `session_id` or the metadata names (no session: a Caller
  // without one; an unknown id: UNAUTHENTICATED).
  absl::StatusOr<Caller> ResolveCaller(const Ctx* ctx,
                                       absl::string_view session_id);
  // Pool `name` when the caller may use it; `field` names it in errors.
  absl::StatusOr<std::shared_ptr<Pool>> UsablePool(const Caller& caller,
                                                   absl::string_view field,
                                                   absl::string_view name);
  // The common start of Store and Load: checks the GPU ordering fields
  // against the backend, finds the pool (the caller may use) and `layer`.
  absl::StatusOr<std::shared_ptr<Pool>> DataTarget(const Caller& caller,
                                                   absl::string_view pool,
                                                   int64_t layer,
                                                   absl::string_view wait_event,
                                                   bool record_event);

  // GPU ordering fields (wait_event_ipc_handle, record_event) need the
  // cuda backend: INVALID_ARGUMENT naming the field otherwise.
  absl::Status CheckGpuOrdering(absl::string_view wait_event,
                                bool record_event) const;

  // Awaits a Store/Load's client event on the host (Backend::
  // AwaitClientEvent) before the pool's lock is taken, and returns the
  // ordering to queue the work with: no event left to wait on, the
  // caller's session (its own streams).
  absl::StatusOr<GpuOrdering> AwaitOrdering(Ctx* ctx, const Caller& caller,
                                            const Pool& pool,
                                            const GpuOrdering& ordering);

  // The handlers (service_data.cc, service_index.cc).
  absl::Status DoStore(Ctx* ctx, const Caller& caller,
                       const v1::StoreRequest& r, v1::StoreResponse* out);
  absl::Status DoLoad(Ctx* ctx, const Caller& caller, const v1::LoadRequest& r,
                      v1::LoadResponse* out);
  absl::Status DoBuildPlan(const Caller& caller, const v1::BuildPlanRequest& r,
                           v1::BuildPlanResponse* out);
  absl::Status DoPrefillLoad(Ctx* ctx, const Caller& caller,
                             const v1::PrefillLoadRequest& r,
                             v1::PrefillLoadResponse* out);
  absl::Status DoConvertTopk(Ctx* ctx, const Caller& caller,
                             const v1::ConvertTopkRequest& r,
                             v1::ConvertTopkResponse* out);
  absl::Status DoSwaDecodeIndex(Ctx* ctx, const Caller& caller,
                                const v1::SwaDecodeIndexRequest& r,
                                v1::SwaDecodeIndexResponse* out);
  absl::Status DoPrefillIndex(Ctx* ctx, const Caller& caller,
                              const v1::PrefillIndexRequest& r,
                              v1::PrefillIndexResponse* out);
  absl::Status DoInspect(const Caller& caller, const v1::InspectRequest& r,
                         v1::InspectResponse* out);
  absl::Status DoDrain(const Caller& caller, v1::DrainResponse* out);
  absl::Status DoVerify(Ctx* ctx, const Caller& caller,
                        const v1::VerifyRequest& r,
                        const ProgressWriter& write);

  Backend* const backend_;
  PoolRegistry* const pools_;
  SessionManager* const sessions_;
  const ServiceOptions options_;
  const absl::Time start_time_;
  std::atomic<bool> draining_{false};
  std::atomic<bool> accepting_{true};  // false after the Drain RPC
  std::function<void()> drain_hook_;
  std::unique_ptr<ServerMetrics> own_metrics_;  // when options.metrics is null
  ServerMetrics* metrics_;
  std::atomic<int64_t> in_flight_{0};
  ClientSlots verify_slots_;        // Verify streams per client
  PrefillSources prefill_sources_;  // sources of shared prefill loads
};

// Not OK when the client cancelled or the deadline passed: checked before
// heavy work.
absl::Status CheckAlive(const grpc::ServerContextBase* ctx);

// The call metadata key that carries the session id of calls whose request
// has no session_id field.
inline constexpr char kSessionMetadataKey[] = "kvdepot-session-id";

// absl -> grpc status (the codes share their numbering).
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_SERVICE_H_
