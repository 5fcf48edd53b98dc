// A StepEngine without a GPU for tests and the CPU benchmark: it records
// how many steps were enqueued and, with auto_finish, reports each one
// finished from its own thread right after Enqueue (the registry holds
// the registration's lock in Enqueue, so the report cannot run there).
// Without auto_finish steps stay in flight until FinishOne().
#ifndef KVDEPOT_SERVER_STEP_FAKE_ENGINE_H_
#define KVDEPOT_SERVER_STEP_FAKE_ENGINE_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/step/step_engine.h"

namespace kvdepot::step {

class FakeEngine final : public StepEngine {
 public:
  FakeEngine(CompletionFn done, bool auto_finish);
  // Drops the steps not reported yet and joins its thread.
  ~FakeEngine() override;

  absl::Status Enqueue(StepPlan plan) override;
  void Cancel() override;

  // Reports the oldest unfinished step finished (false: none).
  // REQUIRES: !auto_finish.
  bool FinishOne();
  int64_t enqueued() const;
  int64_t cancels() const;

 private:
  void Loop();

  const CompletionFn done_;
  const bool auto_finish_;
  mutable absl::Mutex mu_;
  std::deque<uint64_t> pending_ ABSL_GUARDED_BY(mu_);  // step ids
  int64_t enqueued_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t cancels_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // auto_finish only
};

class FakeEngineFactory final : public StepEngineFactory {
 public:
  explicit FakeEngineFactory(bool auto_finish) : auto_finish_(auto_finish) {}
  absl::StatusOr<std::unique_ptr<StepEngine>> Create(
      const RegistrationConfig& config, CompletionFn done) override;
  // The engine created last (null before the first); it lives as long as
  // its registration.
  FakeEngine* last() const;

 private:
  const bool auto_finish_;
  mutable absl::Mutex mu_;
  FakeEngine* last_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_FAKE_ENGINE_H_
