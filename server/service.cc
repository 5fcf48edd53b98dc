#include "server/service.h"

#include <algorithm>
#include <chrono>
#include <iterator>
#include <set>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/backend/inline_call.h"
#include "server/error_details.h"
#include "server/limits.h"
#include "server/log_limiter.h"
#include "server/logging.h"
#include "server/version.h"
#include "spdlog/spdlog.h"

namespace kvdepot {
namespace {

constexpr const char* kRpcNames[] = {
    "OpenSession",    "KeepAlive",     "CloseSession", "CreatePool",
    "GetPool",        "ListPools",     "DeletePool",   "AllocateBuffer",
    "ImportBuffer",   "ReleaseBuffer", "Grant",        "Store",
    "Load",           "BuildPlan",     "PrefillLoad",  "ConvertTopk",
    "SwaDecodeIndex", "PrefillIndex",  "Stats",        "Ping",
    "Inspect",        "Verify",        "Drain",
};
static_assert(sizeof(kRpcNames) / sizeof(kRpcNames[0]) ==
              static_cast<size_t>(Rpc::kCount));

// Administrative calls log at info on success; data-path calls at debug.
bool IsAdmin(Rpc rpc) {
  switch (rpc) {
    case Rpc::kOpenSession:
    case Rpc::kCloseSession:
    case Rpc::kCreatePool:
    case Rpc::kDeletePool:
    case Rpc::kAllocateBuffer:
    case Rpc::kImportBuffer:
    case Rpc::kReleaseBuffer:
    case Rpc::kGrant:
      return true;
    default:
      return false;
  }
}

// Calls refused once the Drain RPC ran: everything that starts new work.
bool IsNewWork(Rpc rpc) {
  switch (rpc) {
    case Rpc::kOpenSession:
    case Rpc::kCreatePool:
    case Rpc::kAllocateBuffer:
    case Rpc::kImportBuffer:
    case Rpc::kStore:
    case Rpc::kLoad:
    case Rpc::kBuildPlan:
    case Rpc::kPrefillLoad:
    case Rpc::kConvertTopk:
    case Rpc::kSwaDecodeIndex:
    case Rpc::kPrefillIndex:
      return true;
    default:
      return false;
  }
}

}  // namespace

std::vector<std::string> KVCacheService::RpcNames() {
  return std::vector<std::string>(std::begin(kRpcNames), std::end(kRpcNames));
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  return ToGrpcStatusWithDetails(status);  // + google.rpc.BadRequest
}

absl::Status CheckAlive(const grpc::ServerContextBase* ctx) {
  if (ctx == nullptr) return absl::OkStatus();
  if (ctx->IsCancelled()) return absl::CancelledError("the call was cancelled");
  if (ctx->deadline() <= std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError(
        "the deadline passed before the work started");
  }
  return absl::OkStatus();
}

KVCacheService::KVCacheService(Backend* backend, PoolRegistry* pools,
                               SessionManager* sessions,
                               const ServiceOptions& options)
    : backend_(backend),
      pools_(pools),
      sessions_(sessions),
      options_(options),
      start_time_(absl::Now()),
      verify_slots_(options.max_verify_streams_per_client,
                    Limit::kVerifyStreamsPerClient) {
  if (options.metrics == nullptr) {
    own_metrics_ = std::make_unique<ServerMetrics>(RpcNames());
  }
  metrics_ = options.metrics != nullptr ? options.metrics : own_metrics_.get();
}

template <typename Body>
grpc::Status KVCacheService::Run(Rpc rpc, Ctx* ctx, absl::string_view pool,
                                 absl::string_view session_id, Body&& body) {
  const absl::Time start = absl::Now();
  // Counted until Run returns, however the body ends: a leaked count would
  // make every drain wait its full timeout.
  struct InFlight {
    std::atomic<int64_t>& n;
    explicit InFlight(std::atomic<int64_t>& count) : n(count) {
      n.fetch_add(1);
    }
    ~InFlight() { n.fetch_sub(1); }
  } in_flight(in_flight_);
  absl::Status status;
  bool refused_by_drain = false;
  // A call whose session did not authenticate takes the unidentified share
  // of the log lines: a made-up session names no share of its own.
  LogClient log_client = LogClient::Unidentified();
  if (draining_.load(std::memory_order_relaxed)) {
    refused_by_drain = true;
    status = absl::UnavailableError(
        "kvdepot is draining (shutting down); retry on another daemon");
  } else if (IsNewWork(rpc) && !accepting_.load(std::memory_order_relaxed)) {
    refused_by_drain = true;
    status = absl::UnavailableError(
        "kvdepot is draining (kvcachectl drain): no new work is accepted; "
        "retry on another daemon");
  } else {
    status = CheckAlive(ctx);
    if (status.ok()) {
      absl::StatusOr<Caller> caller = ResolveCaller(ctx, session_id);
      if (caller.ok()) log_client = caller->log_client();
      status = caller.ok() ? body(*caller) : caller.status();
    }
  }
  // A deferred inline attempt runs again on a worker (inline_call.h): the
  // call is counted and logged once, there.
  if (InlineCallDeferred()) return ToGrpcStatus(status);
  const int64_t latency_us = absl::ToInt64Microseconds(absl::Now() - start);
  metrics_->RecordCall(static_cast<int>(rpc), status.code(), latency_us,
                       refused_by_drain, LimitOf(status));
  const char* name = kRpcNames[static_cast<int>(rpc)];
  // The pool name and the message (which may quote a client's value) are
  // the client's: escaped and cut so they cannot forge or flood a line.
  if (!status.ok()) {
    // Rate-limited per kind of line and client (server/log_limiter.h): a
    // client failing calls in a loop must not flood the log or bury other
    // clients' lines; the metrics count every one.
    if (AdmitClientLog(ClientLog::kFailedCall, log_client)) {
      spdlog::info("rpc={} pool=\"{}\" status={} latency_us={} error=\"{}\"",
                   name, EscapeForLog(pool),
                   absl::StatusCodeToString(status.code()), latency_us,
                   EscapeForLog(status.message()));
    }
  } else if (IsAdmin(rpc)) {
    spdlog::info("rpc={} pool=\"{}\" status=OK latency_us={}", name,
                 EscapeForLog(pool), latency_us);
  } else if (spdlog::should_log(spdlog::level::debug)) {
    // Checked first: the arguments (an escaped copy of the pool name) would
    // otherwise be built on every successful data-path call and dropped.
    spdlog::debug("rpc={} pool=\"{}\" status=OK latency_us={}", name,
                  EscapeForLog(pool), latency_us);
  }
  return ToGrpcStatus(status);
}

absl::StatusOr<Caller> KVCacheService::ResolveCaller(
    const Ctx* ctx, absl::string_view session_id) {
  if (session_id.empty() && ctx != nullptr) {
    const auto& md = ctx->client_metadata();
    auto it = md.find(kSessionMetadataKey);
    if (it != md.end()) session_id = {it->second.data(), it->second.size()};
  }
  return sessions_->Authenticate(session_id, absl::Now());
}

absl::StatusOr<std::shared_ptr<Pool>> KVCacheService::UsablePool(
    const Caller& caller, absl::string_view field, absl::string_view name) {
  RETURN_IF_ERROR(RequireSession(caller));
  absl::StatusOr<std::shared_ptr<Pool>> pool = pools_->Get(field, name);
  if (!pool.ok()) return pool.status();
  RETURN_IF_ERROR((*pool)->CheckUse(caller, field));
  return pool;
}

grpc::Status KVCacheService::OpenSession(Ctx* ctx,
                                         const v1::OpenSessionRequest* r,
                                         v1::OpenSessionResponse* out) {
  return Run(
      Rpc::kOpenSession, ctx, "", "", [&](const Caller&) -> absl::Status {
        absl::Duration granted;
        absl::StatusOr<std::string> id =
            sessions_->Open(r->client_name(), absl::Milliseconds(r->lease_ms()),
                            absl::Now(), &granted);
        if (!id.ok()) return id.status();
        out->set_session_id(*id);
        out->set_lease_ms(absl::ToInt64Milliseconds(granted));
        return absl::OkStatus();
      });
}

grpc::Status KVCacheService::KeepAlive(Ctx* ctx, const v1::KeepAliveRequest* r,
                                       v1::KeepAliveResponse* out) {
  return Run(Rpc::kKeepAlive, ctx, "", r->session_id(),
             [&](const Caller& caller) -> absl::Status {
               RETURN_IF_ERROR(RequireSession(caller));
               absl::StatusOr<absl::Duration> lease =
                   sessions_->Touch(r->session_id(), absl::Now());
               if (!lease.ok()) return lease.status();
               out->set_lease_ms(*lease == absl::InfiniteDuration()
                                     ? 0
                                     : absl::ToInt64Milliseconds(*lease));
               return absl::OkStatus();
             });
}

grpc::Status KVCacheService::CloseSession(Ctx* ctx,
                                          const v1::CloseSessionRequest* r,
                                          v1::CloseSessionResponse* out) {
  return Run(Rpc::kCloseSession, ctx, "", r->session_id(),
             [&](const Caller& caller) -> absl::Status {
               RETURN_IF_ERROR(RequireSession(caller));
               absl::StatusOr<int64_t> n = sessions_->Close(r->session_id());
               if (!n.ok()) return n.status();
               out->set_buffers_released(*n);
               return absl::OkStatus();
             });
}

grpc::Status KVCacheService::CreatePool(Ctx* ctx,
                                        const v1::CreatePoolRequest* r,
                                        v1::PoolInfo* out) {
  return Run(Rpc::kCreatePool, ctx, r->name(), "",
             [&](const Caller& caller) -> absl::Status {
               RETURN_IF_ERROR(RequireSession(caller));
               if (caller.anonymous()) {
                 return absl::PermissionDeniedError(
                     "CreatePool: anonymous sessions cannot own pools; "
                     "create it from the companion socket, over mutual TLS "
                     "or in the config");
               }
               absl::StatusOr<std::shared_ptr<Pool>> pool = pools_->Create(
                   *r, caller.uid, BudgetClientOf(caller), caller.tls_subject);
               if (!pool.ok()) return pool.status();
               (*pool)->ToProto(out);
               return absl::OkStatus();
             });
}

grpc::Status KVCacheService::GetPool(Ctx* ctx, const v1::GetPoolRequest* r,
                                     v1::PoolInfo* out) {
  return Run(Rpc::kGetPool, ctx, r->name(), "",
             [&](const Caller&) -> absl::Status {
               absl::StatusOr<std::shared_ptr<Pool>> pool =
                   pools_->Get("name", r->name());
               if (!pool.ok()) return pool.status();
               (*pool)->ToProto(out);
               return absl::OkStatus();
             });
}

grpc::Status KVCacheService::ListPools(Ctx* ctx,
                                       const v1::ListPoolsRequest* /*r*/,
                                       v1::ListPoolsResponse* out) {
  return Run(Rpc::kListPools, ctx, "", "", [&](const Caller&) -> absl::Status {
    for (const std::shared_ptr<Pool>& pool : pools_->List()) {
      pool->ToProto(out->add_pools());
    }
    return absl::OkStatus();
  });
}

grpc::Status KVCacheService::DeletePool(Ctx* ctx,
                                        const v1::DeletePoolRequest* r,
                                        v1::DeletePoolResponse* /*out*/) {
  return Run(Rpc::kDeletePool, ctx, r->name(), "",
             [&](const Caller& caller) -> absl::Status {
               RETURN_IF_ERROR(RequireSession(caller));
               absl::StatusOr<std::shared_ptr<Pool>> pool =
                   pools_->Get("name", r->name());
               if (!pool.ok()) return pool.status();
               RETURN_IF_ERROR((*pool)->CheckOwner(caller, "DeletePool:"));
               return pools_->Delete(r->name());
             });
}

// Buffers over gRPC exist only for legacy handles (CUDA IPC, opt-in); the
// descriptor path is the companion socket.
static absl::Status LegacyBuffersOnly(const Backend& backend,
                                      absl::string_view rpc) {
  if (backend.legacy_handles()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      rpc,
      " over gRPC is only for legacy CUDA IPC handles (kvdepotd "
      "--legacy_cuda_ipc); buffers are handed over as descriptors (memfds, "
      "CUDA VMM exports) on the companion socket (SPEC §11)"));
}

grpc::Status KVCacheService::AllocateBuffer(Ctx* ctx,
                                            const v1::AllocateBufferRequest* r,
                                            v1::BufferInfo* out) {
  return Run(Rpc::kAllocateBuffer, ctx, "", r->session_id(),
             [&](const Caller& caller) -> absl::Status {
               if (r->size() <= 0 || r->size() > options_.max_buffer_bytes) {
                 return absl::InvalidArgumentError(absl::StrCat(
                     "size = ", r->size(), " is outside [1, ",
                     options_.max_buffer_bytes, "] (--max_buffer_bytes)"));
               }
               RETURN_IF_ERROR(RequireSession(caller));
               RETURN_IF_ERROR(LegacyBuffersOnly(*backend_, "AllocateBuffer"));
               absl::StatusOr<std::unique_ptr<Memory>> memory =
                   backend_->Allocate(r->size(), "");
               if (!memory.ok()) return memory.status();
               absl::StatusOr<std::shared_ptr<Buffer>> buffer =
                   sessions_->AddBuffer(caller, *std::move(memory));
               if (!buffer.ok()) return buffer.status();
               out->set_buffer_id((*buffer)->id);
               out->set_size((*buffer)->memory->size());
               (*buffer)->memory->FillHandle(out->mutable_handle());
               return absl::OkStatus();
             });
}

grpc::Status KVCacheService::ImportBuffer(Ctx* ctx,
                                          const v1::ImportBufferRequest* r,
                                          v1::BufferInfo* out) {
  return Run(Rpc::kImportBuffer, ctx, "", r->session_id(),
             [&](const Caller& caller) -> absl::Status {
               RETURN_IF_ERROR(RequireSession(caller));
               RETURN_IF_ERROR(LegacyBuffersOnly(*backend_, "ImportBuffer"));
               if (r->handle().size() <= 0 ||
                   r->handle().size() > options_.max_buffer_bytes) {
                 return absl::InvalidArgumentError(absl::StrCat(
                     "handle.size = ", r->handle().size(), " is outside [1, ",
                     options_.max_buffer_bytes, "] (--max_buffer_bytes)"));
               }
               absl::StatusOr<std::unique_ptr<Memory>> memory =
                   backend_->Import(r->handle());
               if (!memory.ok()) return memory.status();
               absl::StatusOr<std::shared_ptr<Buffer>> buffer =
                   sessions_->AddBuffer(caller, *std::move(memory));
               if (!buffer.ok()) return buffer.status();
               out->set_buffer_id((*buffer)->id);
               out->set_size((*buffer)->memory->size());
               *out->mutable_handle() = r->handle();
               return absl::OkStatus();
             });
}

grpc::Status KVCacheService::ReleaseBuffer(Ctx* ctx,
                                           const v1::ReleaseBufferRequest* r,
                                           v1::ReleaseBufferResponse* /*out*/) {
  return Run(Rpc::kReleaseBuffer, ctx, "", r->session_id(),
             [&](const Caller& caller) -> absl::Status {
               RETURN_IF_ERROR(RequireSession(caller));
               return sessions_->ReleaseBuffer(caller, r->buffer_id());
             });
}

grpc::Status KVCacheService::Grant(Ctx* ctx, const v1::GrantRequest* r,
                                   v1::GrantResponse* /*out*/) {
  return Run(
      Rpc::kGrant, ctx, r->pool(), r->session_id(),
      [&](const Caller& caller) -> absl::Status {
        RETURN_IF_ERROR(RequireSession(caller));
        for (const auto& [field, n] :
             {std::pair<const char*, int>{"uids", r->uids_size()},
              {"gids", r->gids_size()},
              {"sessions", r->sessions_size()}}) {
          if (n > kMaxAclEntries) {
            return absl::InvalidArgumentError(absl::StrCat(
                field, " has ", n, " entries, more than ", kMaxAclEntries));
          }
        }
        Acl grant;
        grant.uids.insert(r->uids().begin(), r->uids().end());
        grant.gids.insert(r->gids().begin(), r->gids().end());
        grant.sessions.insert(r->sessions().begin(), r->sessions().end());
        if (r->tls_subjects_size() > kMaxTlsSubjectsPerGrant) {
          return absl::InvalidArgumentError(
              absl::StrCat("tls_subjects has ", r->tls_subjects_size(),
                           " entries, more than ", kMaxTlsSubjectsPerGrant));
        }
        for (int i = 0; i < r->tls_subjects_size(); ++i) {
          RETURN_IF_ERROR(CheckTlsSubject(absl::StrCat("tls_subjects[", i, "]"),
                                          r->tls_subjects(i)));
          grant.tls_subjects.insert(r->tls_subjects(i));
        }
        switch (r->object_case()) {
          case v1::GrantRequest::kPool: {
            absl::StatusOr<std::shared_ptr<Pool>> pool =
                pools_->Get("pool", r->pool());
            if (!pool.ok()) return pool.status();
            RETURN_IF_ERROR((*pool)->CheckOwner(caller, "Grant on"));
            return (*pool)->Grant(grant);
          }
          case v1::GrantRequest::kBufferId:
            return sessions_->GrantBuffer(caller, r->buffer_id(), grant);
          default:
            return absl::InvalidArgumentError("object: set pool or buffer_id");
        }
      });
}

grpc::Status KVCacheService::Store(Ctx* ctx, const v1::StoreRequest* r,
                                   v1::StoreResponse* out) {
  return Run(Rpc::kStore, ctx, r->pool(), r->session_id(),
             [&](const Caller& c) { return DoStore(ctx, c, *r, out); });
}

grpc::Status KVCacheService::Load(Ctx* ctx, const v1::LoadRequest* r,
                                  v1::LoadResponse* out) {
  return Run(Rpc::kLoad, ctx, r->pool(), r->session_id(),
             [&](const Caller& c) { return DoLoad(ctx, c, *r, out); });
}

grpc::Status KVCacheService::BuildPlan(Ctx* ctx, const v1::BuildPlanRequest* r,
                                       v1::BuildPlanResponse* out) {
  return Run(Rpc::kBuildPlan, ctx, r->pool(), "",
             [&](const Caller& c) { return DoBuildPlan(c, *r, out); });
}

grpc::Status KVCacheService::PrefillLoad(Ctx* ctx,
                                         const v1::PrefillLoadRequest* r,
                                         v1::PrefillLoadResponse* out) {
  return Run(Rpc::kPrefillLoad, ctx, r->main_pool(), r->session_id(),
             [&](const Caller& c) { return DoPrefillLoad(ctx, c, *r, out); });
}

grpc::Status KVCacheService::ConvertTopk(Ctx* ctx,
                                         const v1::ConvertTopkRequest* r,
                                         v1::ConvertTopkResponse* out) {
  return Run(Rpc::kConvertTopk, ctx, r->pool(), r->session_id(),
             [&](const Caller& c) { return DoConvertTopk(ctx, c, *r, out); });
}

grpc::Status KVCacheService::SwaDecodeIndex(Ctx* ctx,
                                            const v1::SwaDecodeIndexRequest* r,
                                            v1::SwaDecodeIndexResponse* out) {
  return Run(
      Rpc::kSwaDecodeIndex, ctx, r->pool(), r->session_id(),
      [&](const Caller& c) { return DoSwaDecodeIndex(ctx, c, *r, out); });
}

grpc::Status KVCacheService::PrefillIndex(Ctx* ctx,
                                          const v1::PrefillIndexRequest* r,
                                          v1::PrefillIndexResponse* out) {
  return Run(Rpc::kPrefillIndex, ctx, "", r->session_id(),
             [&](const Caller& c) { return DoPrefillIndex(ctx, c, *r, out); });
}

grpc::Status KVCacheService::Stats(Ctx* ctx, const v1::StatsRequest* /*r*/,
                                   v1::StatsResponse* out) {
  return Run(Rpc::kStats, ctx, "", "", [&](const Caller&) -> absl::Status {
    FillStats(out);
    // Not counting this call.
    out->set_in_flight(std::max<int64_t>(out->in_flight() - 1, 0));
    return absl::OkStatus();
  });
}

void KVCacheService::FillStats(v1::StatsResponse* out) const {
  const SessionStats s = sessions_->Stats();
  const std::vector<std::shared_ptr<Pool>> pools = pools_->List();
  out->set_pools(static_cast<int64_t>(pools.size()));
  out->set_pool_bytes(pools_->total_bytes());
  out->set_sessions(s.sessions);
  out->set_buffers(s.buffers);
  out->set_buffer_bytes(s.buffer_bytes);
  out->set_backend(std::string(backend_->name()));
  out->set_uptime_s(absl::ToInt64Seconds(absl::Now() - start_time_));
  out->set_version(kKvdepotVersion);
  std::set<std::string> devices;
  for (const std::shared_ptr<Pool>& p : pools) devices.insert(p->device);
  for (const std::string& d : devices) out->add_devices(d);
  out->set_draining(draining());
  out->set_in_flight(in_flight_.load());
  if (options_.memory_budget != nullptr) {
    out->set_memory_budget_bytes(options_.memory_budget->total());
    out->set_memory_budget_used_bytes(options_.memory_budget->used());
    out->set_memory_budget_source(options_.memory_budget->source());
  }
  if (options_.descriptors != nullptr && backend_->name() == "cpu") {
    out->set_descriptors_held(options_.descriptors->held());
    out->set_descriptors_limit(options_.descriptors->limit());
  }
  if (options_.tls_relay != nullptr) {
    out->set_tls_connections(options_.tls_relay->active());
  }
  for (int k = 0; k < kNumClientLogKinds; ++k) {
    v1::LogLinesDropped* d = out->add_log_lines_dropped();
    d->set_kind(ClientLogName(static_cast<ClientLog>(k)));
    d->set_lines(ClientLogLinesDropped(static_cast<ClientLog>(k)));
  }
  metrics_->Fill(out);
}

grpc::Status KVCacheService::Ping(Ctx* ctx, const v1::PingRequest* /*r*/,
                                  v1::PingResponse* /*out*/) {
  return Run(Rpc::kPing, ctx, "", "",
             [](const Caller&) { return absl::OkStatus(); });
}

grpc::Status KVCacheService::Inspect(Ctx* ctx, const v1::InspectRequest* r,
                                     v1::InspectResponse* out) {
  return Run(Rpc::kInspect, ctx, r->pool(), "",
             [&](const Caller& c) { return DoInspect(c, *r, out); });
}

grpc::Status KVCacheService::Verify(Ctx* ctx, const v1::VerifyRequest* r,
                                    const ProgressWriter& write) {
  return Run(Rpc::kVerify, ctx, r->pool(), "",
             [&](const Caller& c) { return DoVerify(ctx, c, *r, write); });
}

grpc::Status KVCacheService::Drain(Ctx* ctx, const v1::DrainRequest* /*r*/,
                                   v1::DrainResponse* out) {
  return Run(Rpc::kDrain, ctx, "", "",
             [&](const Caller& c) { return DoDrain(c, out); });
}

}  // namespace kvdepot
