// A server-streaming watch of router-svc (WatchPlacement, WatchBias): Push queues a message
// (called with the watch set's mutex held), writes go out one at a time, and the stream ends when
// the client cancels or the server shuts down. OnDone removes the reactor from its set under
// the watch set's mutex before deleting it. Messages are states, not events: a pushed message
// replaces a queued one with the same key (the placement; one layer's bias), so a watcher that
// reads slowly or not at all holds at most one message per key, and always gets the latest.
//
//   auto* r = new WatchReactor<v1::Placement>(&mu_, &placement_watchers_, nullptr);
//   placement_watchers_.insert(r);
//   r->Push(current);  // then every change: for (auto* w : placement_watchers_) w->Push(p);
#ifndef MOE_ROUTER_SVC_WATCH_REACTOR_H_
#define MOE_ROUTER_SVC_WATCH_REACTOR_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <iterator>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "absl/status/status.h"

namespace moe::router_svc {

template <typename Msg>
class WatchReactor;

// The streams watching placement or bias. Guarded by the router's mutex.
template <typename Msg>
using WatchSet = std::set<WatchReactor<Msg>*>;

template <typename Msg>
class WatchReactor final : public grpc::ServerWriteReactor<Msg> {
 public:
  WatchReactor(std::mutex* router_mu, WatchSet<Msg>* set, std::function<bool(const Msg&)> filter,
               std::function<int64_t(const Msg&)> key = nullptr)
      : router_mu_(router_mu), set_(set), filter_(std::move(filter)), key_(std::move(key)) {}

  void Push(const Msg& m) {
    if (filter_ && !filter_(m)) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    // The head (if writing) is in flight; a queued message of the same key is superseded.
    for (auto it = writing_ ? std::next(outbox_.begin()) : outbox_.begin(); it != outbox_.end();
         ++it) {
      if (KeyOf(*it) == KeyOf(m)) {
        *it = m;
        return;
      }
    }
    outbox_.push_back(m);
    if (!writing_) {
      writing_ = true;
      this->StartWrite(&outbox_.front());
    }
  }

  // Ends the stream at once with this status (nothing is pushed to it afterwards).
  void Refuse(const absl::Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    finished_ = true;
    this->Finish(grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message())));
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
  int64_t KeyOf(const Msg& m) const { return key_ ? key_(m) : 0; }

  void MaybeFinishLocked() {
    if (done_ && !writing_ && !finished_) {
      finished_ = true;
      this->Finish(grpc::Status::OK);
    }
  }

  std::mutex* router_mu_;
  WatchSet<Msg>* set_;
  std::function<bool(const Msg&)> filter_;
  std::function<int64_t(const Msg&)> key_;  // null: one key
  std::mutex mu_;
  std::deque<Msg> outbox_;
  bool writing_ = false, done_ = false, finished_ = false;
};

}  // namespace moe::router_svc

#endif  // MOE_ROUTER_SVC_WATCH_REACTOR_H_
