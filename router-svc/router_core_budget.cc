// RouterCore's dynamic-k operations (router_core.h, docs/dynamic-k.md): the budget's thresholds
// solved from the window, stamped on a bias version, solved again when a bias step left them
// stale, and set by an operator.
#include <chrono>
#include <cmath>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "router-svc/router_core.h"
#include "router-svc/router_proto.h"
#include "services/common/logging.h"
#include "services/common/status_macros.h"
#include "services/metrics/service_metrics.h"
#include "services/numerics/dynamic_k.h"
#include "services/transport/security.h"

namespace moe::router_svc {

ExpertBudget RouterCore::SolveBudgetLocked(const LayerState& l, bool* solved) const {
  ExpertBudget budget = l.ledger.current().budget;
  *solved = false;
  absl::StatusOr<numerics::BudgetHistogram> pooled = l.window.PooledBudget();
  if (!pooled.ok() || pooled->tokens() == 0) return budget;
  budget.thresholds = pooled->SolveTable();
  budget.solved_from_tokens = pooled->tokens();
  budget.solved_from_version = l.ledger.current().version;
  *solved = true;
  return budget;
}

std::string RouterCore::StampBudgetLocked(const LayerState& l, const std::vector<float>& bias,
                                          ExpertBudget* budget) const {
  budget->stale = false;
  budget->window_floor = 0;
  if (budget->thresholds.empty()) return "";
  const auto& history = l.ledger.history();
  double moved = std::numeric_limits<double>::infinity();
  if (budget->solved_from_version < history.size()) {
    const std::vector<float>& solved_under = history[budget->solved_from_version].bias;
    moved = 0;
    for (size_t e = 0; e < bias.size() && e < solved_under.size(); ++e) {
      moved = std::max(moved, std::abs(static_cast<double>(bias[e]) - solved_under[e]));
    }
  }
  const int64_t b =
      budget->k_avg >= 1 && budget->k_avg < cfg_.top_k ? budget->k_avg : cfg_.top_k - 1;
  budget->window_floor =
      numerics::BudgetWindowFloor(cfg_.num_experts, b, budget->solved_from_tokens);
  std::string note;
  if (moved > options_.budget_stale_bias) {
    budget->stale = true;
    note = absl::StrCat("; thresholds stale: the bias moved by up to ", absl::SixDigits(moved),
                        " since version ", budget->solved_from_version,
                        ", solved again from the next window");
  }
  if (budget->window_floor > options_.budget_window_floor) {
    const int64_t enough =
        numerics::BudgetWindowTokens(cfg_.num_experts, b, options_.budget_window_floor);
    absl::StrAppend(&note, "; window floor ", absl::SixDigits(budget->window_floor), " above ",
                    absl::SixDigits(options_.budget_window_floor), " at budget ", b,
                    ": a window of ", enough, " tokens meets it");
    MOE_LOG_WARN(
        "layer {}: thresholds from {} tokens leave a kept-load noise floor (MaxVio) of "
        "{:.3f} at budget {} (bound {:.3f}, --budget_window_floor); {} tokens meet it",
        l.window.layer(), budget->solved_from_tokens, budget->window_floor, b,
        options_.budget_window_floor, enough);
  }
  return note;
}

absl::Status RouterCore::ResolveStaleBudgetLocked(LayerState& l) {
  const ExpertBudget& cur = l.ledger.current().budget;
  // Only for a budget in use: without one nothing is served from the thresholds but requests'
  // caps, and a version of its own every window would restart the QB window for nothing.
  if (!cur.stale || cur.thresholds.empty() || cur.k_avg < 1 || cur.k_avg >= cfg_.top_k) {
    return absl::OkStatus();
  }
  absl::StatusOr<numerics::BudgetHistogram> pooled = l.window.PooledBudget();
  if (!pooled.ok()) return absl::OkStatus();
  const int64_t b = cur.k_avg;  // in [1, k) here
  // As many tokens as the stale thresholds had, or a window that meets the floor if fewer.
  const int64_t want = std::max<int64_t>(
      1, std::min(cur.solved_from_tokens,
                  numerics::BudgetWindowTokens(cfg_.num_experts, b, options_.budget_window_floor)));
  if (pooled->tokens() < want) return absl::OkStatus();
  bool solved = false;
  ExpertBudget budget = SolveBudgetLocked(l, &solved);
  if (!solved) return absl::OkStatus();
  std::vector<float> bias = l.ledger.current().bias;
  const std::string note = StampBudgetLocked(l, bias, &budget);
  const uint64_t from = l.ledger.current().version;
  l.ledger.Append(std::move(bias), std::move(budget),
                  absl::StrCat("thresholds solved again under version ", from, " from ",
                               pooled->tokens(), " tokens", note),
                  UnixMs());
  return PublishBiasLocked(l);
}

absl::Status RouterCore::SetBudget(int32_t layer, int32_t k_avg, const std::string& reason,
                                   v1::LayerBias* resp) {
  std::lock_guard<std::mutex> lock(mu_);
  MOE_ASSIGN_OR_RETURN(LayerState * l, LayerLocked(layer));
  if (k_avg < 1 || k_avg > cfg_.top_k) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, ": expert budget ", k_avg,
                                                   " outside [1, top-k = ", cfg_.top_k, "]"));
  }
  bool solved = false;
  ExpertBudget budget = SolveBudgetLocked(*l, &solved);
  if (k_avg < cfg_.top_k && budget.thresholds.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer, ": no traffic reported with bias version ", l->ledger.current().version,
        " to solve the budget's thresholds from yet; send traffic, then set the budget"));
  }
  budget.k_avg = k_avg;
  std::vector<float> bias = l->ledger.current().bias;
  const std::string note = StampBudgetLocked(*l, bias, &budget);
  // A budget is set to be served: thresholds the bias has moved away from (a Rebalance since
  // their solve, and no traffic under the new bias yet) are not, so it is refused as before any
  // traffic, saying why.
  if (k_avg < cfg_.top_k && budget.stale) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, ": the budget's thresholds were solved under bias version ",
                     budget.solved_from_version,
                     " and the bias has moved since; no traffic reported with "
                     "bias version ",
                     l->ledger.current().version,
                     " to solve them again from yet; send traffic, then set the budget"));
  }
  const std::string why =
      solved ? absl::StrCat(reason, " ", k_avg, " of ", cfg_.top_k, " (thresholds from ",
                            budget.solved_from_tokens, " tokens", note, ")")
             : absl::StrCat(reason, " ", k_avg, " of ", cfg_.top_k, " (thresholds of version ",
                            budget.solved_from_version, note, ")");
  l->ledger.Append(std::move(bias), std::move(budget), why, UnixMs());
  MOE_RETURN_IF_ERROR(PublishBiasLocked(*l));
  *resp = ToProto(l->ledger.current());
  return absl::OkStatus();
}

}  // namespace moe::router_svc
