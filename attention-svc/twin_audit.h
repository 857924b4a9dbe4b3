// Catching a lying member: a shard with a valid identity that answers wrong bytes. With replicas,
// one message in `share` (deterministic, by a counter) also goes to a twin, another healthy
// replica of its range, and the two replies are compared. Bit-identical replies agree (both ran
// the same kernels on the same weights). Replies that differ are judged on the rows where they
// differ most (at most max_rows, per-pair rows or partial-sum tokens), recomputed here with the
// scalar reference (ref::ExpertFfn) on the node's own view of the checkpoint's experts and
// compared with the named tolerances (numerics/tolerance.h: kExpertFfnTolerance, W4A8's for
// MXFP8 rows; partial sums at the scale of the summed magnitudes). A reply within the bound is
// right (two kernel choices may differ in summation order); one outside it is wrong, and its
// shard is quarantined: the sink hears of it once (the node stops sending to it and tells
// router-svc), with the answers it gave since its last passed audit (suspect: any of them may
// have been wrong). The message is then answered with the right reply, so an audited message
// never serves a wrong answer; when neither reply is within the bound (or the node holds no
// reference for the layer) the message fails rather than guess.
//
//   TwinAuditor audit(cfg, options, [&](int32_t layer) { return reference(layer); }, sink);
//   if (audit.Sample(layer, lo, hi)) ... send to a twin too ...
//   TwinVerdict v = audit.Judge(header, message, {&a, &b}, {&reply_a, &reply_b});
#ifndef MOE_ATTENTION_SVC_TWIN_AUDIT_H_
#define MOE_ATTENTION_SVC_TWIN_AUDIT_H_

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "attention-svc/dispatch_plan.h"
#include "attention-svc/expert_channel.h"
#include "services/common/enum_names.h"
#include "services/common/model_config.h"
#include "services/numerics/layer_weights.h"
#include "services/numerics/tolerance.h"

namespace moe::attention_svc {

struct TwinAuditOptions {
  int64_t share = 64;    // one message in `share` is audited (0: off)
  int64_t max_rows = 4;  // disputed rows (or partial-sum tokens) recomputed per judgement
  // A twin still silent this long after the audited replica answered (at least 5 ms, and twice
  // that replica's time) is not waited for: the audit is skipped (a stalled twin never delays
  // the request past a fraction of its own time).
  double twin_wait_factor = 2.0;
};

// What one audit found (moe_twin_audits_total{outcome}).
enum class TwinOutcome { kAgree, kWithinBound, kCaught, kUnresolved, kSkipped };
inline constexpr EnumNames<TwinOutcome, 5> kTwinOutcomes{
    "twin audit outcome",
    {{{TwinOutcome::kAgree, "agree"},
      {TwinOutcome::kWithinBound, "within_bound"},
      {TwinOutcome::kCaught, "caught"},
      {TwinOutcome::kUnresolved, "unresolved"},
      {TwinOutcome::kSkipped, "skipped"}}}};

struct TwinVerdict {
  TwinOutcome outcome = TwinOutcome::kAgree;
  int use = 0;  // which reply answers the message (kAgree, kWithinBound, kCaught)
  std::string detail;
};

// A shard caught answering wrong bytes.
struct ShardQuarantine {
  ShardRef shard;
  int32_t layer = 0;
  std::string evidence;         // what was compared, the ULP statistics against the reference
  int64_t suspect_answers = 0;  // replies of it that answered messages since its last passed audit
};

// Per-pair partial sums of rows of different experts can cancel, so their bound is stated at the
// scale of sum_k w_k |y_k| (the row the sum's terms make): each y_k is within 2 ulps of its own
// row's RMS (kExpertFfnTolerance), and that RMS sum is at most sqrt(k) <= 4 times the scale's RMS
// (the |y_k| are non-negative, so their cross products are too): 8 ulps of the scale row.
inline constexpr numerics::Tolerance kPartialSumAuditTolerance = {8.0, 0.01, 0.05, -1};

class TwinAuditor {
 public:
  // The routed experts of a hosted layer (views of the checkpoint), or null when this node holds
  // none for it (a synthetic layer too large to keep).
  using ReferenceWeights = std::function<const numerics::MoeLayerWeights*(int32_t layer)>;
  using Sink = std::function<void(const ShardQuarantine&)>;
  // Hears every outcome (metrics); may be null.
  using Observer = std::function<void(TwinOutcome)>;

  TwinAuditor(const ModelConfig& cfg, const TwinAuditOptions& options, ReferenceWeights reference,
              Sink sink, Observer observe = nullptr);

  const TwinAuditOptions& options() const { return options_; }
  // Whether a message of this range (layer, experts [lo, hi)) is audited (if it has a twin):
  // exactly one in `share` of each range's messages. (One counter for all would alias with the
  // plan: a request's messages go out in range order, so every share-th message of a node with
  // two ranges and an even share would be of the same range.)
  bool Sample(int32_t layer, int32_t lo, int32_t hi);
  // A reply of `shard` answered a message (counted as suspect until its next passed audit).
  void Answered(const ShardRef& shard);
  // The message's two replies (by shards[0] and shards[1], both the message's shape). Counts
  // the outcome; kCaught quarantines the wrong one (the sink hears once per shard).
  TwinVerdict Judge(const DispatchHeader& header, const DispatchMessage& m,
                    const std::array<const ShardRef*, 2>& shards,
                    const std::array<const ExpertReply*, 2>& replies);
  // An audit that could not compare (the twin failed or was too slow).
  void Skipped();
  bool Quarantined(const ShardRef& shard) const;

  struct Counts {
    std::map<TwinOutcome, int64_t> outcomes;
    std::vector<std::string> quarantined;  // shards caught, first caught first
  };
  Counts counts() const;

 private:
  static std::string Key(const ShardRef& s) { return s.shard + "@" + s.endpoint; }
  // The reference's rows for the disputed rows of m (per pair: bf16 rows; partial sums: fp32
  // rows of the disputed tokens and their scale rows), or an error saying why none.
  struct Disputed;
  absl::StatusOr<Disputed> Recompute(const DispatchHeader& header, const DispatchMessage& m,
                                     const std::array<const ExpertReply*, 2>& replies) const;
  void Count(TwinOutcome o);

  const ModelConfig cfg_;
  const TwinAuditOptions options_;
  const ReferenceWeights reference_;
  const Sink sink_;
  const Observer observe_;
  mutable std::mutex mu_;
  std::map<std::tuple<int32_t, int32_t, int32_t>, uint64_t> sampled_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> suspect_ ABSL_GUARDED_BY(mu_);  // answers since a passed audit
  std::set<std::string> quarantined_ ABSL_GUARDED_BY(mu_);
  Counts counts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_TWIN_AUDIT_H_
