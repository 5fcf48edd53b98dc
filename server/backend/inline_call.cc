#include "server/backend/inline_call.h"

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace kvdepot {
namespace {

struct ThreadState {
  bool active = false;
  bool deferred = false;
};

thread_local ThreadState state;

}  // namespace

InlineCall::InlineCall() { state = ThreadState{.active = true}; }

InlineCall::~InlineCall() { state = ThreadState{}; }

bool InlineCall::deferred() const { return state.deferred; }

bool MayWait() { return !state.active; }

absl::Status DeferInlineCall(absl::string_view why) {
  if (!state.active) {
    return absl::InternalError(
        absl::StrCat("deferring a call that is not inline: ", why));
  }
  state.deferred = true;
  return absl::UnavailableError(
      absl::StrCat("deferred to a worker thread: ", why));
}

bool InlineCallDeferred() { return state.active && state.deferred; }

namespace {

// One thread running posted tasks in order. Never destroyed: tasks posted
// late in the process's life must not meet a joined thread.
class ReleaseThread {
 public:
  static ReleaseThread& Get() {
    static ReleaseThread* const t = new ReleaseThread();
    return *t;
  }

  void Post(std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    tasks_.push_back(std::move(task));
    ++posted_;
    work_.Signal();
  }

  uint64_t posted() {
    absl::MutexLock lock(&mu_);
    return posted_;
  }

  // Returns once the first n tasks have run.
  void WaitFor(uint64_t n) {
    absl::MutexLock lock(&mu_);
    while (done_ < n) ran_.Wait(&mu_);
  }

 private:
  ReleaseThread() {
    std::thread([this] { Loop(); }).detach();
  }

  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        absl::MutexLock lock(&mu_);
        while (tasks_.empty()) work_.Wait(&mu_);
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
      absl::MutexLock lock(&mu_);
      ++done_;
      ran_.SignalAll();
    }
  }

  absl::Mutex mu_;
  absl::CondVar work_;
  absl::CondVar ran_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  uint64_t posted_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t done_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

void RunOffInline(std::function<void()> task) {
  if (MayWait()) {
    task();
    return;
  }
  ReleaseThread::Get().Post(std::move(task));
}

void WaitForReleases() {
  ReleaseThread& t = ReleaseThread::Get();
  t.WaitFor(t.posted());
}

}  // namespace kvdepot
