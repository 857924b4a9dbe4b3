#include "services/common/thread_pool.h"

#include <pthread.h>

#include "services/common/cpus.h"

namespace moe {

ThreadPool::ThreadPool(int threads, const char* name) {
  // 0: the CPUs this process may use (its affinity and cgroup quota, not the machine's cores).
  if (threads <= 0) threads = UsableCpus();
  for (int i = 1; i < threads; ++i) {
    workers_.emplace_back([this, name] {
      pthread_setname_np(pthread_self(), name);  // longer than 15 characters: left unnamed
      WorkerLoop();
    });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunItems() {
  for (int64_t i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) (*fn_)(i);
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    RunItems();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--active_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  // Callers from several threads take turns (the pool runs one ParallelFor at a time).
  std::lock_guard<std::mutex> turn(call_mu_);
  RunLocked(n, fn);
}

bool ThreadPool::TryParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return true;
  if (workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return true;
  }
  std::unique_lock<std::mutex> turn(call_mu_, std::try_to_lock);
  if (!turn.owns_lock()) return false;
  RunLocked(n, fn);
  return true;
}

void ThreadPool::RunLocked(int64_t n, const std::function<void(int64_t)>& fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    active_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  start_cv_.notify_all();
  RunItems();
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return active_ == 0; });
  fn_ = nullptr;
}

}  // namespace moe
