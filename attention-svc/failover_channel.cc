#include "attention-svc/failover_channel.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/common/logging.h"

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
  // count_answers: a reply counts as its replica's answer on the auditor (an audited call counts
  // the reply it serves itself).
  FailoverCall(FailoverChannel* channel, const DispatchHeader& header, const DispatchMessage& m,
               size_t target, bool count_answers = true)
      : channel_(channel),
        header_(header),
        m_(m),
        target_(target),
        sent_at_(absl::Now()),
        count_answers_(count_answers) {
    call_ = channel_->SendTo(target_, header_, m_);
  }

  bool Answered(absl::Time until) override { return call_->Answered(until); }

  absl::StatusOr<ExpertReply> Wait(absl::Time deadline) override {
    absl::StatusOr<ExpertReply> r = WaitReplicas(deadline);
    TwinAuditor* audit = channel_->hooks_.audit;
    if (r.ok() && count_answers_ && audit != nullptr) {
      audit->Answered(channel_->route_.shards[target_]);
    }
    return r;
  }
  const char* transport() const override { return call_->transport(); }
  // The replica whose reply Wait returned (or the last one tried).
  size_t target() const { return target_; }
  absl::Time sent_at() const { return sent_at_; }

 private:
  absl::StatusOr<ExpertReply> WaitReplicas(absl::Time deadline) {
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
  const bool count_answers_;
  std::unique_ptr<ExpertCall> call_;
};

// A twin audit: the message on its replica (with failover, as any call) and on a twin replica
// at once; once both answered, the auditor judges the replies and the call answers with the
// right one. The twin is waited for only a bounded time after the audited replica's answer
// (TwinAuditOptions::twin_wait_factor): a silent twin skips the audit, never the request.
class AuditedCall final : public ExpertCall {
 public:
  AuditedCall(FailoverChannel* channel, const DispatchHeader& header, const DispatchMessage& m,
              size_t target, size_t twin)
      : channel_(channel),
        header_(header),
        m_(m),
        primary_(channel, header, m, target, /*count_answers=*/false),
        twin_target_(twin),
        twin_(channel->SendTo(twin, header, m)) {}

  bool Answered(absl::Time until) override {
    return primary_.Answered(until) && (twin_ == nullptr || twin_->Answered(until));
  }
  const char* transport() const override { return primary_.transport(); }

  absl::StatusOr<ExpertReply> Wait(absl::Time deadline) override {
    TwinAuditor* audit = channel_->hooks_.audit;
    const LayerRoute& route = channel_->route_;
    absl::StatusOr<ExpertReply> a = primary_.Wait(deadline);
    if (!a.ok() || primary_.target() == twin_target_) {
      audit->Skipped();  // failed (the caller hears it), or failed over onto the twin
      if (a.ok()) audit->Answered(route.shards[primary_.target()]);
      return a;
    }
    const absl::Duration took = absl::Now() - primary_.sent_at();
    const absl::Time until = std::min(
        deadline,
        absl::Now() + std::max(absl::Milliseconds(5), took * audit->options().twin_wait_factor));
    absl::StatusOr<ExpertReply> b = absl::DeadlineExceededError("the twin did not answer");
    if (twin_->Answered(until)) b = twin_->Wait(deadline);
    twin_.reset();  // counted off its replica now
    if (!b.ok()) {
      audit->Skipped();
      audit->Answered(route.shards[primary_.target()]);
      return a;
    }
    const std::array<const ShardRef*, 2> shards = {&route.shards[primary_.target()],
                                                   &route.shards[twin_target_]};
    TwinVerdict v = audit->Judge(header_, m_, shards, {&*a, &*b});
    if (v.outcome == TwinOutcome::kUnresolved) {
      MOE_LOG_ERROR("twin audit: {}", v.detail);
      return absl::InternalError(
          absl::StrCat("expert shards ", shards[0]->shard, " and ", shards[1]->shard,
                       " answered differently and neither could be confirmed: ", v.detail));
    }
    if (v.outcome == TwinOutcome::kCaught)
      MOE_LOG_ERROR("twin audit caught a wrong answer: {}", v.detail);
    audit->Answered(*shards[v.use]);
    return v.use == 0 ? std::move(a) : std::move(b);
  }

 private:
  FailoverChannel* const channel_;
  const DispatchHeader header_;
  const DispatchMessage& m_;
  FailoverCall primary_;
  const size_t twin_target_;
  std::unique_ptr<ExpertCall> twin_;
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
  // Audited: the counter's share of messages, when another healthy replica can be the twin (the
  // twin is picked only then: a pick moves the picker's tie-breaking turn).
  TwinAuditor* audit = hooks_.audit;
  const ShardRef& range = route_.shards[m.shard];
  if (audit != nullptr && audit->Sample(route_.layer, range.lo, range.hi)) {
    const size_t twin = picker_->Pick(route_, ReplicasOf(route_, m.shard), {target});
    if (twin < route_.shards.size() && twin != target) {
      return std::make_unique<AuditedCall>(this, header, m, target, twin);
    }
  }
  return std::make_unique<FailoverCall>(this, header, m, target);
}

}  // namespace moe::attention_svc
