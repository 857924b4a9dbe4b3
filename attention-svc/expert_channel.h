// The seam between a DispatchPlan and the wire: an ExpertChannel carries one plan message to one
// expert shard and brings back its reply. Replica choice and failover sit above it, in the plan;
// how the bytes move sits below it.
//
// Implementations:
//   GrpcExpertChannel  (expert_channel_grpc.h)   in-band ExpertService.Dispatch on one
//                                                long-lived stream per shard (the default)
//   LocalExpertChannel (expert_channel_local.h)  the shard's experts in this process (tests)
//   UcxExpertChannel   (expert_channel_ucx.h)    one UCX message each way per batch, header and
//                                                payload together (docs/data-plane.md)
//
//   std::unique_ptr<ExpertCall> call = channel->Send(header, plan.messages[i]);  // all shards
//   first MOE_ASSIGN_OR_RETURN(ExpertReply reply, call->Wait(deadline));              // then wait
#ifndef MOE_ATTENTION_SVC_EXPERT_CHANNEL_H_
#define MOE_ATTENTION_SVC_EXPERT_CHANNEL_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention-svc/dispatch_plan.h"

namespace moe::attention_svc {

// What every message of one dispatch shares.
struct DispatchHeader {
  int32_t layer = 0;
  ReplyMode mode = ReplyMode::kPerPair;
  int64_t num_tokens = 0;  // T of the batch (partial sums: token_index < T)
  int64_t latent = 0;
  int64_t timeout_ms = 0;  // the shard's budget for the batch, queue included
};

class ExpertCall {
 public:
  virtual ~ExpertCall() = default;
  // The reply, or UNAVAILABLE (shard gone) / DEADLINE_EXCEEDED at `deadline`, naming the shard;
  // a reply whose shape does not fit the message is an error too.
  virtual absl::StatusOr<ExpertReply> Wait(absl::Time deadline) = 0;
  // Blocks until the shard has answered (or the call failed) or `until`; true when it has (Wait
  // then takes the reply without waiting on the shard). Consumes nothing. A call that answers
  // at once (local, failed at Send) is always answered.
  virtual bool Answered(absl::Time until) { return true; }
  // How this message travels: "grpc", "ucx", "local", or "" when it never left (failed at Send).
  virtual const char* transport() const = 0;
};

class ExpertChannel {
 public:
  virtual ~ExpertChannel() = default;
  // Starts one message; never blocks on the network.
  virtual std::unique_ptr<ExpertCall> Send(const DispatchHeader& header,
                                           const DispatchMessage& message) = 0;
  virtual const std::string& shard() const = 0;
  // e.g. "grpc", "local": the transport in use (metrics, the page, GetInfo).
  virtual const char* transport() const = 0;
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_EXPERT_CHANNEL_H_
