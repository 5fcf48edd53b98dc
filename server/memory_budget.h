// The byte budget that pools and buffers, the daemon's own and imported
// ones, are admitted against (SPEC §11): a pool or buffer that does not fit
// fails at creation with RESOURCE_EXHAUSTED saying how much is available, so
// nothing can SIGBUS or OOM-kill the daemon later.
//
// The default comes from where the daemon runs, first match wins:
//   cgroup v2  memory.max - memory.current (the tightest level from the
//              daemon's cgroup up to the root);
//   cgroup v1  memory.limit_in_bytes - memory.usage_in_bytes (likewise);
//   else       MemAvailable of /proc/meminfo.
// The files are read under a root given by a flag, so tests feed their own.
#ifndef KVDEPOT_SERVER_MEMORY_BUDGET_H_
#define KVDEPOT_SERVER_MEMORY_BUDGET_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/limits.h"

namespace kvdepot {

struct SystemMemoryFiles {
  std::string cgroup_root = "/sys/fs/cgroup";  // cgroup mounts
  std::string self_cgroup = "/proc/self/cgroup";
  std::string meminfo = "/proc/meminfo";
};

struct AvailableMemory {
  int64_t bytes = 0;
  std::string source;  // where the figure comes from, for messages and logs
};

// What the daemon may still allocate, read from `files` (see above).
// INTERNAL only when none of the three sources can be read.
absl::StatusOr<AvailableMemory> ReadAvailableMemory(
    const SystemMemoryFiles& files);

// What a budget is called in its refusals, and the limits it tags them
// with (server/limits.h).
struct BudgetNames {
  std::string name = "memory budget";
  Limit total = Limit::kMemoryBudget;
  Limit per_client = Limit::kMemoryPerClient;
};

// Admission against a fixed total (the available memory at start, or a
// flag), globally and per client. Thread-safe.
class MemoryBudget {
 public:
  // total: bytes all reservations together may hold; per_client: the most
  // one client may hold (0 = no per-client cap). source: for messages.
  MemoryBudget(int64_t total, int64_t per_client, std::string source,
               BudgetNames names = {});

  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  // Reserves `bytes` for `client` ("" = the daemon itself, e.g. pools from
  // the config). RESOURCE_EXHAUSTED naming `what`, the size and what is
  // available when it does not fit; INVALID_ARGUMENT for bytes < 0.
  absl::Status Reserve(absl::string_view client, int64_t bytes,
                       absl::string_view what);
  // Gives back a reservation made by Reserve (same client and bytes).
  void Release(absl::string_view client, int64_t bytes);

  int64_t total() const { return total_; }
  const std::string& source() const { return source_; }
  int64_t used() const;
  int64_t used_by(absl::string_view client) const;

 private:
  const int64_t total_;
  const int64_t per_client_;
  const std::string source_;
  const BudgetNames names_;
  mutable absl::Mutex mu_;
  int64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, int64_t> by_client_ ABSL_GUARDED_BY(mu_);
};

// Bytes held in a MemoryBudget for as long as this object lives: it sits
// in the Pool or Buffer whose memory it admits (declared before the memory,
// so it is given back after the memory is freed), so every path that frees
// the object gives the bytes back. Move-only; an empty reservation (no
// budget, e.g. device memory) holds nothing.
class MemoryReservation {
 public:
  MemoryReservation() = default;
  // Reserves `bytes` for `client` in `budget` (see MemoryBudget::Reserve);
  // a null budget admits everything and holds nothing.
  static absl::StatusOr<MemoryReservation> Open(MemoryBudget* budget,
                                                absl::string_view client,
                                                int64_t bytes,
                                                absl::string_view what);
  MemoryReservation(MemoryReservation&& other) noexcept;
  MemoryReservation& operator=(MemoryReservation&& other) noexcept;
  MemoryReservation(const MemoryReservation&) = delete;
  MemoryReservation& operator=(const MemoryReservation&) = delete;
  ~MemoryReservation() { Reset(); }

  void Reset();  // gives the bytes back now
  int64_t bytes() const { return bytes_; }

 private:
  MemoryBudget* budget_ = nullptr;  // null = holds nothing
  std::string client_;
  int64_t bytes_ = 0;
};

// "1.5 GiB" style sizes for messages.
std::string HumanBytes(int64_t bytes);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_MEMORY_BUDGET_H_
