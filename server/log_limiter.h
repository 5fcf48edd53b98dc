// Rate limits on the log lines clients can cause. Every client is untrusted:
// one that sends bad requests, or opens and closes sessions, in a tight loop
// would otherwise write a line per request (hundreds of bytes, tens of
// thousands a second) and fill the node's disk or the log pipeline, and bury
// everyone else's lines. Each kind of line has its own token bucket, so a
// flood of failed calls cannot hide sessions being opened, and the other way
// round. Lines over the rate are dropped and counted, and reported as a
// count every 10 s at most while they go on (ReportDroppedClientLogLines).
// The metrics still count every call (kvdepot_requests_total by code,
// kvdepot_rejections_total) and the drops (kvdepot_log_lines_dropped_total).
//
// Within a kind, each client (LogClient: a uid, a TLS subject, or one share
// for every caller that could not be identified) may take at most half of
// the kind's lines: a client flooding one kind uses up its own share, and
// the other half of the bucket stays for everyone else.
#ifndef KVDEPOT_SERVER_LOG_LIMITER_H_
#define KVDEPOT_SERVER_LOG_LIMITER_H_

#include <atomic>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvdepot {

// Who caused a line, for the clients' shares of LogRateLimiter. Only
// identities a client cannot make up name a share of their own: a peer's
// uid (from the kernel) and a TLS client certificate's subject (verified by
// the TLS handshake). Everything else (a call whose session did not
// authenticate, an anonymous session) is Unidentified: one share for all.
class LogClient {
 public:
  static LogClient Uid(uint32_t uid) {
    return LogClient((uint64_t{1} << 32) | uid);
  }
  // Subjects whose hashes collide share a share; nothing else follows.
  static LogClient TlsSubject(absl::string_view subject);
  static LogClient Unidentified() { return LogClient(0); }

  uint64_t key() const { return key_; }

 private:
  explicit LogClient(uint64_t key) : key_(key) {}
  uint64_t key_;  // 0: unidentified; bit 32 alone: a uid; bit 63: a subject
};

// A token bucket of `per_second` lines a second, holding at most one
// second's worth (a burst of `per_second` lines after a quiet second), and
// per client a bucket of ClientShare(per_second) lines a second, alike.
// `per_second` 0 = no limit. Thread-safe.
class LogRateLimiter {
 public:
  explicit LogRateLimiter(int64_t per_second = 0);

  // A client's lines a second: half the rate, at least 1.
  static int64_t ClientShare(int64_t per_second);
  // The most clients tracked at once. A new client past it, while every
  // tracked one has written within the last second, takes the
  // unidentified share.
  static constexpr int kMaxClients = 1024;

  // True when a line of `client` may be written at `now`: both the
  // limiter's bucket and the client's hold a line, and each gives one up.
  // False counts the line as dropped and takes nothing.
  bool Admit(absl::Time now, LogClient client);
  // Counts a line its writer dropped by a throttle of its own, as Admit
  // counts the ones it refuses.
  void CountDropped(absl::Time now);

  struct Dropped {
    int64_t lines = 0;                        // 0 = nothing to report
    absl::Time first = absl::InfinitePast();  // when the first was dropped
  };
  // The lines dropped since the last report, and starts counting afresh;
  // nothing (lines 0) when none were, or when the last report is less than
  // `min_interval` before `now`.
  Dropped TakeDropped(absl::Time now, absl::Duration min_interval);

  // Changes the rate (the bucket starts full).
  void SetRate(int64_t per_second);
  int64_t rate() const { return per_second_.load(std::memory_order_relaxed); }
  // Lines dropped since construction.
  int64_t dropped_total() const {
    return dropped_total_.load(std::memory_order_relaxed);
  }
  // Clients with a bucket now (at most kMaxClients + 1: the unidentified
  // share is always let in).
  int tracked_clients() const;

 private:
  struct Bucket {
    double tokens = 0;
    absl::Time last = absl::InfinitePast();
  };
  // Adds what the time since the bucket's last use earned (none when the
  // clock went back), at most `capacity`.
  static void Refill(Bucket& b, absl::Time now, double capacity);
  // The client's bucket (of ClientShare(rate)), created full; past
  // kMaxClients, after dropping the ones full again, the unidentified
  // share's.
  Bucket& ClientBucketLocked(absl::Time now, int64_t rate, LogClient client)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CountDroppedLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::atomic<int64_t> per_second_;
  std::atomic<int64_t> dropped_total_{0};
  mutable absl::Mutex mu_;
  Bucket all_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Bucket> clients_ ABSL_GUARDED_BY(mu_);
  int64_t unreported_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time first_unreported_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time last_report_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

// The kinds of lines a client can cause, each limited on its own.
enum class ClientLog {
  kFailedCall,         // an RPC or companion request that failed
  kClientEvent,        // sessions, companion requests, step rings and
                       // registrations opened or closed, Verify runs
  kRefusedConnection,  // a connection refused by a limit
  kGrpc,               // gRPC's own lines (a failed TLS handshake, bytes
                       // that are not HTTP/2): they name no client
  kCount,
};
inline constexpr int kNumClientLogKinds = static_cast<int>(ClientLog::kCount);
// "failed_call", "client_event", "refused_connection", "grpc".
const char* ClientLogName(ClientLog kind);

// The default of kvdepotd's --client_log_lines_per_second.
inline constexpr int64_t kDefaultClientLogLinesPerSecond = 20;

// Sets every kind's rate (lines a second; 0 = no limit). The process starts
// with kDefaultClientLogLinesPerSecond.
void SetClientLogRate(int64_t lines_per_second);

// True when a line of `kind` that `client` caused may be written now; the
// caller then writes it.
bool AdmitClientLog(ClientLog kind, LogClient client);

// How often at most the drops of one kind are reported while they go on.
inline constexpr absl::Duration kClientLogDropReportInterval =
    absl::Seconds(10);

// For each kind with lines dropped since its last report, at most once per
// `min_interval` per kind, writes one warn line: "log: N <kind> lines
// dropped since <time> (--client_log_lines_per_second=R)". The daemon calls
// it from its reaper (kClientLogDropReportInterval) and, with no interval,
// as it stops, so every drop is reported.
void ReportDroppedClientLogLines(
    absl::Duration min_interval = kClientLogDropReportInterval);

// Counts a line of `kind` that its writer dropped by a throttle of its own
// (GrpcListener's once-a-second refusal line, which keeps its own because
// it logs while the descriptor table may be full): reported and counted
// with the limiter's own drops.
void CountDroppedClientLog(ClientLog kind);

// Lines of `kind` dropped since the process started.
int64_t ClientLogLinesDropped(ClientLog kind);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_LOG_LIMITER_H_
