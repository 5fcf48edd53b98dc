// The daemon's file descriptors (SPEC §11, docs/DAEMON.md "Limits").
//
// gRPC 1.51 stops accepting on a listener for good once accept4() fails
// with EMFILE (tcp_server_posix logs "Failed accept4" and drops it): a
// daemon that runs out of descriptors once is unreachable until it is
// restarted. So clients may never use them up:
// - at start the daemon raises its soft RLIMIT_NOFILE to the hard limit
//   (RaiseDescriptorLimit);
// - what a client can make the daemon hold in numbers, the memfd of every
//   CPU pool and buffer (allocated or imported), is admitted against a
//   DescriptorBudget below that limit (RESOURCE_EXHAUSTED, limit
//   "descriptors"); the rest is bounded by count (companion connections,
//   step rings, the metrics endpoint's connections) and fits in what the
//   budget leaves for connections and the runtime.
#ifndef KVDEPOT_SERVER_DESCRIPTORS_H_
#define KVDEPOT_SERVER_DESCRIPTORS_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvdepot {

struct DescriptorLimit {
  int64_t soft_before = 0;  // the soft limit the daemon started with
  int64_t soft = 0;         // after raising it
  int64_t hard = 0;
};

// Sets the soft RLIMIT_NOFILE to the hard one (an unlimited hard limit:
// to the kernel's nr_open) and returns both. INTERNAL when getrlimit
// fails; when setrlimit fails, the limit unchanged.
absl::StatusOr<DescriptorLimit> RaiseDescriptorLimit();

// The default budget for a soft limit: all but a reserve of a quarter of
// it, at least 512 and at most 8192, kept for connections (gRPC,
// companion, metrics), step rings and the runtime (logs, CUDA, gRPC's
// wake-up descriptors). 0 when the limit leaves nothing.
int64_t DefaultDescriptorBudget(int64_t soft_limit);

class DescriptorBudget;

// One admitted descriptor, given back when destroyed. Move-only.
class DescriptorLease {
 public:
  DescriptorLease() = default;
  DescriptorLease(DescriptorLease&& other) noexcept;
  DescriptorLease& operator=(DescriptorLease&& other) noexcept;
  DescriptorLease(const DescriptorLease&) = delete;
  DescriptorLease& operator=(const DescriptorLease&) = delete;
  ~DescriptorLease();

 private:
  friend class DescriptorBudget;
  explicit DescriptorLease(std::shared_ptr<DescriptorBudget> budget)
      : budget_(std::move(budget)) {}
  std::shared_ptr<DescriptorBudget> budget_;
};

// Admission of long-lived descriptors against a fixed number. Thread-safe.
class DescriptorBudget : public std::enable_shared_from_this<DescriptorBudget> {
 public:
  // `limit` >= 0 descriptors may be held at once.
  static std::shared_ptr<DescriptorBudget> Create(int64_t limit);

  // One more held, or RESOURCE_EXHAUSTED (tagged Limit::kDescriptors)
  // naming `field` when `limit` are held already.
  absl::StatusOr<DescriptorLease> Acquire(absl::string_view field);

  int64_t held() const { return held_.load(std::memory_order_relaxed); }
  int64_t limit() const { return limit_; }

 private:
  friend class DescriptorLease;
  explicit DescriptorBudget(int64_t limit) : limit_(limit) {}
  void Release() { held_.fetch_sub(1, std::memory_order_relaxed); }

  const int64_t limit_;
  std::atomic<int64_t> held_{0};
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_DESCRIPTORS_H_
