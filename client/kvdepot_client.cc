#include "client/kvdepot_client.h"

#include <grpcpp/support/client_interceptor.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/default_address.h"
#include "common/status_macros.h"

namespace kvdepot {
namespace {

using Stub = v1::KVCache::Stub;

template <typename Req, typename Resp>
using Method = grpc::Status (Stub::*)(grpc::ClientContext*, const Req&, Resp*);
template <typename Req, typename Resp>
using PrepareMethod = std::unique_ptr<grpc::ClientAsyncResponseReader<Resp>> (
    Stub::*)(grpc::ClientContext*, const Req&, grpc::CompletionQueue*);

// Adds the session id to the metadata of every call on the channel (also
// calls made through stub() directly), so requests without a session_id
// field carry it too.
class SessionInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit SessionInterceptor(std::shared_ptr<std::string> id)
      : id_(std::move(id)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    if (m->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::
                PRE_SEND_INITIAL_METADATA) &&
        !id_->empty()) {
      m->GetSendInitialMetadata()->insert({"kvdepot-session-id", *id_});
    }
    m->Proceed();
  }

 private:
  std::shared_ptr<std::string> id_;
};

class SessionInterceptorFactory
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit SessionInterceptorFactory(std::shared_ptr<std::string> id)
      : id_(std::move(id)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* /*info*/) override {
    return new SessionInterceptor(id_);
  }

 private:
  std::shared_ptr<std::string> id_;
};

// The channel credentials `options` ask for: mutual TLS from PEM files, or
// plaintext.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> CredentialsFor(
    const ClientOptions& options) {
  if (options.tls_ca_path.empty() && options.tls_cert_path.empty() &&
      options.tls_key_path.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  struct File {
    const char* field;
    const std::string& path;
    std::string* out;
  };
  for (const File& f :
       {File{"tls_ca_path", options.tls_ca_path, &ssl.pem_root_certs},
        File{"tls_cert_path", options.tls_cert_path, &ssl.pem_cert_chain},
        File{"tls_key_path", options.tls_key_path, &ssl.pem_private_key}}) {
    std::ifstream in(f.path);
    std::stringstream text;
    text << in.rdbuf();
    if (f.path.empty() || !in || text.str().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(f.field, " = \"", f.path,
                       "\": mutual TLS needs all three PEM files readable"));
    }
    *f.out = text.str();
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(status.error_code()),
                   status.error_message());
  if (!status.error_details().empty()) {
    out.SetPayload(kGrpcStatusDetailsUrl, absl::Cord(status.error_details()));
  }
  return out;
}

// One unary call with the client's deadline.
template <typename Req, typename Resp>
static absl::StatusOr<Resp> Call(Stub* stub, Method<Req, Resp> method,
                                 const Req& request, absl::Duration timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   absl::ToChronoMilliseconds(timeout));
  Resp response;
  grpc::Status status = (stub->*method)(&ctx, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

// A data-path call: through `poller` when the client polls for replies.
template <typename Req, typename Resp>
static absl::StatusOr<Resp> DataCall(Stub* stub, Method<Req, Resp> method,
                                     PrepareMethod<Req, Resp> prepare,
                                     const Req& request, absl::Duration timeout,
                                     ReplyPoller* poller) {
  if (poller == nullptr) return Call(stub, method, request, timeout);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   absl::ToChronoMilliseconds(timeout));
  Resp response;
  grpc::Status status = poller->Call(
      &ctx, &response, [&](grpc::ClientContext* c, grpc::CompletionQueue* cq) {
        return (stub->*prepare)(c, request, cq);
      });
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

KVCacheClient::KVCacheClient(const ClientOptions& options, std::string target,
                             std::shared_ptr<grpc::Channel> channel,
                             std::shared_ptr<std::string> session_id,
                             std::unique_ptr<CompanionConnection> companion)
    : options_(options),
      target_(std::move(target)),
      channel_(std::move(channel)),
      stub_(v1::KVCache::NewStub(channel_)),
      poller_(options.reply_spin > absl::ZeroDuration()
                  ? std::make_unique<ReplyPoller>(options.reply_spin)
                  : nullptr),
      session_id_(std::move(session_id)),
      companion_(std::move(companion)) {}

absl::StatusOr<std::unique_ptr<KVCacheClient>> KVCacheClient::Connect(
    const ClientOptions& options) {
  if (options.reply_spin < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ClientOptions.reply_spin = ", absl::FormatDuration(options.reply_spin),
        ": must be >= 0 (0 = sleep on replies)"));
  }
  const std::string target = ResolveTarget(options.address);
  const std::string socket = UnixSocketPathOf(target);
  auto session_id = std::make_shared<std::string>();
  std::unique_ptr<CompanionConnection> companion;
  if (!socket.empty()) {
    RETURN_IF_ERROR(CheckSocketDirectory(socket));
    if (options.open_session) {
      ASSIGN_OR_RETURN(companion,
                       CompanionConnection::Open(
                           CompanionSocketPathOf(socket),
                           ExpectedDaemonUid(options.expected_daemon_uid),
                           options.client_name));
      *session_id = companion->session_id();
    }
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(
      std::min<int64_t>(options.max_message_bytes, INT32_MAX)));
  args.SetMaxSendMessageSize(static_cast<int>(
      std::min<int64_t>(options.max_message_bytes, INT32_MAX)));
  std::vector<
      std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(
      std::make_unique<SessionInterceptorFactory>(session_id));
  if (!socket.empty() &&
      (!options.tls_ca_path.empty() || !options.tls_cert_path.empty())) {
    return absl::InvalidArgumentError(
        "tls_*: TLS is for TCP; a Unix socket is protected by its directory "
        "and the companion socket's peer credentials");
  }
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                   CredentialsFor(options));
  std::shared_ptr<grpc::Channel> channel =
      grpc::experimental::CreateCustomChannelWithInterceptors(
          target, credentials, args, std::move(interceptors));
  if (!channel->WaitForConnected(
          std::chrono::system_clock::now() +
          absl::ToChronoMilliseconds(options.connect_timeout))) {
    return absl::UnavailableError(
        absl::StrCat("cannot connect to kvdepot at \"", target, "\" within ",
                     absl::FormatDuration(options.connect_timeout)));
  }
  std::unique_ptr<KVCacheClient> client(new KVCacheClient(
      options, target, std::move(channel), session_id, std::move(companion)));
  if (options.open_session && socket.empty() && !options.tcp_lease_session) {
    // TCP: a session that lives as long as its stream (SPEC §11).
    RETURN_IF_ERROR(client->OpenTcpSession());
  } else if (options.open_session && socket.empty()) {
    // TCP: an anonymous lease session.
    v1::OpenSessionRequest r;
    r.set_client_name(options.client_name);
    r.set_lease_ms(absl::ToInt64Milliseconds(options.lease));
    absl::StatusOr<v1::OpenSessionResponse> s =
        Call(client->stub_.get(), &Stub::OpenSession, r, options.timeout);
    if (!s.ok()) return s.status();
    *client->session_id_ = s->session_id();
    if (options.keep_alive) {
      const absl::Duration period = absl::Milliseconds(s->lease_ms()) / 3;
      KVCacheClient* c = client.get();
      client->keep_alive_ =
          std::thread([c, period] { c->KeepAliveLoop(period); });
    }
  }
  return client;
}

absl::Status KVCacheClient::OpenTcpSession() {
  tcp_sessions_ = v1::TcpSessions::NewStub(channel_);
  // No deadline: the session lives as long as the call.
  tcp_session_ctx_ = std::make_unique<grpc::ClientContext>();
  v1::OpenSessionRequest r;
  r.set_client_name(options_.client_name);
  tcp_session_ = tcp_sessions_->Open(tcp_session_ctx_.get(), r);
  v1::SessionEvent event;
  if (!tcp_session_->Read(&event)) {
    absl::Status s = FromGrpcStatus(tcp_session_->Finish());
    tcp_session_.reset();
    return s.ok() ? absl::UnavailableError(
                        "the daemon ended the session stream at once")
                  : s;
  }
  *session_id_ = event.session_id();
  tcp_session_number_ = event.session_number();
  tls_subject_ = event.tls_subject();
  return absl::OkStatus();
}

void KVCacheClient::KeepAliveLoop(absl::Duration period) {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), period);
    if (stopping_) break;
    mu_.Unlock();
    (void)KeepAlive();  // a failure shows up on the next real call
    mu_.Lock();
  }
}

KVCacheClient::~KVCacheClient() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (keep_alive_.joinable()) keep_alive_.join();
  if (tcp_session_ != nullptr) {
    // The session ends with its stream.
    tcp_session_ctx_->TryCancel();
    v1::SessionEvent e;
    while (tcp_session_->Read(&e)) {
    }
    (void)tcp_session_->Finish();
    return;
  }
  // A companion session ends when its connection closes (companion_).
  if (companion_ == nullptr && !session_id_->empty()) {
    v1::CloseSessionRequest r;
    r.set_session_id(*session_id_);
    (void)Call(stub_.get(), &Stub::CloseSession, r, absl::Seconds(2));
  }
}

absl::StatusOr<v1::PoolInfo> KVCacheClient::CreatePool(
    const v1::CreatePoolRequest& r) {
  return Call(stub_.get(), &Stub::CreatePool, r, options_.timeout);
}

absl::StatusOr<v1::PoolInfo> KVCacheClient::CreateOrGetPool(
    const v1::CreatePoolRequest& r) {
  absl::StatusOr<v1::PoolInfo> created = CreatePool(r);
  if (created.ok() ||
      created.status().code() != absl::StatusCode::kAlreadyExists) {
    return created;
  }
  absl::StatusOr<v1::PoolInfo> existing = GetPool(r.name());
  if (!existing.ok()) return existing.status();
  const v1::PoolLayout& l = existing->layout();
  const bool same_format =
      l.format() == r.format() ||
      l.format() == absl::StrCat("BF16(", r.elements(), ")");
  if (!same_format || l.block_size() != r.block_size() ||
      l.num_blocks() != r.num_blocks() || l.num_layers() != r.num_layers()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "pool \"", r.name(), "\" exists with another layout (", l.format(),
        ", block_size ", l.block_size(), ", num_blocks ", l.num_blocks(),
        ", num_layers ", l.num_layers(), ")"));
  }
  return existing;
}

absl::StatusOr<v1::PoolInfo> KVCacheClient::GetPool(const std::string& name) {
  v1::GetPoolRequest r;
  r.set_name(name);
  return Call(stub_.get(), &Stub::GetPool, r, options_.timeout);
}

absl::StatusOr<v1::ListPoolsResponse> KVCacheClient::ListPools() {
  return Call(stub_.get(), &Stub::ListPools, v1::ListPoolsRequest(),
              options_.timeout);
}

absl::Status KVCacheClient::DeletePool(const std::string& name) {
  v1::DeletePoolRequest r;
  r.set_name(name);
  return Call(stub_.get(), &Stub::DeletePool, r, options_.timeout).status();
}

absl::StatusOr<const PoolMapping*> KVCacheClient::MapPool(
    const std::string& name) {
  {
    absl::MutexLock lock(&mu_);
    auto it = pools_.find(name);
    if (it != pools_.end()) return it->second.get();
  }
  if (companion_ == nullptr) {
    return absl::FailedPreconditionError(
        "MapPool needs a session on the companion socket (a Unix socket "
        "address and open_session)");
  }
  v1::CompanionRequest r;
  r.mutable_map_pool()->set_name(name);
  UniqueFd fd;
  ASSIGN_OR_RETURN(v1::CompanionReply reply, companion_->Call(r, -1, &fd));
  ASSIGN_OR_RETURN(PoolMapping mapping,
                   PoolMapping::Open(reply.pool(), std::move(fd)));
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(name);
  if (it != pools_.end()) return it->second.get();
  auto owned = std::make_unique<PoolMapping>(std::move(mapping));
  const PoolMapping* p = owned.get();
  pools_.emplace(name, std::move(owned));
  return p;
}

absl::StatusOr<BufferMapping> KVCacheClient::AllocateBuffer(int64_t size) {
  if (companion_ == nullptr) {
    return absl::FailedPreconditionError(
        "AllocateBuffer needs a session on the companion socket (a Unix "
        "socket address and open_session)");
  }
  v1::CompanionRequest r;
  r.mutable_allocate_buffer()->set_size(size);
  UniqueFd fd;
  ASSIGN_OR_RETURN(v1::CompanionReply reply, companion_->Call(r, -1, &fd));
  return BufferMapping::Open(reply.buffer(), std::move(fd));
}

absl::StatusOr<v1::BufferInfo> KVCacheClient::ImportBuffer(
    const MemfdRegion& region) {
  if (companion_ == nullptr) {
    return absl::FailedPreconditionError(
        "ImportBuffer needs a session on the companion socket");
  }
  v1::CompanionRequest r;
  r.mutable_import_buffer()->set_size(region.size());
  ASSIGN_OR_RETURN(v1::CompanionReply reply,
                   companion_->Call(r, region.fd(), nullptr));
  return reply.buffer();
}

absl::StatusOr<v1::BufferInfo> KVCacheClient::ImportBuffer(
    v1::ImportBufferRequest r) {
  if (r.session_id().empty()) r.set_session_id(*session_id_);
  return Call(stub_.get(), &Stub::ImportBuffer, r, options_.timeout);
}

absl::Status KVCacheClient::Grant(v1::GrantRequest r) {
  if (r.session_id().empty()) r.set_session_id(*session_id_);
  return Call(stub_.get(), &Stub::Grant, r, options_.timeout).status();
}

absl::Status KVCacheClient::ReleaseBuffer(uint64_t buffer_id) {
  v1::ReleaseBufferRequest r;
  r.set_session_id(*session_id_);
  r.set_buffer_id(buffer_id);
  return Call(stub_.get(), &Stub::ReleaseBuffer, r, options_.timeout).status();
}

// Store and Load send the caller's request as it is: the session rides in
// the call's metadata (SessionInterceptor), which the daemon reads when the
// session_id field is empty, so filling the field in is not worth a copy
// of the request (its slot or segment arrays) on every decode step.
absl::StatusOr<v1::StoreResponse> KVCacheClient::Store(
    const v1::StoreRequest& r) {
  return DataCall(stub_.get(), &Stub::Store, &Stub::PrepareAsyncStore, r,
                  options_.timeout, poller_.get());
}

absl::StatusOr<v1::LoadResponse> KVCacheClient::Load(const v1::LoadRequest& r) {
  return DataCall(stub_.get(), &Stub::Load, &Stub::PrepareAsyncLoad, r,
                  options_.timeout, poller_.get());
}

absl::StatusOr<v1::BuildPlanResponse> KVCacheClient::BuildPlan(
    const v1::BuildPlanRequest& r) {
  return DataCall(stub_.get(), &Stub::BuildPlan, &Stub::PrepareAsyncBuildPlan,
                  r, options_.timeout, poller_.get());
}

absl::StatusOr<v1::PrefillLoadResponse> KVCacheClient::PrefillLoad(
    v1::PrefillLoadRequest r) {
  if (r.session_id().empty()) r.set_session_id(*session_id_);
  return DataCall(stub_.get(), &Stub::PrefillLoad,
                  &Stub::PrepareAsyncPrefillLoad, r, options_.timeout,
                  poller_.get());
}

absl::StatusOr<v1::ConvertTopkResponse> KVCacheClient::ConvertTopk(
    const v1::ConvertTopkRequest& r) {
  return DataCall(stub_.get(), &Stub::ConvertTopk,
                  &Stub::PrepareAsyncConvertTopk, r, options_.timeout,
                  poller_.get());
}

absl::StatusOr<v1::SwaDecodeIndexResponse> KVCacheClient::SwaDecodeIndex(
    const v1::SwaDecodeIndexRequest& r) {
  return DataCall(stub_.get(), &Stub::SwaDecodeIndex,
                  &Stub::PrepareAsyncSwaDecodeIndex, r, options_.timeout,
                  poller_.get());
}

absl::StatusOr<v1::PrefillIndexResponse> KVCacheClient::PrefillIndex(
    const v1::PrefillIndexRequest& r) {
  return DataCall(stub_.get(), &Stub::PrefillIndex,
                  &Stub::PrepareAsyncPrefillIndex, r, options_.timeout,
                  poller_.get());
}

absl::StatusOr<v1::StatsResponse> KVCacheClient::Stats() {
  return Call(stub_.get(), &Stub::Stats, v1::StatsRequest(), options_.timeout);
}

absl::Status KVCacheClient::Ping() {
  return DataCall(stub_.get(), &Stub::Ping, &Stub::PrepareAsyncPing,
                  v1::PingRequest(), options_.timeout, poller_.get())
      .status();
}

absl::Status KVCacheClient::KeepAlive() {
  v1::KeepAliveRequest r;
  r.set_session_id(*session_id_);
  return Call(stub_.get(), &Stub::KeepAlive, r, options_.timeout).status();
}

}  // namespace kvdepot
