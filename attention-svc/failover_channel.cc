#include "attention-svc/failover_channel.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"

namespace moe::attention_svc {

namespace {

// A call counted as outstanding on its replica from Send until it is dropped (answered, failed
// over or abandoned), and marked failed when it ended UNAVAILABLE.
class CountedCall final : public ExpertCall {
 public:
  CountedCall(std::unique_ptr<ExpertCall> inner, ReplicaPicker* picker, ShardRef shard)
      : inner_(std::move(inner)), picker_(picker), shard_(std::move(shard)) {
    picker_->Started(shard_);
  }
  ~CountedCall() override { picker_->Finished(shard_, failed_); }
  bool Answered(absl::Time until) override { return inner_->Answered(until); }
  absl::StatusOr<ExpertReply> Wait(absl::Time deadline) override {
    absl::StatusOr<ExpertReply> r = inner_->Wait(deadline);
    failed_ = !r.ok() && r.status().code() == absl::StatusCode::kUnavailable;
    return r;
  }
  const char* transport() const override { return inner_->transport(); }

 private:
  std::unique_ptr<ExpertCall> inner_;
  ReplicaPicker* picker_;
  const ShardRef shard_;
  bool failed_ = false;
};

}  // namespace

class FailoverCall final : public ExpertCall {
 public:
  FailoverCall(FailoverChannel* channel, const DispatchHeader& header, const DispatchMessage& m,
               size_t target)
      : channel_(channel), header_(header), m_(m), target_(target), sent_at_(absl::Now()) {
    call_ = channel_->SendTo(target_, header_, m_);
  }

  bool Answered(absl::Time until) override { return call_->Answered(until); }

  absl::StatusOr<ExpertReply> Wait(absl::Time deadline) override {
    const LayerRoute& route = channel_->route_;
    MaybeHedge(deadline);
    std::set<size_t> tried;
    bool again = false;
    for (;;) {
      absl::StatusOr<ExpertReply> reply = call_->Wait(deadline);
      const bool gone = !reply.ok() && reply.status().code() == absl::StatusCode::kUnavailable;
      if (reply.ok() || !gone || absl::Now() >= deadline) return reply;
      tried.insert(target_);
      size_t next = channel_->picker_->Pick(route, ReplicasOf(route, m_.shard), tried);
      if (next >= route.shards.size()) {
        if (again) return reply;  // no replica left
        again = true;
        next = target_;
      }
      if (channel_->hooks_.on_failover) {
        channel_->hooks_.on_failover(route.shards[target_], route.shards[next], reply.status());
      }
      target_ = next;
      header_.timeout_ms = std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - absl::Now()));
      call_.reset();  // the failed replica's call ends (counted) before the next starts
      call_ = channel_->SendTo(target_, header_, m_);
    }
  }
  const char* transport() const override { return call_->transport(); }

 private:
  // Hedging: a replica that has not answered after hedge_share of the time to the deadline
  // (stalled, overloaded) gets a twin: the same message to another healthy replica of the
  // range, and the first to answer is the call (the other is dropped, its reply discarded, so
  // nothing is counted twice). Without another replica, or with hedge_share 0, nothing.
  void MaybeHedge(absl::Time deadline) {
    const double share = channel_->hooks_.hedge_share;
    if (share <= 0 || share >= 1) return;
    const absl::Time hedge_at = sent_at_ + (deadline - sent_at_) * share;
    if (call_->Answered(std::min(hedge_at, deadline)) || absl::Now() >= deadline) return;
    const LayerRoute& route = channel_->route_;
    const size_t twin = channel_->picker_->Pick(route, ReplicasOf(route, m_.shard), {target_});
    if (twin >= route.shards.size() || twin == target_) return;
    DispatchHeader h = header_;
    h.timeout_ms = std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - absl::Now()));
    std::unique_ptr<ExpertCall> hedge = channel_->SendTo(twin, h, m_);
    bool hedge_won = false;
    // First answer wins (bounded by the deadline; 2 ms slices on each).
    while (absl::Now() < deadline) {
      const absl::Time slice = std::min(deadline, absl::Now() + absl::Milliseconds(2));
      if (call_->Answered(slice)) break;
      if (hedge->Answered(std::min(deadline, absl::Now() + absl::Milliseconds(2)))) {
        hedge_won = true;
        break;
      }
    }
    if (channel_->hooks_.on_hedge) {
      channel_->hooks_.on_hedge(route.shards[target_], route.shards[twin], hedge_won);
    }
    if (hedge_won) {
      std::swap(call_, hedge);
      target_ = twin;
      header_ = h;
    }
    // The loser ends here (counted off its replica); a late reply of it is discarded.
  }

  FailoverChannel* const channel_;
  DispatchHeader header_;
  const DispatchMessage& m_;
  size_t target_;
  const absl::Time sent_at_;
  std::unique_ptr<ExpertCall> call_;
};

std::unique_ptr<ExpertCall> FailoverChannel::SendTo(size_t target, const DispatchHeader& header,
                                                    const DispatchMessage& m) {
  const ShardRef& shard = route_.shards[target];
  auto call =
      std::make_unique<CountedCall>(hooks_.channel_for(shard)->Send(header, m), picker_, shard);
  if (hooks_.on_sent) hooks_.on_sent(m, call->transport());
  return call;
}

// A message no replica can take (none healthy).
class NoReplicaCall final : public ExpertCall {
 public:
  explicit NoReplicaCall(absl::Status s) : status_(std::move(s)) {}
  absl::StatusOr<ExpertReply> Wait(absl::Time) override { return status_; }
  const char* transport() const override { return ""; }

 private:
  absl::Status status_;
};

std::unique_ptr<ExpertCall> FailoverChannel::Send(const DispatchHeader& header,
                                                  const DispatchMessage& m) {
  // Any healthy replica of the message's range: the least busy one.
  const size_t target = picker_->Pick(route_, ReplicasOf(route_, m.shard), {});
  if (target >= route_.shards.size()) {
    return std::make_unique<NoReplicaCall>(absl::UnavailableError(
        absl::StrCat("no healthy replica of expert shard ", route_.shards[m.shard].shard,
                     "'s range of layer ", route_.layer)));
  }
  return std::make_unique<FailoverCall>(this, header, m, target);
}

}  // namespace moe::attention_svc
