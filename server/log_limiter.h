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
// The limit is per kind, not per client: a client flooding one kind thins
// out everyone's lines of that kind (the metrics keep them apart by code).
#ifndef KVDEPOT_SERVER_LOG_LIMITER_H_
#define KVDEPOT_SERVER_LOG_LIMITER_H_

#include <atomic>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvdepot {

// A token bucket of `per_second` lines a second, holding at most one
// second's worth (a burst of `per_second` lines after a quiet second).
// `per_second` 0 = no limit. Thread-safe.
class LogRateLimiter {
 public:
  explicit LogRateLimiter(int64_t per_second = 0);

  // True when a line may be written at `now`; false counts it as dropped.
  bool Admit(absl::Time now);
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

 private:
  void CountDroppedLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::atomic<int64_t> per_second_;
  std::atomic<int64_t> dropped_total_{0};
  absl::Mutex mu_;
  double tokens_ ABSL_GUARDED_BY(mu_);
  absl::Time last_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
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
  kCount,
};
inline constexpr int kNumClientLogKinds = static_cast<int>(ClientLog::kCount);
// "failed_call", "client_event", "refused_connection".
const char* ClientLogName(ClientLog kind);

// The default of kvdepotd's --client_log_lines_per_second.
inline constexpr int64_t kDefaultClientLogLinesPerSecond = 20;

// Sets every kind's rate (lines a second; 0 = no limit). The process starts
// with kDefaultClientLogLinesPerSecond.
void SetClientLogRate(int64_t lines_per_second);

// True when a line of `kind` may be written now; the caller then writes it.
bool AdmitClientLog(ClientLog kind);

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
