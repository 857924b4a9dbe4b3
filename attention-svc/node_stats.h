// What the attention node reports to router-svc about its traffic: per hosted layer and bias
// version, Quantile Balancing's histogram and loads and dynamic k's score histogram (from the
// selections before any budget), and the full-k checks measured since the last report.
// Thread-safe; no gRPC: TakeReports hands over the messages, the server sends them.
//
//   NodeStats stats({cfg.num_experts, cfg.top_k, qb_bins, budget_bins});
//   stats.Accumulate(layer, *bias, scores, tokens, full);  // on every Forward
//   for (auto& r : stats.TakeReports(node, auto_cap)) ...  // every report interval
#ifndef MOE_ATTENTION_SVC_NODE_STATS_H_
#define MOE_ATTENTION_SVC_NODE_STATS_H_

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/types/span.h"
#include "attention-svc/routing_view.h"
#include "moe/v1/router.pb.h"
#include "services/numerics/dynamic_k.h"
#include "services/numerics/qb.h"
#include "services/numerics/router.h"

namespace moe::attention_svc {

struct NodeStatsOptions {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int qb_bins = 1000;
  int budget_bins = 512;
};

class NodeStats {
 public:
  explicit NodeStats(const NodeStatsOptions& o) : o_(o) {}

  // One routed batch under `bias`: its router scores [tokens, num_experts] and its selections
  // before any budget (`full`, the top-k). A batch of a newer bias version closes the layer's
  // window: it is reported as it was.
  void Accumulate(int32_t layer, const BiasEntry& bias, absl::Span<const float> scores,
                  int64_t tokens, const numerics::Routing& full);
  // One full-k check of a budgeted answer (the relative L2 difference, the routing mass kept
  // and the top-1 agreement): summed into the layer's next report.
  void AddCheck(int32_t layer, double rel_diff, double mass_kept, double top1);
  // Every window with traffic since the last call, the closed ones first, as reports from
  // `node`; the checks ride with each layer's newest. auto_budget: the automatic cap (0 off).
  std::vector<v1::ReportStatsRequest> TakeReports(const std::string& node, int32_t auto_budget);

 private:
  struct LayerStats {
    numerics::QbHistogram qb;
    std::optional<numerics::BudgetHistogram> budget;
  };
  struct CheckSums {
    int64_t checks = 0;
    double rel_diff = 0, mass_kept = 0, top1 = 0;
  };
  const NodeStatsOptions o_;
  std::mutex mu_;
  std::map<int32_t, std::optional<LayerStats>> open_ ABSL_GUARDED_BY(mu_);
  std::vector<LayerStats> closed_ ABSL_GUARDED_BY(mu_);  // windows of an older bias version
  std::map<int32_t, CheckSums> checks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_NODE_STATS_H_
