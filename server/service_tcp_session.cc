#include "server/service_tcp_session.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/limits.h"
#include "server/log_limiter.h"
#include "server/logging.h"
#include "server/tls.h"
#include "spdlog/spdlog.h"

namespace kvdepot {

// One Open call: opens the session, writes its first event, then waits for
// the call to end (cancelled by the client, the connection lost, EndAll).
class TcpSessionService::Stream final
    : public grpc::ServerWriteReactor<v1::SessionEvent> {
 public:
  Stream(TcpSessionService* service, grpc::CallbackServerContext* ctx,
         const v1::OpenSessionRequest& request)
      : service_(service), log_client_(LogClient::Unidentified()) {
    const std::string subject = TlsPeerSubject(*ctx);
    // Plain loopback TCP has no subject: anonymous, the unidentified share.
    if (!subject.empty()) log_client_ = LogClient::TlsSubject(subject);
    absl::Status status;
    if (!service_->Add(this)) {
      status = absl::UnavailableError(
          "kvdepot is draining (shutting down): no new sessions");
    } else {
      added_ = true;
      absl::StatusOr<OpenedSession> opened =
          service_->sessions_->OpenStream(request.client_name(), subject);
      if (opened.ok()) {
        number_ = opened->number;
        event_.set_session_id(opened->id);
        event_.set_session_number(opened->number);
        event_.set_tls_subject(subject);
      } else {
        status = opened.status();
      }
    }
    if (!status.ok()) {
      if (std::optional<Limit> limit = LimitOf(status);
          limit.has_value() && service_->metrics_ != nullptr) {
        service_->metrics_->RecordLimit(*limit);
      }
      if (AdmitClientLog(ClientLog::kFailedCall, log_client_)) {
        spdlog::info(
            "rpc=TcpSessions.Open tls_subject=\"{}\" status={} error=\"{}\"",
            EscapeForLog(subject), absl::StatusCodeToString(status.code()),
            EscapeForLog(status.message()));
      }
      End(grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                       std::string(status.message())));
      return;
    }
    if (AdmitClientLog(ClientLog::kClientEvent, log_client_)) {
      spdlog::info(
          "rpc=TcpSessions.Open session={} tls_subject=\"{}\" client=\"{}\" "
          "status=OK",
          number_, EscapeForLog(subject), EscapeForLog(request.client_name()));
    }
    absl::MutexLock lock(&mu_);
    if (finish_wanted_) return;  // EndAll came first: no event
    writing_ = true;
    StartWrite(&event_);
  }

  // Ends the stream with `status` (once; after a pending write).
  void End(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    if (finish_wanted_) return;
    finish_wanted_ = true;
    finish_status_ = std::move(status);
    if (!writing_) Finish(finish_status_);
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    event_.clear_session_id();  // the secret is not kept around
    if (finish_wanted_) {
      Finish(finish_status_);
    } else if (!ok) {
      finish_wanted_ = true;
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "the session event could not be sent"));
    }
  }

  // The client cancelled or the connection is gone: the session ends now.
  void OnCancel() override {
    CloseSession("cancelled");
    End(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    CloseSession("done");
    if (added_) service_->Remove(this);
    delete this;
  }

 private:
  void CloseSession(const char* why) {
    uint64_t number;
    {
      absl::MutexLock lock(&mu_);
      number = number_;
      number_ = 0;
    }
    if (number == 0) return;
    const int64_t n = service_->sessions_->CloseNumber(number);
    if (AdmitClientLog(ClientLog::kClientEvent, log_client_)) {
      spdlog::info(
          "rpc=TcpSessions.close session={} reason={} status=OK "
          "buffers_released={}",
          number, why, n);
    }
  }

  TcpSessionService* const service_;
  LogClient log_client_;  // whose share of the log lines this stream's take
  bool added_ = false;    // in service_->streams_
  absl::Mutex mu_;
  uint64_t number_ ABSL_GUARDED_BY(mu_) = 0;  // 0 = no session (any more)
  v1::SessionEvent event_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_wanted_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status finish_status_ ABSL_GUARDED_BY(mu_);
};

TcpSessionService::TcpSessionService(SessionManager* sessions,
                                     std::function<bool()> accepting,
                                     ServerMetrics* metrics)
    : sessions_(sessions),
      accepting_(std::move(accepting)),
      metrics_(metrics) {}

TcpSessionService::~TcpSessionService() = default;

grpc::ServerWriteReactor<v1::SessionEvent>* TcpSessionService::Open(
    grpc::CallbackServerContext* ctx, const v1::OpenSessionRequest* request) {
  return new Stream(this, ctx, *request);
}

bool TcpSessionService::Add(Stream* s) {
  absl::MutexLock lock(&mu_);
  if (ending_ || (accepting_ && !accepting_())) return false;
  streams_.insert(s);
  return true;
}

void TcpSessionService::Remove(Stream* s) {
  absl::MutexLock lock(&mu_);
  streams_.erase(s);
}

void TcpSessionService::EndAll() {
  absl::MutexLock lock(&mu_);
  ending_ = true;
  // A stream leaves streams_ only in its OnDone (after Finish, run by
  // gRPC's callback threads, never inside End), so every one is alive here.
  for (Stream* s : streams_) {
    s->End(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "kvdepot is shutting down: the session ended"));
  }
}

int64_t TcpSessionService::open_streams() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(streams_.size());
}

}  // namespace kvdepot
