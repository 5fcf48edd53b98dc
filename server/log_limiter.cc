#include "server/log_limiter.h"

#include <algorithm>
#include <array>

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

bool LogRateLimiter::Admit(absl::Time now) {
  const int64_t rate = per_second_.load(std::memory_order_relaxed);
  if (rate == 0) return true;
  const double capacity = static_cast<double>(rate);
  absl::MutexLock lock(&mu_);
  if (last_ != absl::InfinitePast() && now > last_) {
    tokens_ = std::min(capacity,
                       tokens_ + absl::ToDoubleSeconds(now - last_) * capacity);
  }
  if (now > last_) last_ = now;
  if (tokens_ >= 1.0) {
    tokens_ -= 1.0;
    return true;
  }
  CountDroppedLocked(now);
  return false;
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
      "failed_call", "client_event", "refused_connection"};
  const int k = static_cast<int>(kind);
  return k >= 0 && k < kNumClientLogKinds ? kNames[k] : "unknown";
}

void SetClientLogRate(int64_t lines_per_second) {
  for (LogRateLimiter& l : Limiters()) l.SetRate(lines_per_second);
}

bool AdmitClientLog(ClientLog kind) {
  return Limiters()[static_cast<int>(kind)].Admit(absl::Now());
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
