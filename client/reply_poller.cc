#include "client/reply_poller.h"

#include <utility>

namespace kvdepot {
namespace {

// Reads the clock once every this many empty polls (a poll costs well
// under a microsecond; the clock is not free either).
constexpr int kPollsPerClockRead = 16;

// At most this many idle queues are kept; a burst of concurrent callers
// beyond it creates and drops queues.
constexpr size_t kMaxFreeQueues = 64;

void Drain(grpc::CompletionQueue* cq) {
  cq->Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq->Next(&tag, &ok)) {
  }
}

}  // namespace

ReplyPoller::~ReplyPoller() {
  absl::MutexLock lock(&mu_);
  for (std::unique_ptr<grpc::CompletionQueue>& cq : free_) Drain(cq.get());
}

void ReplyPoller::Await(grpc::CompletionQueue* cq) {
  void* tag = nullptr;
  bool ok = false;
  const gpr_timespec now = gpr_time_0(GPR_CLOCK_MONOTONIC);
  const absl::Time until = absl::Now() + spin_;
  for (int polls = 1;; ++polls) {
    if (cq->AsyncNext(&tag, &ok, now) == grpc::CompletionQueue::GOT_EVENT) {
      return;
    }
    if (polls % kPollsPerClockRead == 0 && absl::Now() >= until) break;
  }
  // A unary call's Finish always completes (its deadline, or the channel
  // shutting down, ends it), so this returns.
  cq->Next(&tag, &ok);
}

std::unique_ptr<grpc::CompletionQueue> ReplyPoller::Take() {
  {
    absl::MutexLock lock(&mu_);
    if (!free_.empty()) {
      std::unique_ptr<grpc::CompletionQueue> cq = std::move(free_.back());
      free_.pop_back();
      return cq;
    }
  }
  return std::make_unique<grpc::CompletionQueue>();
}

void ReplyPoller::Give(std::unique_ptr<grpc::CompletionQueue> cq) {
  {
    absl::MutexLock lock(&mu_);
    if (free_.size() < kMaxFreeQueues) {
      free_.push_back(std::move(cq));
      return;
    }
  }
  Drain(cq.get());
}

}  // namespace kvdepot
