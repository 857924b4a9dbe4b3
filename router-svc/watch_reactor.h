// A server-streaming watch of router-svc (WatchPlacement, WatchBias): Push queues a message
// (called with the router's mutex held), writes go out one at a time, and the stream ends when
// the client cancels or the server shuts down. OnDone removes the reactor from its set under
// the router's mutex before deleting it.
//
//   auto* r = new WatchReactor<v1::Placement>(&mu_, &placement_watchers_, nullptr);
//   placement_watchers_.insert(r);
//   r->Push(current);  // then every change: for (auto* w : placement_watchers_) w->Push(p);
#ifndef MOE_ROUTER_SVC_WATCH_REACTOR_H_
#define MOE_ROUTER_SVC_WATCH_REACTOR_H_

#include <grpcpp/grpcpp.h>

#include <deque>
#include <functional>
#include <mutex>
#include <set>
#include <utility>

namespace moe::router_svc {

template <typename Msg>
class WatchReactor;

// The streams watching placement or bias. Guarded by the router's mutex.
template <typename Msg>
using WatchSet = std::set<WatchReactor<Msg>*>;

template <typename Msg>
class WatchReactor final : public grpc::ServerWriteReactor<Msg> {
 public:
  WatchReactor(std::mutex* router_mu, WatchSet<Msg>* set, std::function<bool(const Msg&)> filter)
      : router_mu_(router_mu), set_(set), filter_(std::move(filter)) {}

  void Push(const Msg& m) {
    if (filter_ && !filter_(m)) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    outbox_.push_back(m);
    if (!writing_) {
      writing_ = true;
      this->StartWrite(&outbox_.front());
    }
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    outbox_.pop_front();
    if (!ok) done_ = true;
    if (!done_ && !outbox_.empty()) {
      this->StartWrite(&outbox_.front());
      return;
    }
    writing_ = false;
    MaybeFinishLocked();
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    MaybeFinishLocked();
  }

  void OnDone() override {
    {
      std::lock_guard<std::mutex> lock(*router_mu_);
      set_->erase(this);
    }
    delete this;
  }

 private:
  void MaybeFinishLocked() {
    if (done_ && !writing_ && !finished_) {
      finished_ = true;
      this->Finish(grpc::Status::OK);
    }
  }

  std::mutex* router_mu_;
  WatchSet<Msg>* set_;
  std::function<bool(const Msg&)> filter_;
  std::mutex mu_;
  std::deque<Msg> outbox_;
  bool writing_ = false, done_ = false, finished_ = false;
};

}  // namespace moe::router_svc

#endif  // MOE_ROUTER_SVC_WATCH_REACTOR_H_
