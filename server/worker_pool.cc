#include "server/worker_pool.h"

#include <pthread.h>

#include <algorithm>
#include <utility>

namespace kvdepot {

WorkerPool::WorkerPool(std::string name, int threads, int max_queued)
    : max_queued_(std::max(1, max_queued)) {
  const int n = std::max(1, threads);
  threads_.reserve(static_cast<size_t>(n));
  name.resize(std::min<size_t>(name.size(), 15));
  for (int i = 0; i < n; ++i) {
    threads_.emplace_back([this] { Loop(); });
    pthread_setname_np(threads_.back().native_handle(), name.c_str());
  }
}

WorkerPool::~WorkerPool() { Shutdown(); }

bool WorkerPool::TrySubmit(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  if (stopping_ || static_cast<int64_t>(tasks_.size()) >= max_queued_) {
    return false;
  }
  tasks_.push_back(std::move(task));
  return true;
}

int64_t WorkerPool::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(tasks_.size());
}

void WorkerPool::Loop() {
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &WorkerPool::Ready));
      if (tasks_.empty()) return;  // stopping, nothing left
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

void WorkerPool::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) {
    if (t.joinable() && t.get_id() != std::this_thread::get_id()) t.join();
  }
}

}  // namespace kvdepot
