// The bytes of inline reply data (Load rows, cast-back rows, index
// outputs returned in the reply, Inspect records, Step.PlanStep plans)
// that the daemon holds until gRPC has sent them. A client that stops reading
// its replies would otherwise make the daemon hold every reply it asked for: 32
// calls per connection of up to
// --max_message_bytes each, over as many connections as it opens, enough to
// have the daemon OOM-killed. The bytes are admitted against a budget
// (--max_reply_bytes, per client --max_reply_bytes_per_client) before they
// are allocated, and given back when the call is done (sent, failed or
// cancelled); a call that does not fit gets RESOURCE_EXHAUSTED
// (limit_reply_bytes, limit_reply_bytes_per_client) and changes nothing.
//
// The serving layer (server/serving.h) opens a ReplyScope around each
// handler on the thread that runs it; handlers reserve through
// ReplyScope::Reserve where they allocate reply bytes, and the serving
// layer takes the reservations into the call, released when the call ends.
#ifndef KVDEPOT_SERVER_REPLY_SCOPE_H_
#define KVDEPOT_SERVER_REPLY_SCOPE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/memory_budget.h"

namespace kvdepot {

// The names a reply budget's refusals carry.
BudgetNames ReplyBudgetNames();

class ReplyScope {
 public:
  // Installs this scope on the calling thread for its lifetime (a null
  // budget admits everything). Scopes nest: the previous one comes back.
  explicit ReplyScope(MemoryBudget* budget);
  ReplyScope(const ReplyScope&) = delete;
  ReplyScope& operator=(const ReplyScope&) = delete;
  // Gives back what was reserved and not taken.
  ~ReplyScope();

  // The reservations made so far; they give their bytes back when
  // destroyed (the serving layer keeps them until the call is done).
  std::vector<MemoryReservation> Take();

  // Reserves `bytes` of reply for `client` (BudgetClientOf) in the
  // calling thread's scope; RESOURCE_EXHAUSTED naming `what` when they do
  // not fit. Without a scope (tools, tests, the step path's own replies)
  // admits everything.
  static absl::Status Reserve(absl::string_view client, int64_t bytes,
                              absl::string_view what);

 private:
  MemoryBudget* const budget_;
  ReplyScope* const previous_;
  std::vector<MemoryReservation> held_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_REPLY_SCOPE_H_
