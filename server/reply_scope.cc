#include "server/reply_scope.h"

#include <utility>

namespace kvdepot {
namespace {

thread_local ReplyScope* current_scope = nullptr;

}  // namespace

BudgetNames ReplyBudgetNames() {
  BudgetNames n;
  n.name = "budget for replies not yet sent";
  n.total = Limit::kReplyBytes;
  n.per_client = Limit::kReplyBytesPerClient;
  return n;
}

ReplyScope::ReplyScope(MemoryBudget* budget)
    : budget_(budget), previous_(current_scope) {
  current_scope = this;
}

ReplyScope::~ReplyScope() { current_scope = previous_; }

std::vector<MemoryReservation> ReplyScope::Take() {
  return std::exchange(held_, {});
}

absl::Status ReplyScope::Reserve(absl::string_view client, int64_t bytes,
                                 absl::string_view what) {
  ReplyScope* scope = current_scope;
  if (scope == nullptr || scope->budget_ == nullptr || bytes <= 0) {
    return absl::OkStatus();
  }
  absl::StatusOr<MemoryReservation> r =
      MemoryReservation::Open(scope->budget_, client, bytes, what);
  if (!r.ok()) return r.status();
  scope->held_.push_back(*std::move(r));
  return absl::OkStatus();
}

}  // namespace kvdepot
