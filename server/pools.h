// The daemon's pools: name -> layout + backend memory. The registry lock
// guards the map only; each pool has its own lock for its contents (stores
// take it exclusively, loads shared), so requests on different pools never
// wait on each other. A deleted pool stays alive until the requests that
// hold it finish.
//
// Each pool has an owner (the uid of the session that created it, or the
// TLS subject of a TCP session stream; the daemon's uid for config pools)
// and an access list (SPEC §11).
#ifndef KVDEPOT_SERVER_POOLS_H_
#define KVDEPOT_SERVER_POOLS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/format.h"
#include "kvdepot/v1/kvdepot.pb.h"
#include "server/access.h"
#include "server/backend/backend.h"
#include "server/memory_budget.h"

namespace kvdepot {

struct Pool {
  std::string name;
  std::string device;
  PoolLayout layout;
  uid_t owner_uid = 0;
  // Non-empty: the pool belongs to this TLS subject, not to owner_uid.
  std::string owner_tls_subject;
  v1::SharedHandle handle;  // legacy CUDA IPC only (--legacy_cuda_ipc)
  // The pool's bytes in the daemon's memory budget; before `memory`, so it
  // is given back after the memory is freed.
  MemoryReservation reservation;
  absl::Mutex mu;  // guards the pool's bytes (not the fields above)
  std::unique_ptr<Memory> memory ABSL_PT_GUARDED_BY(mu);
  mutable absl::Mutex acl_mu;
  Acl acl ABSL_GUARDED_BY(acl_mu);

  // Layout and device (and a legacy handle) as the wire reply.
  void ToProto(v1::PoolInfo* info) const;
  // OK when the caller may use the pool: its owner uid, an admin, or on its
  // access list. UNAUTHENTICATED without a session, else PERMISSION_DENIED
  // naming `field`.
  absl::Status CheckUse(const Caller& caller, absl::string_view field) const;
  // OK for the owner uid or an admin (delete, grant); `what` names the call.
  absl::Status CheckOwner(const Caller& caller, absl::string_view what) const;
  // RESOURCE_EXHAUSTED (and nothing granted) past the access list's
  // bounds (CheckGrantFits).
  absl::Status Grant(const Acl& grant);
};

// Fills the wire layout (format name and every size/stride).
void LayoutToProto(const PoolLayout& layout, v1::PoolLayout* out);

class PoolRegistry {
 public:
  // budget: what pools are admitted against (null = no admission, e.g.
  // device memory).
  PoolRegistry(Backend* backend, int64_t max_pool_bytes,
               MemoryBudget* budget = nullptr)
      : backend_(backend), max_pool_bytes_(max_pool_bytes), budget_(budget) {}

  // Validates the request (name, device, format, sizes), reserves its bytes
  // for `budget_client` in the memory budget ("" = the daemon's own) and
  // allocates the pool. ALREADY_EXISTS for a taken name; RESOURCE_EXHAUSTED
  // saying what is available when it does not fit the budget, or when
  // max_pools pools exist. `owner_tls_subject` (non-empty) makes a TLS
  // session's subject the owner instead of `owner_uid`.
  absl::StatusOr<std::shared_ptr<Pool>> Create(
      const v1::CreatePoolRequest& request, uid_t owner_uid,
      absl::string_view budget_client = "",
      absl::string_view owner_tls_subject = "");
  // The most pools at once (default 1024). REQUIRES: before any Create.
  void set_max_pools(int64_t n) { max_pools_ = n; }
  // NOT_FOUND naming `field` when there is no such pool.
  absl::StatusOr<std::shared_ptr<Pool>> Get(absl::string_view field,
                                            absl::string_view name) const;
  std::vector<std::shared_ptr<Pool>> List() const;  // sorted by name
  absl::Status Delete(absl::string_view name);
  void Clear();
  int64_t total_bytes() const;

 private:
  Backend* const backend_;
  const int64_t max_pool_bytes_;
  MemoryBudget* const budget_;
  // RESOURCE_EXHAUSTED (Limit::kPools) when max_pools_ pools exist.
  absl::Status CheckCountLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  int64_t max_pools_ = 1024;
  mutable absl::Mutex mu_;
  absl::btree_map<std::string, std::shared_ptr<Pool>> pools_
      ABSL_GUARDED_BY(mu_);
};

// Checks a pool name: 1..64 characters of [A-Za-z0-9_.-].
absl::Status ValidatePoolName(absl::string_view field, absl::string_view name);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_POOLS_H_
