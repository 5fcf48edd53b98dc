// At most N concurrent uses of something per client (e.g. Verify streams:
// each holds a gRPC thread while it scans). A Slot is held for the use and
// given back when it is destroyed, however the use ends.
#ifndef KVDEPOT_SERVER_CLIENT_SLOTS_H_
#define KVDEPOT_SERVER_CLIENT_SLOTS_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/limits.h"

namespace kvdepot {

class ClientSlots {
 public:
  class Slot {
   public:
    Slot() = default;
    Slot(Slot&& other) noexcept;
    Slot& operator=(Slot&& other) noexcept;
    Slot(const Slot&) = delete;
    Slot& operator=(const Slot&) = delete;
    ~Slot();

   private:
    friend class ClientSlots;
    Slot(ClientSlots* owner, std::string client)
        : owner_(owner), client_(std::move(client)) {}
    void Reset();

    ClientSlots* owner_ = nullptr;  // null = holds nothing
    std::string client_;
  };

  // `max_per_client` <= 0: no limit. `limit` tags the refusal.
  ClientSlots(int64_t max_per_client, Limit limit)
      : max_per_client_(max_per_client), limit_(limit) {}
  ClientSlots(const ClientSlots&) = delete;
  ClientSlots& operator=(const ClientSlots&) = delete;

  // A slot of `client`, or RESOURCE_EXHAUSTED (tagged with the limit)
  // saying that `what` is at its limit for this client.
  absl::StatusOr<Slot> Acquire(absl::string_view client,
                               absl::string_view what);
  // Slots `client` holds now.
  int64_t InUse(absl::string_view client) const;

 private:
  void Release(const std::string& client);

  const int64_t max_per_client_;
  const Limit limit_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, int64_t> in_use_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_CLIENT_SLOTS_H_
