// Readiness means "answers right" (Dynamo's canary health checks): a small fixed batch goes
// through the whole path (this node's router and down-projection, the shards, the combine, the
// norm, the up-projection and the shared experts) every --canary_interval_ms, and its answer is
// compared with the layer's scalar reference computed in this process from the checkpoint's
// weights (the expert weights are views of the mapped checkpoint, read only for the experts the
// canary routes to). The node is ready only while the last canary matched within the layer
// tolerance's hard bound (tolerance.h, HardBound; docs/math.md: differences within summation
// order); a wrong answer (a shard with a valid identity that serves other weights), an error or
// no answer within --canary_timeout_ms makes it not ready until a canary matches again. A canary
// that timed out while the node answered other requests (and none failed on the path: a shard,
// the data plane, a deadline) only queued behind them: "busy", and the readiness stays (under
// traffic the requests themselves show the path is alive; a stalled shard fails them); the next
// canary then waits twice as long (at most a minute), so one gets through and judges. The
// reference is computed once per bias version, off the request path.
//
//   CanaryOracle oracle(cfg, &weights, /*tokens=*/4, /*seed=*/9);
//   v1::ForwardRequest req = oracle.Request(layer);
//   ... resp = the node's answer to req ...
//   CanaryOutcome o = oracle.Judge(resp, *snapshot.bias, &detail);
#ifndef MOE_ATTENTION_SVC_READINESS_CANARY_H_
#define MOE_ATTENTION_SVC_READINESS_CANARY_H_

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "attention-svc/routing_view.h"
#include "moe/v1/attention.pb.h"
#include "services/common/enum_names.h"
#include "services/common/model_config.h"
#include "services/numerics/layer_weights.h"
#include "services/tensor/bf16.h"

namespace moe::attention_svc {

// What one canary found (moe_canary_checks_total{outcome}).
// kBusy: it timed out queued behind other requests the node answered meanwhile (none failed):
// the readiness it had stays.
enum class CanaryOutcome { kMatch, kMismatch, kTimeout, kError, kSkipped, kBusy };
inline constexpr EnumNames<CanaryOutcome, 6> kCanaryOutcomes{
    "canary outcome",
    {{{CanaryOutcome::kMatch, "match"},
      {CanaryOutcome::kMismatch, "mismatch"},
      {CanaryOutcome::kTimeout, "timeout"},
      {CanaryOutcome::kError, "error"},
      {CanaryOutcome::kSkipped, "skipped"},
      {CanaryOutcome::kBusy, "busy"}}}};

// The next canary's timeout after one with outcome `o` that had `current_ms`: a canary that only
// queued behind the traffic (busy) gets twice the time (at most kCanaryTimeoutMaxMs, or the
// configured one if longer), so that one gets through under sustained load and judges the
// answer; any other outcome goes back to the configured --canary_timeout_ms (a stall is found
// as fast as before).
inline constexpr int64_t kCanaryTimeoutMaxMs = 60000;
inline int64_t NextCanaryTimeoutMs(CanaryOutcome o, int64_t current_ms, int64_t configured_ms) {
  if (o != CanaryOutcome::kBusy) return configured_ms;
  const int64_t cap = configured_ms > kCanaryTimeoutMaxMs ? configured_ms : kCanaryTimeoutMaxMs;
  return current_ms >= cap / 2 ? cap : 2 * current_ms;
}

class CanaryOracle {
 public:
  // w: the layer's dense part and all its experts (views), kept alive by the caller.
  CanaryOracle(const ModelConfig& cfg, const numerics::MoeLayerWeights* w, int64_t tokens,
               uint64_t seed);

  // The canary's request: its fixed hidden states, per-pair replies, W4A16. The node runs it as
  // a full-k check (forward_pass.h): the whole top-k whatever the budgets, nothing added to the
  // load statistics or the request metrics.
  v1::ForwardRequest Request(int32_t layer) const;

  // The layer's answer to the canary under `bias` (the full top-k), by the scalar reference;
  // cached per bias version.
  absl::StatusOr<std::vector<tensor::Bf16>> Want(const BiasEntry& bias);

  // The node's response against the reference under the bias entry of the version it was served
  // with: kMatch within the layer tolerance's hard bound (tolerance.h, HardBound), kMismatch
  // otherwise (detail: the ULP statistics),
  // kSkipped when `bias` is not the version the response names (the bias moved in between),
  // kError when the response is not a [tokens, hidden] bf16 answer.
  CanaryOutcome Judge(const v1::ForwardResponse& resp, const BiasEntry& bias, std::string* detail);

  int64_t tokens() const { return tokens_; }

 private:
  const ModelConfig cfg_;
  const numerics::MoeLayerWeights* const w_;
  const int64_t tokens_;
  const std::vector<tensor::Bf16> x_;
  std::vector<tensor::Bf16> shared_;  // the shared experts' part of the output: the row scale
  std::mutex mu_;
  std::map<uint64_t, std::vector<tensor::Bf16>> want_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_READINESS_CANARY_H_
