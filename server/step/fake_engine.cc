#include "server/step/fake_engine.h"

#include <utility>

namespace kvdepot::step {

FakeEngine::FakeEngine(CompletionFn done, bool auto_finish)
    : done_(std::move(done)), auto_finish_(auto_finish) {
  if (auto_finish_) thread_ = std::thread([this] { Loop(); });
}

FakeEngine::~FakeEngine() {
  {
    // Unreported steps are dropped: the registration that would hear of
    // them is being destroyed with this engine.
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    pending_.clear();
  }
  if (thread_.joinable()) thread_.join();
}

absl::Status FakeEngine::Enqueue(StepPlan plan) {
  absl::MutexLock lock(&mu_);
  pending_.push_back(plan.step_id);
  ++enqueued_;
  return absl::OkStatus();
}

void FakeEngine::Cancel() {
  absl::MutexLock lock(&mu_);
  ++cancels_;
}

bool FakeEngine::FinishOne() {
  StepOutcome o;
  {
    absl::MutexLock lock(&mu_);
    if (pending_.empty()) return false;
    o.step_id = pending_.front();
    pending_.pop_front();
  }
  done_(o);  // no engine lock held (step_engine.h)
  return true;
}

void FakeEngine::Loop() {
  while (true) {
    StepOutcome o;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](FakeEngine* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(e->mu_) {
            return e->stopping_ || !e->pending_.empty();
          },
          this));
      if (stopping_) return;
      o.step_id = pending_.front();
      pending_.pop_front();
    }
    done_(o);
  }
}

int64_t FakeEngine::enqueued() const {
  absl::MutexLock lock(&mu_);
  return enqueued_;
}

int64_t FakeEngine::cancels() const {
  absl::MutexLock lock(&mu_);
  return cancels_;
}

absl::StatusOr<std::unique_ptr<StepEngine>> FakeEngineFactory::Create(
    const RegistrationConfig&, CompletionFn done) {
  auto e = std::make_unique<FakeEngine>(std::move(done), auto_finish_);
  absl::MutexLock lock(&mu_);
  last_ = e.get();
  return e;
}

FakeEngine* FakeEngineFactory::last() const {
  absl::MutexLock lock(&mu_);
  return last_;
}

}  // namespace kvdepot::step
