// One Forward on the attention node, with nothing of the server in it: PrepareForward checks a
// request against the node's limits and its routing view into a ForwardSpec; a ForwardPass
// routes, projects and dispatches each micro-batch to the expert replicas (FailoverChannel over
// the node's ExpertLinks), gathers and finishes it; RunForward conducts the micro-batches
// (at most two in flight) and writes the response. What a pass uses of the node comes in a
// ForwardEnv.
//
//   MOE_ASSIGN_OR_RETURN(ForwardSpec spec, PrepareForward(limits, layers, view, req, deadline));
//   MOE_RETURN_IF_ERROR(RunForward(env, req, spec, micro_batches, &resp));
#ifndef MOE_ATTENTION_SVC_FORWARD_PASS_H_
#define MOE_ATTENTION_SVC_FORWARD_PASS_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention-svc/dispatch_plan.h"
#include "attention-svc/expert_links.h"
#include "attention-svc/failover_channel.h"
#include "attention-svc/node_stats.h"
#include "attention-svc/replica_picker.h"
#include "attention-svc/routing_view.h"
#include "moe/v1/attention.pb.h"
#include "services/common/model_config.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/numerics/dynamic_k.h"
#include "services/numerics/precision_mode.h"
#include "services/transport/tensor_codec.h"

namespace moe::metrics {
class AttentionMetrics;
}

namespace moe::attention_svc {

// The expert calls end this share of the time left before the caller's deadline, within
// [min, max], so that the caller hears which shard was late rather than a bare
// DEADLINE_EXCEEDED from its own clock.
inline constexpr double kExpertDeadlineShare = 0.1;
inline constexpr absl::Duration kExpertDeadlineMarginMin = absl::Milliseconds(10);
inline constexpr absl::Duration kExpertDeadlineMarginMax = absl::Milliseconds(100);

// One hosted layer's dense part (router, latent projections, norm, shared experts).
struct HostedLayer {
  std::unique_ptr<numerics::cpu::CpuMoeLayer> layer;
  std::mutex mu;  // CpuMoeLayer is not reentrant
};
using HostedLayers = std::map<int32_t, std::unique_ptr<HostedLayer>>;

// What a Forward request asks, checked, with the layer's bias and route at its start.
struct ForwardSpec {
  HostedLayer* hosted = nullptr;
  transport::Bf16Matrix x;  // [T, H]
  ReplyMode mode = ReplyMode::kPerPair;
  numerics::Precision precision = numerics::Precision::kW4A16;
  std::shared_ptr<const BiasEntry> bias;
  // The expert budget served (experts per token on average): k, or lower with bias's
  // thresholds (the layer's budget, the request's cap, the automatic mode).
  int32_t budget = 0;
  // What each token keeps of its top k: the budget's thresholds row, or the request's top-p
  // (ForwardOptions.expert_top_p), or nothing dropped (no thresholds, top_p 0). Its pointer is
  // into bias, which the spec holds.
  numerics::BudgetRule rule;
  bool check = false;  // a full-k check: no statistics, no per-expert counts
  std::shared_ptr<const LayerRoute> route;
  absl::Time expert_deadline;  // the expert calls end here, a little before the caller's
};

// The node's limits and defaults a request is checked against.
struct ForwardLimits {
  const ModelConfig* cfg = nullptr;
  int64_t max_tokens = 16384;
  ReplyMode reply_mode = ReplyMode::kPerPair;                   // when the request names none
  numerics::Precision precision = numerics::Precision::kW4A16;  // likewise
  int32_t auto_budget_cap = 0;  // dynamic k's automatic cap now (0: off)
};

// check: dynamic k's full-k recomputation of a sampled request (the full top-k whatever the
// budgets; it adds nothing to the load statistics).
absl::StatusOr<ForwardSpec> PrepareForward(const ForwardLimits& limits, const HostedLayers& layers,
                                           const RoutingView& view, const v1::ForwardRequest& req,
                                           absl::Time deadline, bool check = false);

// What a pass uses of the node, every pointer required (a full-k check counts nothing in stats).
struct ForwardEnv {
  const ModelConfig* cfg = nullptr;
  ExpertLinks* links = nullptr;
  ReplicaPicker* picker = nullptr;
  NodeStats* stats = nullptr;
  metrics::AttentionMetrics* metrics = nullptr;
  int64_t max_dispatch_bytes = 64 << 20;
  double hedge_share = 0.5;
  TwinAuditor* audit = nullptr;  // twin audits (twin_audit.h); null: none
};

// One Forward's state over its micro-batches.
class ForwardPass {
 public:
  // One micro-batch in flight: routed, projected, dispatched; its shared experts done.
  struct InFlight {
    int64_t lo = 0, rows = 0;  // tokens [lo, lo + rows) of the request
    numerics::cpu::RoutedBatch batch;
    DispatchPlan plan;
    DispatchHeader header;
    std::vector<std::unique_ptr<ExpertCall>> calls;
    std::vector<float> shared;
  };

  // env, req and spec must outlive the pass.
  ForwardPass(const ForwardEnv& env, const v1::ForwardRequest& req, const ForwardSpec& spec);

  // Routes and projects tokens [lo, lo + rows), sends every message, runs the shared experts.
  absl::StatusOr<InFlight> Start(int64_t lo, int64_t rows);
  // Waits for a micro-batch's replies (failing over inside the calls), gathers and finishes it.
  absl::Status Finish(InFlight& f);
  void Respond(v1::ForwardResponse* resp) const;

 private:
  FailoverHooks Hooks();

  const ForwardEnv& env_;
  const v1::ForwardRequest& req_;
  const ForwardSpec& spec_;
  const int64_t d_, h_, top_k_;
  DispatchSpec dispatch_;
  numerics::LayerTimings t_;
  int64_t bytes_sent_ = 0, bytes_received_ = 0;
  int64_t routed_pairs_ = 0;   // (token, expert) pairs kept by the budget
  double kept_mass_ = 0;       // summed over tokens (ApplyBudget's kept_mass)
  std::set<int32_t> missing_;  // DEGRADE: experts left out, over all micro-batches
  int64_t degraded_pairs_ = 0;
  double combine_seconds_ = 0;
  // Dispatch: from the first message sent to the last reply in (the shared experts overlap it).
  std::optional<std::chrono::steady_clock::time_point> first_send_;
  std::chrono::steady_clock::time_point last_reply_;
  std::vector<tensor::Bf16> out_;
  std::vector<int32_t> expert_ids_;
  std::vector<float> weights_;
  FailoverChannel replicas_;
};

// The conductor: each micro-batch (micro_batches along the tokens, at most two in flight, so
// one is routed, projected and run through the shared experts here while the expert servers
// compute the other) started and finished by a ForwardPass, then the response.
absl::Status RunForward(const ForwardEnv& env, const v1::ForwardRequest& req,
                        const ForwardSpec& spec, int micro_batches, v1::ForwardResponse* resp);

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_FORWARD_PASS_H_
