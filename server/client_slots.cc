#include "server/client_slots.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvdepot {

ClientSlots::Slot::Slot(Slot&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)),
      client_(std::move(other.client_)) {}

ClientSlots::Slot& ClientSlots::Slot::operator=(Slot&& other) noexcept {
  if (this != &other) {
    Reset();
    owner_ = std::exchange(other.owner_, nullptr);
    client_ = std::move(other.client_);
  }
  return *this;
}

ClientSlots::Slot::~Slot() { Reset(); }

void ClientSlots::Slot::Reset() {
  if (owner_ != nullptr) owner_->Release(client_);
  owner_ = nullptr;
}

absl::StatusOr<ClientSlots::Slot> ClientSlots::Acquire(absl::string_view client,
                                                       absl::string_view what) {
  absl::MutexLock lock(&mu_);
  int64_t& n = in_use_[client];
  if (max_per_client_ > 0 && n >= max_per_client_) {
    return LimitExceeded(
        limit_, absl::StrCat(what, ": this client already has ", n,
                             " running, the most one client may have (",
                             LimitName(limit_), " = ", max_per_client_, ")"));
  }
  ++n;
  return Slot(this, std::string(client));
}

int64_t ClientSlots::InUse(absl::string_view client) const {
  absl::MutexLock lock(&mu_);
  auto it = in_use_.find(client);
  return it == in_use_.end() ? 0 : it->second;
}

void ClientSlots::Release(const std::string& client) {
  absl::MutexLock lock(&mu_);
  auto it = in_use_.find(client);
  if (it == in_use_.end()) return;
  if (--it->second <= 0) in_use_.erase(it);
}

}  // namespace kvdepot
