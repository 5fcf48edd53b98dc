#include "server/log_limiter.h"

#include <algorithm>
#include <array>

#include "absl/hash/hash.h"
#include "spdlog/spdlog.h"

namespace kvdepot {

LogClient LogClient::TlsSubject(absl::string_view subject) {
  return LogClient(absl::HashOf(subject) | (uint64_t{1} << 63));
}

LogRateLimiter::LogRateLimiter(int64_t per_second) : per_second_(per_second) {
  all_.tokens = static_cast<double>(per_second);
}

int64_t LogRateLimiter::ClientShare(int64_t per_second) {
  return std::max<int64_t>(1, per_second / 2);
}

void LogRateLimiter::SetRate(int64_t per_second) {
  absl::MutexLock lock(&mu_);
  per_second_.store(per_second, std::memory_order_relaxed);
  all_ = Bucket{static_cast<double>(per_second)};
  clients_.clear();
}

void LogRateLimiter::Refill(Bucket& b, absl::Time now, double capacity) {
  if (b.last != absl::InfinitePast() && now > b.last) {
    b.tokens = std::min(
        capacity, b.tokens + absl::ToDoubleSeconds(now - b.last) * capacity);
  }
  if (now > b.last) b.last = now;
}

LogRateLimiter::Bucket& LogRateLimiter::ClientBucketLocked(absl::Time now,
                                                           int64_t rate,
                                                           LogClient client) {
  const double share = static_cast<double>(ClientShare(rate));
  uint64_t key = client.key();
  if (!clients_.contains(key) && key != 0 &&
      static_cast<int>(clients_.size()) >= kMaxClients) {
    // A bucket idle for a second is full again: the same as a new one.
    absl::erase_if(clients_, [&](const auto& entry) {
      return entry.first != 0 && now - entry.second.last >= absl::Seconds(1);
    });
    if (static_cast<int>(clients_.size()) >= kMaxClients) key = 0;
  }
  const auto [it, added] = clients_.try_emplace(key, Bucket{share, now});
  if (!added) Refill(it->second, now, share);
  return it->second;
}

bool LogRateLimiter::Admit(absl::Time now, LogClient client) {
  const int64_t rate = per_second_.load(std::memory_order_relaxed);
  if (rate == 0) return true;
  absl::MutexLock lock(&mu_);
  Refill(all_, now, static_cast<double>(rate));
  Bucket& mine = ClientBucketLocked(now, rate, client);
  if (all_.tokens >= 1.0 && mine.tokens >= 1.0) {
    all_.tokens -= 1.0;
    mine.tokens -= 1.0;
    return true;
  }
  CountDroppedLocked(now);
  return false;
}

int LogRateLimiter::tracked_clients() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(clients_.size());
}

void LogRateLimiter::CountDropped(absl::Time now) {
  absl::MutexLock lock(&mu_);
  CountDroppedLocked(now);
}

void LogRateLimiter::CountDroppedLocked(absl::Time now) {
  if (unreported_ == 0) first_unreported_ = now;
  ++unreported_;
  dropped_total_.fetch_add(1, std::memory_order_relaxed);
}

LogRateLimiter::Dropped LogRateLimiter::TakeDropped(
    absl::Time now, absl::Duration min_interval) {
  absl::MutexLock lock(&mu_);
  Dropped d;
  if (unreported_ == 0 || now - last_report_ < min_interval) return d;
  d.lines = unreported_;
  d.first = first_unreported_;
  unreported_ = 0;
  last_report_ = now;
  return d;
}

namespace {

std::array<LogRateLimiter, kNumClientLogKinds>& Limiters() {
  static auto* limiters = [] {
    auto* l = new std::array<LogRateLimiter, kNumClientLogKinds>();
    for (LogRateLimiter& one : *l) {
      one.SetRate(kDefaultClientLogLinesPerSecond);
    }
    return l;
  }();
  return *limiters;
}

}  // namespace

const char* ClientLogName(ClientLog kind) {
  static constexpr const char* kNames[kNumClientLogKinds] = {
      "failed_call", "client_event", "refused_connection", "grpc"};
  const int k = static_cast<int>(kind);
  return k >= 0 && k < kNumClientLogKinds ? kNames[k] : "unknown";
}

void SetClientLogRate(int64_t lines_per_second) {
  for (LogRateLimiter& l : Limiters()) l.SetRate(lines_per_second);
}

bool AdmitClientLog(ClientLog kind, LogClient client) {
  return Limiters()[static_cast<int>(kind)].Admit(absl::Now(), client);
}

void CountDroppedClientLog(ClientLog kind) {
  Limiters()[static_cast<int>(kind)].CountDropped(absl::Now());
}

void ReportDroppedClientLogLines(absl::Duration min_interval) {
  const absl::Time now = absl::Now();
  for (int k = 0; k < kNumClientLogKinds; ++k) {
    LogRateLimiter& limiter = Limiters()[k];
    const LogRateLimiter::Dropped d = limiter.TakeDropped(now, min_interval);
    if (d.lines == 0) continue;
    spdlog::warn(
        "log: {} {} lines dropped since {} (--client_log_lines_per_second={})",
        d.lines, ClientLogName(static_cast<ClientLog>(k)),
        absl::FormatTime(absl::RFC3339_sec, d.first, absl::UTCTimeZone()),
        limiter.rate());
  }
}

int64_t ClientLogLinesDropped(ClientLog kind) {
  return Limiters()[static_cast<int>(kind)].dropped_total();
}

}  // namespace kvdepot
