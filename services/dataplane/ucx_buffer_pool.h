// The registered memory of one UCX worker (ucx_worker.h), private to the data plane: free
// buffers by power-of-two size class, each registered once with ucp_mem_map and reused, and the
// set of every registered buffer so that shutdown can undo each registration before UCX is
// cleaned up. UcxBuffer returns itself here when its last reference goes.
#ifndef MOE_SERVICES_DATAPLANE_UCX_BUFFER_POOL_H_
#define MOE_SERVICES_DATAPLANE_UCX_BUFFER_POOL_H_

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "services/dataplane/ucx_worker.h"

namespace moe::dataplane {

// Free registered buffers by size class. Mapping and unmapping run on the progress thread
// (post_), which owns every UCX call; once the worker is gone, buffers are only freed.
class UcxBufferPool {
 public:
  explicit UcxBufferPool(int per_class) : per_class_(per_class) {}

  UcxBuffer* Take(size_t cls) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& list = free_[cls];
    if (list.empty()) return nullptr;
    UcxBuffer* b = list.back();
    list.pop_back();
    return b;
  }

  void Release(UcxBuffer* b) {
    std::unique_lock<std::mutex> lock(mu_);
    auto& list = free_[b->capacity_];
    if (post_ && static_cast<int>(list.size()) < per_class_) {
      list.push_back(b);
      return;
    }
    if (post_) {
      auto post = post_;
      lock.unlock();
      post([b] { delete b; });  // unmapped by ~UcxBuffer on the progress thread
      return;
    }
    lock.unlock();
    b->memh_ = nullptr;  // the context is gone, and with it every registration
    delete b;
  }

  void SetPost(std::function<void(std::function<void()>)> post, ucp_context_h context) {
    std::lock_guard<std::mutex> lock(mu_);
    post_ = std::move(post);
    context_ = context;
  }

  void Track(UcxBuffer* b) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.insert(b);
  }
  void Untrack(UcxBuffer* b) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(b);
  }

  // Progress thread, at shutdown: unmaps every buffer (UCX must not be cleaned up with a
  // registration left; a buffer still held elsewhere stays readable memory) and frees the free
  // ones; pooling stops.
  void Drain() {
    std::map<size_t, std::vector<UcxBuffer*>> free;
    std::set<UcxBuffer*> live;
    {
      std::lock_guard<std::mutex> lock(mu_);
      free.swap(free_);
      live.swap(live_);
      post_ = nullptr;
    }
    for (UcxBuffer* b : live) {
      if (b->memh_ != nullptr) ucp_mem_unmap(context_, static_cast<ucp_mem_h>(b->memh_));
      b->memh_ = nullptr;
      registered.fetch_sub(1);
    }
    for (auto& [cls, list] : free) {
      for (UcxBuffer* b : list) delete b;
    }
  }

  ucp_context_h context() const { return context_; }
  std::atomic<int64_t> registered{0};

 private:
  const int per_class_;
  std::mutex mu_;
  std::map<size_t, std::vector<UcxBuffer*>> free_;
  std::set<UcxBuffer*> live_;  // every registered buffer, pooled or in use
  std::function<void(std::function<void()>)> post_;
  ucp_context_h context_ = nullptr;
};

}  // namespace moe::dataplane

#endif  // MOE_SERVICES_DATAPLANE_UCX_BUFFER_POOL_H_
