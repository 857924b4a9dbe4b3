// Failover across the replicas of an expert range, as a wrapper of the ExpertChannel seam (the
// retry is not a loop in the forward pass): Send picks the least busy healthy replica of the
// message's range (ReplicaPicker) and returns a call whose Wait, when that replica answers
// UNAVAILABLE (gone, restarting), sends the message to another replica of the same range within
// the same deadline; with none left, the last one gets it once more (a transport broken under
// this call, e.g. a data-plane endpoint another request's transfer closed, is reopened by its
// channel); any other error is the answer. Every call is counted as outstanding on its replica
// while it lives (the picker's load), and a replica that answered UNAVAILABLE is avoided a while.
// A replica that has not answered after hedge_share of the time to the deadline (a stall) gets
// a twin call on another replica; the first answer wins and the other is discarded. With a
// TwinAuditor (twin_audit.h), one message in its share also goes to another healthy replica of
// its range (when it has one), and the auditor judges the two replies (the message is answered
// with the right one).
//
//   FailoverChannel replicas(route, &picker, hooks);  // per request: hooks count its bytes
//   std::unique_ptr<ExpertCall> call = replicas.Send(header, plan.messages[i]);
//   MOE_ASSIGN_OR_RETURN(ExpertReply reply, call->Wait(expert_deadline));
#ifndef MOE_ATTENTION_SVC_FAILOVER_CHANNEL_H_
#define MOE_ATTENTION_SVC_FAILOVER_CHANNEL_H_

#include <functional>
#include <memory>
#include <string>

#include "attention-svc/dispatch_plan.h"
#include "attention-svc/expert_channel.h"
#include "attention-svc/replica_picker.h"
#include "attention-svc/twin_audit.h"

namespace moe::attention_svc {

struct FailoverHooks {
  // The channel of one replica (required).
  std::function<std::shared_ptr<ExpertChannel>(const ShardRef&)> channel_for;
  // A message went out to a replica (first send or failover), with its transport ("" if it
  // never left).
  std::function<void(const DispatchMessage&, const char* transport)> on_sent;
  // `from` answered UNAVAILABLE and the message went to `to` (possibly the same, once).
  std::function<void(const ShardRef& from, const ShardRef& to, const absl::Status& why)>
      on_failover;
  // Hedging: a replica silent after this share of the time to the deadline gets a twin call on
  // another healthy replica, the first answer wins (0: off). on_hedge says which won.
  double hedge_share = 0;
  std::function<void(const ShardRef& slow, const ShardRef& twin, bool twin_won)> on_hedge;
  // Twin audits (null: none); it must outlive the channel's calls.
  TwinAuditor* audit = nullptr;
};

class FailoverChannel {
 public:
  // route and picker must outlive the channel and its calls; so must every message sent.
  FailoverChannel(const LayerRoute& route, ReplicaPicker* picker, FailoverHooks hooks)
      : route_(route), picker_(picker), hooks_(std::move(hooks)) {}

  // Starts one message on a replica of its range (message.shard names the range); never
  // blocks on the network. The header's timeout is refreshed on each failover.
  std::unique_ptr<ExpertCall> Send(const DispatchHeader& header, const DispatchMessage& message);

 private:
  friend class FailoverCall;
  friend class AuditedCall;
  // One send to route_.shards[target], counted on the picker.
  std::unique_ptr<ExpertCall> SendTo(size_t target, const DispatchHeader& header,
                                     const DispatchMessage& m);

  const LayerRoute& route_;
  ReplicaPicker* const picker_;
  const FailoverHooks hooks_;
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_FAILOVER_CHANNEL_H_
