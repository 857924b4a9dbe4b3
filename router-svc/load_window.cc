#include "router-svc/load_window.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace moe::router_svc {

using numerics::QbHistogram;

LoadWindow::LoadWindow(int32_t layer, int64_t experts, int64_t top_k, int64_t window_tokens)
    : layer_(layer),
      experts_(experts),
      top_k_(top_k),
      limit_tokens_(window_tokens),
      window_loads_(static_cast<size_t>(experts), 0),
      total_loads_(static_cast<size_t>(experts), 0) {}

absl::StatusOr<ReportResult> LoadWindow::Add(const StatsReport& r, uint64_t current_version,
                                             int64_t k_min) {
  if (static_cast<int64_t>(r.loads.size()) != experts_) {
    return absl::InvalidArgumentError(absl::StrCat("report from ", r.node, ": ", r.loads.size(),
                                                   " loads, layer ", layer_, " has ", experts_,
                                                   " experts"));
  }
  // Bounded before any sum, so nothing wraps: a token picks an expert at most once, and one
  // report never carries more than 2^40 tokens.
  constexpr int64_t kMaxReportTokens = int64_t{1} << 40;
  if (r.tokens < 0 || r.tokens > kMaxReportTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("report from ", r.node, ": ", r.tokens, " tokens (at most 2^40 per report)"));
  }
  int64_t sum = 0;
  for (int64_t v : r.loads) {
    if (v < 0) return absl::InvalidArgumentError("negative load in a report");
    if (v > r.tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("report from ", r.node, ": a load of ", v, " for ", r.tokens, " tokens"));
    }
    sum += v;
  }
  if (r.tokens < 0 || sum != r.tokens * top_k_) {
    return absl::InvalidArgumentError(absl::StrCat("report from ", r.node, ": loads sum to ", sum,
                                                   ", expected tokens * k = ", r.tokens * top_k_));
  }
  if (r.bias_version != current_version || r.tokens == 0) {
    for (int64_t j = 0; j < experts_; ++j) total_loads_[j] += r.loads[j];
    total_tokens_ += r.tokens;
    return ReportResult::kStale;
  }
  MOE_ASSIGN_OR_RETURN(QbHistogram h, QbHistogram::Deserialize(r.qb_histogram));
  if (h.window().layer != layer_ || h.window().bias_version != r.bias_version ||
      h.num_experts() != experts_ || h.tokens() != r.tokens || h.window().top_k != top_k_) {
    return absl::InvalidArgumentError(
        absl::StrCat("report from ", r.node, ": histogram (layer ", h.window().layer, ", version ",
                     h.window().bias_version, ", experts ", h.num_experts(), ", tokens ",
                     h.tokens(), ") does not match the report"));
  }
  if (!std::equal(h.loads().begin(), h.loads().end(), r.loads.begin(), r.loads.end())) {
    return absl::InvalidArgumentError(
        absl::StrCat("report from ", r.node, ": loads differ from the histogram's"));
  }
  if (!window_.empty()) {
    // Merge checks window id, version, range and shape against the window's first report.
    QbHistogram probe = window_.front().hist;
    MOE_RETURN_IF_ERROR(probe.Merge(h));
  }
  std::optional<numerics::BudgetHistogram> budget;
  if (!r.budget_histogram.empty()) {
    MOE_ASSIGN_OR_RETURN(numerics::BudgetHistogram b,
                         numerics::BudgetHistogram::Deserialize(r.budget_histogram));
    const numerics::BudgetWindow& bw = b.window();
    if (bw.layer != layer_ || bw.bias_version != r.bias_version || b.num_experts() != experts_ ||
        b.tokens() != r.tokens || bw.top_k != top_k_) {
      return absl::InvalidArgumentError(
          absl::StrCat("report from ", r.node, ": budget histogram (layer ", bw.layer, ", version ",
                       bw.bias_version, ", experts ", b.num_experts(), ", tokens ", b.tokens(),
                       ", k ", bw.top_k, ") does not match the report"));
    }
    // Each expert's forced and free selections are its load.
    for (int64_t j = 0; j < experts_; ++j) {
      int64_t n = b.forced()[j];
      for (int32_t l = 0; l < bw.bins; ++l) n += b.counts()[j * bw.bins + l];
      if (n != r.loads[j]) {
        return absl::InvalidArgumentError(
            absl::StrCat("report from ", r.node, ": the budget histogram has ", n,
                         " selections of expert ", j, ", the loads ", r.loads[j]));
      }
    }
    const bool same_bins = window_.empty() || !window_.back().budget.has_value() ||
                           window_.back().budget->window().bins == bw.bins;
    if (bw.k_min == k_min && same_bins) budget = std::move(b);
  }
  for (int64_t j = 0; j < experts_; ++j) {
    total_loads_[j] += r.loads[j];
    window_loads_[j] += r.loads[j];
  }
  total_tokens_ += r.tokens;
  window_tokens_ += r.tokens;
  window_.push_back({std::move(h), r.loads, r.tokens, std::move(budget)});
  while (window_.size() > 1 && window_tokens_ - window_.front().tokens >= limit_tokens_) {
    for (int64_t j = 0; j < experts_; ++j) window_loads_[j] -= window_.front().loads[j];
    window_tokens_ -= window_.front().tokens;
    window_.pop_front();
  }
  if (window_.size() > kMaxWindowReports) {  // fold the two oldest together
    Report& a = window_[0];
    const Report& b = window_[1];
    MOE_RETURN_IF_ERROR(a.hist.Merge(b.hist));
    if (a.budget.has_value() && b.budget.has_value()) {
      if (!a.budget->Merge(*b.budget).ok()) a.budget = b.budget;  // bins differ: the newer
    } else if (b.budget.has_value()) {
      a.budget = b.budget;
    }
    for (int64_t j = 0; j < experts_; ++j) a.loads[j] += b.loads[j];
    a.tokens += b.tokens;
    window_.erase(window_.begin() + 1);
  }
  return ReportResult::kCurrent;
}

void LoadWindow::Clear() {
  window_.clear();
  window_tokens_ = 0;
  std::fill(window_loads_.begin(), window_loads_.end(), 0);
}

absl::StatusOr<QbHistogram> LoadWindow::Pooled() const {
  if (window_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("layer ", layer_, ": the window is empty"));
  }
  QbHistogram pooled = window_.front().hist;
  for (size_t i = 1; i < window_.size(); ++i) MOE_RETURN_IF_ERROR(pooled.Merge(window_[i].hist));
  return pooled;
}

absl::StatusOr<numerics::BudgetHistogram> LoadWindow::PooledBudget() const {
  std::optional<numerics::BudgetHistogram> pooled;
  for (const Report& r : window_) {
    if (!r.budget.has_value()) continue;
    if (!pooled.has_value()) {
      pooled = r.budget;
    } else if (!pooled->Merge(*r.budget).ok()) {
      pooled = r.budget;  // another bin count: the newer reports only
    }
  }
  if (!pooled.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer_,
                     ": no budget histogram in the window (no traffic reported since the "
                     "last version)"));
  }
  return *std::move(pooled);
}

absl::StatusOr<RebalancePlan> PlanRebalance(const LoadWindow& w,
                                            const std::vector<int32_t>& shard_of) {
  MOE_ASSIGN_OR_RETURN(QbHistogram pooled, w.Pooled());
  RebalancePlan p;
  p.bias = pooled.Solve();
  p.window_tokens = w.window_tokens();
  p.before = numerics::ComputeBalance(w.window_loads(), shard_of);
  const std::vector<double> predicted = pooled.PredictLoads(p.bias);
  std::vector<int64_t> predicted_loads(predicted.size());
  for (size_t j = 0; j < predicted.size(); ++j) predicted_loads[j] = std::llround(predicted[j]);
  p.predicted_after = numerics::ComputeBalance(predicted_loads, shard_of);
  p.noise_floor_max_vio = numerics::NoiseFloorMaxVio(
      w.experts(), static_cast<double>(w.window_tokens()) * w.top_k() / w.experts());
  return p;
}

}  // namespace moe::router_svc
