// The attention node's dispatch and gather, as plain functions over plain data (no gRPC, no
// protobuf): which rows go to which expert shard in which message, and how the replies become
// the combined latent r. attention_server.cc sends the messages through an ExpertChannel
// (expert_channel.h); the tests check plans and gathers without processes.
//
//   MOE_ASSIGN_OR_RETURN(DispatchPlan plan, PlanDispatch(routing, z, route, spec));  // z: rows
//   std::vector<ExpertReply> replies = ...;  // one per plan.messages[i], from the channels
//   MOE_ASSIGN_OR_RETURN(std::vector<Bf16> r, Gather(plan, routing, route, replies));
//
// Contract (the same as proto/moe/v1/expert.proto): a message carries whole experts of one
// shard, ascending; each distinct token's z travels once per message (row_source maps each
// (token, expert) row to it); rows of an expert are in ascending (token, slot) order. Per-pair
// replies give one bf16 row per row and the node combines them with numerics::ref::Combine, so
// the cluster is bit-exact with the in-process layer. Partial-sum replies give one fp32 row per
// distinct token of the message, summed over its experts on the server; the node adds them in
// ascending expert order (numerics::AddPartialSums).
#ifndef MOE_ATTENTION_SVC_DISPATCH_PLAN_H_
#define MOE_ATTENTION_SVC_DISPATCH_PLAN_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "services/common/enum_names.h"
#include "services/numerics/precision_mode.h"
#include "services/numerics/router.h"
#include "services/placement/placement.h"
#include "services/tensor/activations.h"
#include "services/tensor/bf16.h"

namespace moe {
class ThreadPool;
}

namespace moe::attention_svc {

enum class ReplyMode { kPerPair, kPartialSum };
inline constexpr EnumNames<ReplyMode, 2> kReplyModes{
    "reply mode", {{{ReplyMode::kPerPair, "per_pair"}, {ReplyMode::kPartialSum, "partial_sum"}}}};
inline const char* ReplyModeName(ReplyMode m) { return kReplyModes.Name(m); }
inline absl::StatusOr<ReplyMode> ParseReplyMode(const std::string& s) {
  return kReplyModes.Parse(s);
}

using placement::BuildRoute;
using placement::Covered;
using placement::LayerRoute;
using placement::ShardRef;

struct DispatchSpec {
  ReplyMode mode = ReplyMode::kPerPair;
  int64_t num_experts = 0;
  int64_t latent = 0;
  // A message's reply stays under this many bytes (an expert with more rows gets a message of
  // its own: experts are never split).
  int64_t max_message_bytes = int64_t{64} << 20;
  // [E] or empty: experts to leave out (DEGRADE: no healthy replica); their pairs go nowhere and
  // gather as zero rows (their weights must be 0).
  std::vector<bool> skip;
};

// One message to one shard.
struct DispatchMessage {
  size_t shard = 0;                                 // index into the route's shards
  std::vector<std::pair<int32_t, int32_t>> groups;  // (expert id, rows), ascending expert
  std::vector<int64_t> pairs;       // per row: token * k + slot (where its output goes)
  std::vector<int32_t> row_source;  // per row: index into tokens / z
  std::vector<int64_t> tokens;      // the distinct tokens of the message, ascending
  tensor::Activations z;            // [tokens.size(), latent], in the batch's format
  // Partial sums only: per row the token (as an index < num_tokens) and routing weight.
  std::vector<int32_t> token_index;
  std::vector<float> weights;
  int64_t rows() const { return static_cast<int64_t>(pairs.size()); }
  // The activations' payload bytes on the wire.
  int64_t activation_bytes() const { return z.bytes(); }
  // The mode the format implies: MXFP8 rows are W4A8.
  numerics::Precision precision() const {
    return z.format() == tensor::ActivationFormat::kMxfp8 ? numerics::Precision::kW4A8
                                                          : numerics::Precision::kW4A16;
  }
};

struct DispatchPlan {
  ReplyMode mode = ReplyMode::kPerPair;
  int64_t tokens = 0, top_k = 0, latent = 0;
  std::vector<int64_t> per_expert;                          // [E] routed rows
  std::vector<std::pair<std::string, int64_t>> shard_rows;  // rows per shard with any
  std::vector<DispatchMessage> messages;                    // ascending (shard order, expert id)
};

// routing: the layer's [T, k] routing; z: [T, latent] in bf16 (W4A16) or MXFP8 (W4A8: quantized
// once per token; the messages carry its rows). UNAVAILABLE when a routed expert has no owner or
// an unhealthy one (naming the expert or the shard); INVALID_ARGUMENT when z's shape is not
// [T, latent].
absl::StatusOr<DispatchPlan> PlanDispatch(const numerics::Routing& routing,
                                          const tensor::Activations& z, const LayerRoute& route,
                                          const DispatchSpec& spec);

// DEGRADE: the routed experts without a healthy replica are left out. Their slots' weights
// become 0 and each token's other weights are scaled by (sum of its k weights) / (sum of the
// kept ones) (a token with none kept: all 0, the shared experts alone); *skip marks them for
// PlanDispatch. Returns the missing routed experts, ascending; *degraded_pairs their pairs.
std::vector<int32_t> DegradeRouting(const LayerRoute& route, numerics::Routing* routing,
                                    std::vector<bool>* skip, int64_t* degraded_pairs);

// DEGRADE after dispatch: the experts marked in `lost` (their shard died or stalled after the
// messages went out, and no replica answered) are left out by the same rule, from the weights
// as they are (a token's weights still sum to its k weights' sum). Returns each token's factor
// (sum before) / (sum kept), 1 where nothing changed, for replies already weighted at the shard
// (partial sums); *degraded_pairs counts the pairs newly left out, *missing gets the experts.
std::vector<float> DegradeLost(const std::vector<bool>& lost, numerics::Routing* routing,
                               int64_t* degraded_pairs, std::vector<int32_t>* missing);

// A shard's answer to one message: per-pair, `bf16` [rows, latent]; partial sums, `f32`
// [tokens.size(), latent]. The per-pair rows are read where `held` keeps them: a vector of the
// reply's own (Own) or the data plane's buffer they arrived in, read there without a copy.
struct ExpertReply {
  int64_t rows = 0;
  absl::Span<const tensor::Bf16> bf16;
  std::shared_ptr<const void> held;
  std::vector<float> f32;
  // bf16 over `values`, held by the reply.
  void Own(std::vector<tensor::Bf16> values);
};

// The reply a lost message contributes under DEGRADE: zeros of the shape it would have had.
ExpertReply ZeroReply(const DispatchMessage& m, bool partial_sums, int64_t latent);

// The combined latent r [T, latent] from the replies (replies[i] answers plan.messages[i]);
// INTERNAL naming the shard when a reply has the wrong shape. Per-pair rows are combined where
// the replies hold them, the tokens on `pool` when it is free (numerics::CombineRows).
absl::StatusOr<std::vector<tensor::Bf16>> Gather(const DispatchPlan& plan,
                                                 const numerics::Routing& routing,
                                                 const LayerRoute& route,
                                                 const std::vector<ExpertReply>& replies,
                                                 ThreadPool* pool = nullptr);

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_DISPATCH_PLAN_H_
