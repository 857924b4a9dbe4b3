// A fixed pool of worker threads (the CPU kernels; the payload MAC of large messages).
// ParallelFor hands out item indices dynamically; the calling thread works too. Every item is
// computed by exactly one thread with a fixed internal order, so results never depend on the
// thread count.
//
//   ThreadPool pool(2);
//   pool.ParallelFor(num_tiles, [&](int64_t tile) { ... });
#ifndef MOE_SERVICES_COMMON_THREAD_POOL_H_
#define MOE_SERVICES_COMMON_THREAD_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moe {

class ThreadPool {
 public:
  // threads <= 0: one per CPU this process may use (services/common/cpus.h: affinity, cgroup
  // quota). The threads - 1 workers carry `name` (at most 15 characters: top -H, profilers and
  // tests read it from /proc/<pid>/task/<tid>/comm).
  explicit ThreadPool(int threads, const char* name = "moe-pool");
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // Runs fn(i) for i in [0, n) and returns when all are done. Calls from several threads take
  // turns; a call from inside fn deadlocks (not reentrant).
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);
  // ParallelFor, unless another call holds the pool: then nothing runs and it returns false (the
  // caller does the work itself rather than wait its turn).
  bool TryParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  void WorkerLoop();
  void RunItems();
  void RunLocked(int64_t n, const std::function<void(int64_t)>& fn);  // holds call_mu_

  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // one ParallelFor at a time
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  uint64_t generation_ = 0;
  int active_ = 0;
  bool stop_ = false;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
};

}  // namespace moe

#endif  // MOE_SERVICES_COMMON_THREAD_POOL_H_
