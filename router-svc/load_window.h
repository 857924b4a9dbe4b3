// One layer's load statistics as router-svc keeps them: the window of attention-node reports
// routed with the current bias version (their Quantile Balancing histograms and loads,
// bounded to about window_tokens tokens and kMaxWindowReports reports), and the totals since
// start over every version. It owns that state and nothing else. PlanRebalance runs the
// histogram form of Quantile Balancing on the pooled window (docs/quantile-balancing.md).
//
//   LoadWindow w(/*layer=*/1, /*experts=*/128, /*top_k=*/8, /*window_tokens=*/65536);
//   MOE_ASSIGN_OR_RETURN(ReportResult r, w.Add(report, ledger.current().version));
//   MOE_ASSIGN_OR_RETURN(RebalancePlan p, PlanRebalance(w, shard_of));
#ifndef MOE_ROUTER_SVC_LOAD_WINDOW_H_
#define MOE_ROUTER_SVC_LOAD_WINDOW_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "services/numerics/dynamic_k.h"
#include "services/numerics/qb.h"

namespace moe::router_svc {

// Reports beyond this are folded into the oldest, so memory stays bounded.
inline constexpr int kMaxWindowReports = 32;

// What an attention node reports for one layer (proto/moe/v1/router.proto ReportStatsRequest).
struct StatsReport {
  std::string node;
  int32_t layer = 0;
  uint64_t bias_version = 0;
  int64_t tokens = 0;
  std::vector<int64_t> loads;    // [E] routed (token, expert) pairs
  std::string qb_histogram;      // QbHistogram::Serialize
  std::string budget_histogram;  // BudgetHistogram::Serialize, empty: none
};

enum class ReportResult {
  kCurrent,  // joined the window
  kStale,    // routed with another bias version (or empty): counted in the totals only
};

class LoadWindow {
 public:
  LoadWindow(int32_t layer, int64_t experts, int64_t top_k, int64_t window_tokens);

  // Checks everything before it counts anything: a refused report (INVALID_ARGUMENT saying
  // why) changes nothing. k_min: the current version's (a budget histogram of another k_min,
  // from before a change, is left out of the window; the rest of the report counts).
  absl::StatusOr<ReportResult> Add(const StatsReport& r, uint64_t current_version,
                                   int64_t k_min = 1);
  // A new bias version: the next window starts empty (the totals stay).
  void Clear();

  bool empty() const { return window_.empty(); }
  size_t reports() const { return window_.size(); }
  int64_t window_tokens() const { return window_tokens_; }
  const std::vector<int64_t>& window_loads() const { return window_loads_; }
  const std::vector<int64_t>& total_loads() const { return total_loads_; }
  int64_t total_tokens() const { return total_tokens_; }
  int32_t layer() const { return layer_; }
  int64_t experts() const { return experts_; }
  int64_t top_k() const { return top_k_; }
  // The window's reports merged (FAILED_PRECONDITION when empty).
  absl::StatusOr<numerics::QbHistogram> Pooled() const;
  // The window's budget histograms merged (dynamic k; FAILED_PRECONDITION when none): reports
  // whose budget histogram has the k_min given to Add.
  absl::StatusOr<numerics::BudgetHistogram> PooledBudget() const;

 private:
  struct Report {
    numerics::QbHistogram hist;
    std::vector<int64_t> loads;
    int64_t tokens = 0;
    std::optional<numerics::BudgetHistogram> budget;
  };
  const int32_t layer_;
  const int64_t experts_, top_k_, limit_tokens_;
  std::deque<Report> window_;
  int64_t window_tokens_ = 0;
  std::vector<int64_t> window_loads_, total_loads_;
  int64_t total_tokens_ = 0;
};

struct RebalancePlan {
  std::vector<float> bias;  // the QB solution, centered
  numerics::BalanceMetrics before, predicted_after;
  double noise_floor_max_vio = 0;
  int64_t window_tokens = 0;
};

// One QB step from the window; shard_of (expert -> shard, may be empty) for the per-shard
// figures. FAILED_PRECONDITION when the window is empty.
absl::StatusOr<RebalancePlan> PlanRebalance(const LoadWindow& w,
                                            const std::vector<int32_t>& shard_of);

}  // namespace moe::router_svc

#endif  // MOE_ROUTER_SVC_LOAD_WINDOW_H_
