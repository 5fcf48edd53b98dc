#include "server/descriptors.h"

#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/limits.h"

namespace kvdepot {
namespace {

// The kernel's ceiling for RLIMIT_NOFILE (an RLIM_INFINITY hard limit
// cannot be the soft one).
int64_t NrOpen() {
  std::ifstream in("/proc/sys/fs/nr_open");
  int64_t n = 0;
  if (in >> n && n > 0) return n;
  return 1 << 20;  // the kernel's default
}

}  // namespace

absl::StatusOr<DescriptorLimit> RaiseDescriptorLimit() {
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) != 0) {
    return absl::InternalError(
        absl::StrCat("getrlimit(RLIMIT_NOFILE): ", std::strerror(errno)));
  }
  DescriptorLimit out;
  const int64_t hard =
      r.rlim_max == RLIM_INFINITY ? NrOpen() : static_cast<int64_t>(r.rlim_max);
  out.soft_before =
      r.rlim_cur == RLIM_INFINITY ? hard : static_cast<int64_t>(r.rlim_cur);
  out.hard = hard;
  out.soft = out.soft_before;
  if (out.soft_before < hard) {
    rlimit raised = r;
    raised.rlim_cur = static_cast<rlim_t>(hard);
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) out.soft = hard;
  }
  return out;
}

int64_t DefaultDescriptorBudget(int64_t soft_limit) {
  const int64_t reserve =
      std::clamp<int64_t>(soft_limit / 4, int64_t{512}, int64_t{8192});
  return std::max<int64_t>(0, soft_limit - reserve);
}

DescriptorLease::DescriptorLease(DescriptorLease&& other) noexcept
    : budget_(std::move(other.budget_)) {}

DescriptorLease& DescriptorLease::operator=(DescriptorLease&& other) noexcept {
  if (this != &other) {
    if (budget_ != nullptr) budget_->Release();
    budget_ = std::move(other.budget_);
  }
  return *this;
}

DescriptorLease::~DescriptorLease() {
  if (budget_ != nullptr) budget_->Release();
}

std::shared_ptr<DescriptorBudget> DescriptorBudget::Create(int64_t limit) {
  return std::shared_ptr<DescriptorBudget>(
      new DescriptorBudget(std::max<int64_t>(0, limit)));
}

absl::StatusOr<DescriptorLease> DescriptorBudget::Acquire(
    absl::string_view field) {
  int64_t held = held_.load(std::memory_order_relaxed);
  do {
    if (held >= limit_) {
      return LimitExceeded(
          Limit::kDescriptors,
          absl::StrCat(field, ": the daemon already holds ", held,
                       " descriptors for pools and buffers, the most it may "
                       "(--max_descriptors = ",
                       limit_,
                       "; the rest of its RLIMIT_NOFILE is kept for "
                       "connections); release a buffer or pool first"));
    }
  } while (
      !held_.compare_exchange_weak(held, held + 1, std::memory_order_relaxed));
  return DescriptorLease(shared_from_this());
}

}  // namespace kvdepot
