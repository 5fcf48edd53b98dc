// A bounded pool of worker threads for the calls that must not run on a
// gRPC thread (SPEC §11: no handler blocks a gRPC thread on GPU completion
// or on large CPU work). A fixed number of threads takes tasks from a
// bounded queue; when the queue is full TrySubmit refuses, so the caller
// can answer RESOURCE_EXHAUSTED instead of growing without bound.
#ifndef KVDEPOT_SERVER_WORKER_POOL_H_
#define KVDEPOT_SERVER_WORKER_POOL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvdepot {

class WorkerPool {
 public:
  // `threads` >= 1 workers, at most `max_queued` >= 1 tasks waiting.
  // `name` appears in thread names (pthread, 15 bytes at most).
  WorkerPool(std::string name, int threads, int max_queued);
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;
  // Shutdown().
  ~WorkerPool();

  // Queues `task`; false (and `task` dropped) when the queue is full or
  // the pool is shut down.
  bool TrySubmit(std::function<void()> task);

  // Runs every task already queued, then joins the threads. Idempotent.
  void Shutdown();

  // Tasks waiting (not running).
  int64_t queued() const;
  int threads() const { return static_cast<int>(threads_.size()); }

 private:
  void Loop();
  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !tasks_.empty();
  }

  const int max_queued_;
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_WORKER_POOL_H_
