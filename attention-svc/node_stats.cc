#include "attention-svc/node_stats.h"

#include <utility>

namespace moe::attention_svc {

void NodeStats::Accumulate(int32_t layer, const BiasEntry& bias, absl::Span<const float> scores,
                           int64_t tokens, const numerics::Routing& full) {
  const uint64_t version = bias.version;
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<LayerStats>& acc = open_[layer];
  if (acc.has_value() && acc->qb.window().bias_version != version) {
    closed_.push_back(std::move(*acc));
    acc.reset();
  }
  if (!acc.has_value()) {
    numerics::QbWindow w;
    w.window_id = version;
    w.bias_version = version;
    w.layer = layer;
    w.top_k = o_.top_k;
    w.bins = o_.qb_bins;
    auto h = numerics::QbHistogram::Create(w, bias.bias);
    if (!h.ok()) return;  // the bias was validated upstream; nothing to report otherwise
    acc = LayerStats{*std::move(h), std::nullopt};
    numerics::BudgetWindow bw;
    bw.bias_version = version;
    bw.layer = layer;
    bw.top_k = o_.top_k;
    bw.k_min = bias.k_min;
    bw.bins = o_.budget_bins;
    auto b = numerics::BudgetHistogram::Create(bw, o_.num_experts);
    if (b.ok()) acc->budget = *std::move(b);  // top-k 1 has no budget to report
  }
  (void)acc->qb.Accumulate(scores, tokens);
  // Dynamic k's thresholds come from the selections before any budget (the full top-k).
  if (acc->budget.has_value()) (void)acc->budget->Accumulate(full, scores.data());
}

void NodeStats::AddCheck(int32_t layer, double rel_diff, double mass_kept, double top1) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckSums& sums = checks_[layer];
  sums.checks += 1;
  sums.rel_diff += rel_diff;
  sums.mass_kept += mass_kept;
  sums.top1 += top1;
}

std::vector<v1::ReportStatsRequest> NodeStats::TakeReports(const std::string& node,
                                                           int32_t auto_budget) {
  std::vector<LayerStats> out;
  std::map<int32_t, CheckSums> costs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out.swap(closed_);
    costs.swap(checks_);
    for (auto& [layer, acc] : open_) {
      if (acc.has_value() && acc->qb.tokens() > 0) out.push_back(std::move(*acc));
      acc.reset();
    }
  }
  std::vector<v1::ReportStatsRequest> reports;
  for (size_t i = 0; i < out.size(); ++i) {
    const numerics::QbHistogram& h = out[i].qb;
    v1::ReportStatsRequest& req = reports.emplace_back();
    req.set_node(node);
    req.set_layer(h.window().layer);
    req.set_bias_version(h.window().bias_version);
    req.set_tokens(h.tokens());
    *req.mutable_loads() = {h.loads().begin(), h.loads().end()};
    req.set_qb_histogram(h.Serialize());
    if (out[i].budget.has_value()) req.set_budget_histogram(out[i].budget->Serialize());
    req.set_auto_budget(auto_budget);
    // The checks go with the layer's newest report (the last of its in `out`), which the
    // router counts for the current version.
    bool newest = true;
    for (size_t j = i + 1; j < out.size(); ++j) {
      if (out[j].qb.window().layer == h.window().layer) newest = false;
    }
    auto cost = costs.find(h.window().layer);
    if (newest && cost != costs.end()) {
      req.set_budget_checks(cost->second.checks);
      req.set_budget_rel_diff_sum(cost->second.rel_diff);
      req.set_budget_mass_kept_sum(cost->second.mass_kept);
      req.set_budget_top1_agree_sum(cost->second.top1);
    }
  }
  return reports;
}

}  // namespace moe::attention_svc
