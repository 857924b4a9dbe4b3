// What the attention node knows of the control plane, as it sees it: per hosted layer the bias
// version in force (with dynamic k's budget and thresholds), the placement route to the shards,
// and whether every expert has a healthy shard. Fed by router-svc's watches (ApplyPlacement,
// ApplyBias), read by every Forward (Get) and by the fronts' readiness. Thread-safe; no gRPC.
//
//   RoutingView view(cfg.num_experts, cfg.top_k);
//   view.Host(layer, checkpoint_bias);        // at load: bias version 0
//   bool ready = view.ApplyPlacement(p);      // every hosted layer covered
//   RoutingView::Snapshot s = view.Get(layer);  // s.bias, s.route (null before a placement)
#ifndef MOE_ATTENTION_SVC_ROUTING_VIEW_H_
#define MOE_ATTENTION_SVC_ROUTING_VIEW_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "attention-svc/dispatch_plan.h"
#include "moe/v1/router.pb.h"

namespace moe::attention_svc {

struct BiasEntry {
  uint64_t version = 0;
  std::vector<float> bias;
  // Dynamic k (docs/math.md section 4.1) as the version has it: the layer's budget, k_min and
  // the threshold table [k - 1, E] (empty: never solved, only the full top-k is served).
  int32_t k_avg = 0;
  int32_t k_min = 1;
  std::vector<float> thresholds;
  // Solved under a bias that has moved since (ExpertBudget.stale): not applied, the full top-k
  // is served until router-svc publishes them solved again.
  bool stale = false;
  uint64_t solved_from_version = 0;
  bool usable() const { return !thresholds.empty() && !stale; }
};

class RoutingView {
 public:
  RoutingView(int64_t num_experts, int64_t top_k) : num_experts_(num_experts), top_k_(top_k) {}

  // A hosted layer, with the checkpoint's bias as version 0 (the full top-k, no thresholds).
  void Host(int32_t layer, std::vector<float> checkpoint_bias);
  std::vector<int32_t> layers() const;
  bool hosts(int32_t layer) const;

  // A placement from router-svc: each hosted layer's route rebuilt. Whether every hosted
  // layer has a healthy shard for every expert.
  bool ApplyPlacement(const v1::Placement& p);
  // A bias version: false (ignored) for a layer not hosted here or of another width. A budget
  // of an impossible k_avg keeps k; a threshold table of another size is dropped.
  bool ApplyBias(const v1::LayerBias& b);

  struct Snapshot {
    std::shared_ptr<const BiasEntry> bias;    // null: the layer is not hosted
    std::shared_ptr<const LayerRoute> route;  // null: no placement yet
  };
  Snapshot Get(int32_t layer) const;
  bool LayerReady(int32_t layer) const;
  // Every hosted layer ready (and at least one hosted).
  bool AllReady() const;
  v1::Placement placement() const;  // the last one from router-svc
  // Whether shard@endpoint serves a route of a hosted layer now.
  bool Placed(const std::string& shard_at_endpoint) const;
  // The highest budget a hosted layer serves (k where its thresholds are not usable).
  int32_t BudgetCeiling() const;

 private:
  const int64_t num_experts_, top_k_;
  mutable std::mutex mu_;
  std::map<int32_t, std::shared_ptr<const BiasEntry>> bias_ ABSL_GUARDED_BY(mu_);
  std::map<int32_t, std::shared_ptr<const LayerRoute>> routes_ ABSL_GUARDED_BY(mu_);
  std::map<int32_t, bool> covered_ ABSL_GUARDED_BY(mu_);
  v1::Placement placement_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_ROUTING_VIEW_H_
