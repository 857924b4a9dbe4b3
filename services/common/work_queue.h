// A bounded FIFO of tasks run by a fixed set of threads: where service adapters hand work off
// the gRPC threads (reactions never block). Submit fails instead of growing without bound.
//
//   WorkQueue q(/*threads=*/4, /*max_queued=*/256);
//   if (!q.Submit([=] { ... })) reply RESOURCE_EXHAUSTED;
#ifndef MOE_SERVICES_COMMON_WORK_QUEUE_H_
#define MOE_SERVICES_COMMON_WORK_QUEUE_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moe {

class WorkQueue {
 public:
  WorkQueue(int threads, size_t max_queued) : max_queued_(max_queued) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
  }
  // Runs what is queued, then joins.
  ~WorkQueue() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      cv_.notify_all();
    }
    for (std::thread& t : threads_) t.join();
  }
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  bool Submit(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || tasks_.size() >= max_queued_) return false;
    tasks_.push_back(std::move(task));
    cv_.notify_one();
    return true;
  }

  size_t queued() const {
    std::lock_guard<std::mutex> lock(mu_);
    return tasks_.size();
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  const size_t max_queued_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace moe

#endif  // MOE_SERVICES_COMMON_WORK_QUEUE_H_
