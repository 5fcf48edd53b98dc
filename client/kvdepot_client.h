// The C++ client of kvdepot. Connects (default: the daemon's default Unix
// socket), opens a session on the companion socket (after checking the
// socket directory and the daemon's uid; over TCP: a TcpSessions.Open
// stream held for the client's life, identified by its TLS certificate
// when one is given, or an anonymous lease session kept alive by a
// background thread when asked for), attaches the session id to
// every call, wraps every RPC as absl::StatusOr, and maps pools and buffers
// from descriptors the daemon hands over (pools cached per name).
//
//   absl::StatusOr<std::unique_ptr<KVCacheClient>> c =
//   KVCacheClient::Connect({}); absl::StatusOr<const PoolMapping*> pool =
//   (*c)->MapPool("main"); absl::StatusOr<BufferMapping> buf =
//   (*c)->AllocateBuffer(1 << 20);
//   ... write K/V into buf->data(), then (*c)->Store(request) ...
#ifndef KVDEPOT_CLIENT_KVDEPOT_CLIENT_H_
#define KVDEPOT_CLIENT_KVDEPOT_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/companion_connection.h"
#include "client/mappings.h"
#include "client/reply_poller.h"
#include "common/memfd.h"
#include "kvdepot/v1/kvdepot.grpc.pb.h"

namespace kvdepot {

struct ClientOptions {
  // "" = the default Unix socket; "/path", "unix:/path" or "host:port".
  std::string address;
  std::string client_name = "kvdepot_client";
  // Open a session (needed for everything but Stats, Ping and reading pool
  // layouts); 0 lease = the daemon's default (TCP only).
  bool open_session = true;
  // The daemon uid accepted on the companion socket; -1 =
  // $KVDEPOT_DAEMON_UID, else the client's own uid or root.
  int64_t expected_daemon_uid = -1;
  absl::Duration lease = absl::ZeroDuration();
  // TCP: the old anonymous lease session (OpenSession + KeepAlive) instead
  // of a session stream.
  bool tcp_lease_session = false;
  // TCP with mutual TLS: PEM files of the roots the daemon's certificate
  // chains to, and of this client's certificate chain and key (its
  // identity: the certificate's subject). All empty = plaintext (loopback).
  std::string tls_ca_path;
  std::string tls_cert_path;
  std::string tls_key_path;
  // Renew the lease from a background thread every lease / 3.
  bool keep_alive = true;
  // Per-call deadline.
  absl::Duration timeout = absl::Seconds(30);
  // > 0: the data-path calls (Store, Load, BuildPlan, PrefillLoad, the
  // index calls, Ping) poll for their reply on the calling thread for up
  // to this long before sleeping on it (client/reply_poller.h): lower
  // latency for a caller that waits anyway, at the price of its core while
  // it polls. 0 = sleep at once.
  absl::Duration reply_spin = absl::ZeroDuration();
  // How long Connect waits for the daemon.
  absl::Duration connect_timeout = absl::Seconds(10);
  int64_t max_message_bytes = int64_t{64} << 20;
};

class KVCacheClient {
 public:
  static absl::StatusOr<std::unique_ptr<KVCacheClient>> Connect(
      const ClientOptions& options);

  KVCacheClient(const KVCacheClient&) = delete;
  KVCacheClient& operator=(const KVCacheClient&) = delete;
  // Stops the keep-alive thread and closes the session (best effort).
  ~KVCacheClient();

  const std::string& target() const { return target_; }
  const std::string& session_id() const { return *session_id_; }
  // The public number of the session (for Grant), 0 for a lease session.
  uint64_t session_number() const {
    return companion_ != nullptr ? companion_->hello().session_number()
                                 : tcp_session_number_;
  }
  // The identity a TCP session stream was given (the certificate's
  // subject; "" = anonymous or not a stream session).
  const std::string& tls_subject() const { return tls_subject_; }
  // The companion connection (null over TCP or without a session).
  CompanionConnection* companion() const { return companion_.get(); }
  v1::KVCache::Stub* stub() const { return stub_.get(); }
  // The channel (e.g. for grpc.health.v1 or generic calls).
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

  // Pools.
  absl::StatusOr<v1::PoolInfo> CreatePool(const v1::CreatePoolRequest& r);
  // Creates the pool, or returns the existing one when its layout matches
  // (FAILED_PRECONDITION when it does not).
  absl::StatusOr<v1::PoolInfo> CreateOrGetPool(const v1::CreatePoolRequest& r);
  absl::StatusOr<v1::PoolInfo> GetPool(const std::string& name);
  absl::StatusOr<v1::ListPoolsResponse> ListPools();
  absl::Status DeletePool(const std::string& name);
  // Maps a pool (its memfd from the companion socket), once: later calls
  // return the cached mapping, valid until the client is destroyed.
  absl::StatusOr<const PoolMapping*> MapPool(const std::string& name);

  // Buffers of this session, mapped.
  absl::StatusOr<BufferMapping> AllocateBuffer(int64_t size);
  // Hands a client-owned memfd (MemfdRegion::Create) to the daemon.
  absl::StatusOr<v1::BufferInfo> ImportBuffer(const MemfdRegion& region);
  // A legacy import (a CUDA IPC handle, --legacy_cuda_ipc daemons);
  // session_id filled in when empty.
  absl::StatusOr<v1::BufferInfo> ImportBuffer(v1::ImportBufferRequest r);
  absl::Status ReleaseBuffer(uint64_t buffer_id);
  // Grants a pool or a buffer (session_id filled in when empty).
  absl::Status Grant(v1::GrantRequest r);

  // Cache operations. Store and Load send the request unchanged: an empty
  // session_id means this client's session, which every call carries in
  // its metadata. The others fill session_id in when empty.
  absl::StatusOr<v1::StoreResponse> Store(const v1::StoreRequest& r);
  absl::StatusOr<v1::LoadResponse> Load(const v1::LoadRequest& r);
  absl::StatusOr<v1::BuildPlanResponse> BuildPlan(
      const v1::BuildPlanRequest& r);
  absl::StatusOr<v1::PrefillLoadResponse> PrefillLoad(v1::PrefillLoadRequest r);
  absl::StatusOr<v1::ConvertTopkResponse> ConvertTopk(
      const v1::ConvertTopkRequest& r);
  absl::StatusOr<v1::SwaDecodeIndexResponse> SwaDecodeIndex(
      const v1::SwaDecodeIndexRequest& r);
  absl::StatusOr<v1::PrefillIndexResponse> PrefillIndex(
      const v1::PrefillIndexRequest& r);
  absl::StatusOr<v1::StatsResponse> Stats();
  absl::Status Ping();
  absl::Status KeepAlive();

 private:
  KVCacheClient(const ClientOptions& options, std::string target,
                std::shared_ptr<grpc::Channel> channel,
                std::shared_ptr<std::string> session_id,
                std::unique_ptr<CompanionConnection> companion);
  void KeepAliveLoop(absl::Duration period);
  // Opens the TcpSessions stream and reads its first event.
  absl::Status OpenTcpSession();

  const ClientOptions options_;
  const std::string target_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KVCache::Stub> stub_;
  // Set when options_.reply_spin > 0.
  std::unique_ptr<ReplyPoller> poller_;
  // Shared with the channel's interceptor; set before any call but
  // OpenSession, never changed after.
  std::shared_ptr<std::string> session_id_;
  std::unique_ptr<CompanionConnection> companion_;
  // A TCP session stream: the session lives until it is cancelled.
  std::unique_ptr<v1::TcpSessions::Stub> tcp_sessions_;
  std::unique_ptr<grpc::ClientContext> tcp_session_ctx_;
  std::unique_ptr<grpc::ClientReader<v1::SessionEvent>> tcp_session_;
  uint64_t tcp_session_number_ = 0;
  std::string tls_subject_;

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<PoolMapping>> pools_
      ABSL_GUARDED_BY(mu_);  // key: pool name
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread keep_alive_;
};

// The payload holding the serialized google.rpc.Status of a failed call's
// details (e.g. a google.rpc.BadRequest naming the bad field).
inline constexpr char kGrpcStatusDetailsUrl[] =
    "type.googleapis.com/google.rpc.Status";

// grpc -> absl status (the codes share their numbering); the status
// details, when any, travel as the kGrpcStatusDetailsUrl payload.
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace kvdepot

#endif  // KVDEPOT_CLIENT_KVDEPOT_CLIENT_H_
