// A server-streaming watch of router-svc (WatchPlacement, WatchBias): Push queues a message
// (called with the watch set's mutex held), writes go out one at a time, and the stream ends when
// the client cancels or the server shuts down. OnDone removes the reactor from its set under
// the watch set's mutex before deleting it. Messages are states, not events: a pushed message
// replaces a queued one with the same key (the placement; one layer's bias), so a watcher that
// reads slowly or not at all holds at most one message per key, and always gets the latest.
// The bytes every watcher of a set holds unread (queued or in flight) are counted against one
// budget (WatchBudget): a push that would pass it ends that stream RESOURCE_EXHAUSTED (and
// cancels its call, so a peer that never reads frees what gRPC holds for it).
//
//   auto* r = new WatchReactor<v1::Placement>(&mu_, &placement_watchers_, nullptr);
//   placement_watchers_.insert(r);
//   r->Push(current);  // then every change: for (auto* w : placement_watchers_) w->Push(p);
#ifndef MOE_ROUTER_SVC_WATCH_REACTOR_H_
#define MOE_ROUTER_SVC_WATCH_REACTOR_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "services/common/logging.h"

namespace moe::router_svc {

// Bytes held unread by all the watch streams of a router, and their bound.
struct WatchBudget {
  std::atomic<int64_t> held{0};
  int64_t max_bytes = int64_t{256} << 20;
};

template <typename Msg>
class WatchReactor;

// The streams watching placement or bias. Guarded by the router's mutex.
template <typename Msg>
using WatchSet = std::set<WatchReactor<Msg>*>;

template <typename Msg>
class WatchReactor final : public grpc::ServerWriteReactor<Msg> {
 public:
  WatchReactor(std::mutex* router_mu, WatchSet<Msg>* set, std::function<bool(const Msg&)> filter,
               std::function<int64_t(const Msg&)> key = nullptr, WatchBudget* budget = nullptr,
               grpc::CallbackServerContext* ctx = nullptr)
      : router_mu_(router_mu),
        set_(set),
        filter_(std::move(filter)),
        key_(std::move(key)),
        budget_(budget),
        ctx_(ctx) {}

  // bytes: m.ByteSizeLong() when the caller pushes one message to many watchers (< 0: here).
  void Push(const Msg& m, int64_t bytes = -1) {
    if (filter_ && !filter_(m)) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    if (bytes < 0) bytes = static_cast<int64_t>(m.ByteSizeLong());
    // The head (if writing) is in flight; a queued message of the same key is superseded.
    for (size_t i = writing_ ? 1 : 0; i < outbox_.size(); ++i) {
      if (KeyOf(outbox_[i]) == KeyOf(m)) {
        if (!TakeLocked(bytes - sizes_[i])) return;
        outbox_[i] = m;
        sizes_[i] = bytes;
        return;
      }
    }
    if (!TakeLocked(bytes)) return;
    outbox_.push_back(m);
    sizes_.push_back(bytes);
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
    GiveLocked(sizes_.front());
    outbox_.pop_front();
    sizes_.pop_front();
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
    {
      std::lock_guard<std::mutex> lock(mu_);
      GiveLocked(held_);  // whatever is still queued
    }
    delete this;
  }

 private:
  int64_t KeyOf(const Msg& m) const { return key_ ? key_(m) : 0; }

  // Counts `delta` more bytes held unread; past the budget, ends this stream instead (its
  // queued messages dropped, its call cancelled) and returns false.
  bool TakeLocked(int64_t delta) {
    if (budget_ == nullptr || delta <= 0) {
      if (budget_ != nullptr) budget_->held += delta;
      held_ += delta;
      return true;
    }
    if (budget_->held.fetch_add(delta) + delta <= budget_->max_bytes) {
      held_ += delta;
      return true;
    }
    budget_->held -= delta;
    done_ = true;
    status_ = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                           "this watch stream does not read its messages, and the router's "
                           "watchers hold the most unread bytes they may (--max_watch_bytes)");
    // Keep only the head in flight (gRPC owns it until OnWriteDone).
    while (outbox_.size() > (writing_ ? 1u : 0u)) {
      GiveLocked(sizes_.back());
      outbox_.pop_back();
      sizes_.pop_back();
    }
    MOE_LOG_WARN(
        "a watch stream that does not read was ended: the watchers hold {} bytes unread "
        "(--max_watch_bytes {})",
        budget_->held.load(), budget_->max_bytes);
    if (ctx_ != nullptr) ctx_->TryCancel();
    MaybeFinishLocked();
    return false;
  }
  void GiveLocked(int64_t bytes) {
    held_ -= bytes;
    if (budget_ != nullptr) budget_->held -= bytes;
  }

  void MaybeFinishLocked() {
    if (done_ && !writing_ && !finished_) {
      finished_ = true;
      this->Finish(status_);
    }
  }

  std::mutex* router_mu_;
  WatchSet<Msg>* set_;
  std::function<bool(const Msg&)> filter_;
  std::function<int64_t(const Msg&)> key_;  // null: one key
  WatchBudget* budget_;
  grpc::CallbackServerContext* ctx_;
  std::mutex mu_;
  std::deque<Msg> outbox_;
  std::deque<int64_t> sizes_;  // of outbox_'s messages, serialized
  int64_t held_ = 0;           // their sum, counted in budget_
  grpc::Status status_ = grpc::Status::OK;
  bool writing_ = false, done_ = false, finished_ = false;
};

}  // namespace moe::router_svc

#endif  // MOE_ROUTER_SVC_WATCH_REACTOR_H_
