// kvdepot.v1.TcpSessions: the sessions of TCP clients (SPEC §11). A session
// lives exactly as long as its Open stream; its identity is the mutual-TLS
// client certificate's subject (TlsPeerSubject), or anonymous on plain
// loopback TCP (granted only what the config grants anonymous callers).
//
// gRPC's callback API: an open stream holds no thread, so however many
// sessions clients keep open, the daemon's threads stay bounded (the
// session limits bound the streams).
#ifndef KVDEPOT_SERVER_SERVICE_TCP_SESSION_H_
#define KVDEPOT_SERVER_SERVICE_TCP_SESSION_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "kvdepot/v1/kvdepot.grpc.pb.h"
#include "server/metrics.h"
#include "server/sessions.h"

namespace kvdepot {

class TcpSessionService final : public v1::TcpSessions::CallbackService {
 public:
  // `accepting` false (draining) refuses new sessions with UNAVAILABLE;
  // null = always. `metrics` (may be null) counts refusals by limit.
  TcpSessionService(SessionManager* sessions, std::function<bool()> accepting,
                    ServerMetrics* metrics);
  TcpSessionService(const TcpSessionService&) = delete;
  TcpSessionService& operator=(const TcpSessionService&) = delete;
  ~TcpSessionService() override;  // REQUIRES: the server has stopped.

  grpc::ServerWriteReactor<v1::SessionEvent>* Open(
      grpc::CallbackServerContext* ctx,
      const v1::OpenSessionRequest* request) override;

  // Refuses new streams and ends every open one with UNAVAILABLE (their
  // sessions end). Call before shutting the gRPC server down: an open
  // stream would otherwise hold the shutdown until its deadline.
  void EndAll();
  // Streams open now.
  int64_t open_streams() const;

 private:
  class Stream;
  // False once EndAll ran.
  bool Add(Stream* s);
  void Remove(Stream* s);

  SessionManager* const sessions_;
  const std::function<bool()> accepting_;
  ServerMetrics* const metrics_;
  mutable absl::Mutex mu_;
  bool ending_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<Stream*> streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_SERVICE_TCP_SESSION_H_
