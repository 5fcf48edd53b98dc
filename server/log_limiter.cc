#include "server/log_limiter.h"

#include <algorithm>

#include "spdlog/spdlog.h"

namespace kvdepot {

LogRateLimiter::LogRateLimiter(int64_t per_second)
    : per_second_(per_second), tokens_(static_cast<double>(per_second)) {}

void LogRateLimiter::SetRate(int64_t per_second) {
  absl::MutexLock lock(&mu_);
  per_second_.store(per_second, std::memory_order_relaxed);
  tokens_ = static_cast<double>(per_second);
  last_ = absl::InfinitePast();
}

LogRateLimiter::Decision LogRateLimiter::Admit(absl::Time now) {
  const int64_t rate = per_second_.load(std::memory_order_relaxed);
  Decision d;
  absl::MutexLock lock(&mu_);
  if (rate > 0) {
    const double capacity = static_cast<double>(rate);
    if (last_ != absl::InfinitePast() && now > last_) {
      tokens_ = std::min(
          capacity, tokens_ + absl::ToDoubleSeconds(now - last_) * capacity);
    }
    if (now > last_) last_ = now;
    if (tokens_ < 1.0) {
      if (dropped_since_written_ == 0) first_dropped_ = now;
      ++dropped_since_written_;
      dropped_total_.fetch_add(1, std::memory_order_relaxed);
      return d;
    }
    tokens_ -= 1.0;
  }
  d.write = true;
  d.dropped_before = dropped_since_written_;
  d.first_dropped = first_dropped_;
  dropped_since_written_ = 0;
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
  switch (kind) {
    case ClientLog::kFailedCall:
      return "failed_call";
    case ClientLog::kClientEvent:
      return "client_event";
    case ClientLog::kRefusedConnection:
      return "refused_connection";
    case ClientLog::kCount:
      break;
  }
  return "unknown";
}

void SetClientLogRate(int64_t lines_per_second) {
  for (LogRateLimiter& l : Limiters()) l.SetRate(lines_per_second);
}

bool AdmitClientLog(ClientLog kind) {
  LogRateLimiter& limiter = Limiters()[static_cast<int>(kind)];
  const LogRateLimiter::Decision d = limiter.Admit(absl::Now());
  if (d.write && d.dropped_before > 0) {
    spdlog::warn(
        "log: {} {} lines dropped since {} (--client_log_lines_per_second={})",
        d.dropped_before, ClientLogName(kind),
        absl::FormatTime(absl::RFC3339_sec, d.first_dropped,
                         absl::UTCTimeZone()),
        limiter.rate());
  }
  return d.write;
}

int64_t ClientLogLinesDropped(ClientLog kind) {
  return Limiters()[static_cast<int>(kind)].dropped_total();
}

}  // namespace kvdepot
