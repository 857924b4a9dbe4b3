// Dynamic k (docs/math.md section 4.1): a per-layer expert budget k_avg <= k. Each token still
// ranks its top-k with the selection-only bias; then it keeps its first k_min selections and any
// other selection of expert j whose sigmoid score s clears the expert's published threshold
// theta_j (the same test as biased score s + bias_j >= theta_j + bias_j), and its weights are
// renormalized over the kept experts as K3 renormalizes. The thresholds are quantile-balanced:
// for budget b, expert j keeps the top b / k of the selections it had in a window of traffic, so
// loads stay as even as QB made them and the mean experts per token is b. A token's output never
// depends on its batch: the thresholds are parameters the router publishes with a bias version.
//
//   // router-svc, from the attention nodes' reports of one window:
//   MOE_ASSIGN_OR_RETURN(BudgetHistogram h, BudgetHistogram::Create(window, experts));
//   MOE_RETURN_IF_ERROR(h.Accumulate(full_routing, scores.data()));  // on each attention node
//   std::vector<float> table = pooled.SolveTable();                  // [k - 1, E]
//   // attention-svc, per batch, budget b < k:
//   ApplyBudget(scores, E, {k_min, BudgetRow(table, b, E)}, renormalize, scale, &routing);
#ifndef MOE_SERVICES_NUMERICS_DYNAMIC_K_H_
#define MOE_SERVICES_NUMERICS_DYNAMIC_K_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "services/numerics/router.h"

namespace moe::numerics {

// The expert id of a slot the budget dropped (its weight is 0). Kept slots come first, in rank
// order; dropped slots fill the rest of the token's k slots.
inline constexpr int32_t kDroppedSlot = -1;

struct BudgetRule {
  int64_t k_min = 1;
  // [E] theta_j on the sigmoid score; null keeps every selection (today's routing).
  const float* thresholds = nullptr;
  // > 0: the second mode, top-p by routing weight, instead of the thresholds: a token keeps the
  // fewest of its top-k, largest router score first (ties: rank order), whose share of its
  // top-k scores reaches top_p, and at least k_min (docs/math.md 4.1, "Top-p"). Not balanced:
  // which experts lose depends on each token's own weights.
  double top_p = 0;
};

// Budget b's row of a threshold table [k - 1, E] (b in [1, k - 1]).
inline const float* BudgetRow(const std::vector<float>& table, int64_t budget, int64_t experts) {
  return table.data() + (budget - 1) * experts;
}

// Applies the rule to a full top-k routing of scores [T, E] (rank order, as SelectExperts
// returns it): slot j of token t stays when j < k_min or scores[t, e] >= theta[e]. The kept
// weights are recomputed exactly as SelectExperts computes them, over the kept slots in rank
// order (so a token that keeps all k is bit-identical). Returns the number of kept pairs.
// kept_mass (optional) gets the sum over tokens of the routing weight mass the kept experts
// carry: (sum of kept scores) / (sum of the token's top-k scores), 1 for a token that keeps all
// (what a budget keeps of the full layer's routing, in the users' terms of docs/math.md 4.1).
int64_t ApplyBudget(const float* scores, int64_t num_experts, const BudgetRule& rule,
                    bool renormalize, float scaling_factor, Routing* routing,
                    double* kept_mass = nullptr);

// The top_p at which the top-p rule keeps `budget` experts per token on average over a window of
// scores [m, n] routed with `bias` (the smallest p in [0, 1] that keeps at least that many, to
// 1e-7): matched to the thresholds' budget on the same traffic. INVALID_ARGUMENT for a budget
// outside [k_min, k] or a malformed window.
absl::StatusOr<double> TopPForBudget(absl::Span<const float> scores, int64_t m, int64_t n,
                                     absl::Span<const float> bias, int64_t k, int64_t k_min,
                                     double budget);

// How often two layer outputs [tokens, hidden] (fp32 values) point the same way for a next-token
// head: the share of tokens whose argmax over a fixed random projection [hidden, kTop1Columns]
// (normal entries, seed kTop1Seed: the same in every process; a stand-in for an LM head, which
// the layer service does not have) is the same for both. 1 for identical outputs.
inline constexpr int64_t kTop1Columns = 256;
inline constexpr uint64_t kTop1Seed = 0x70901a7e;
double Top1Agreement(const float* a, const float* b, int64_t tokens, int64_t hidden);
// ||a - ref|| / ||ref|| over n values, in double (0 for a zero ref): how far a budget moved the
// layer's output from the full top-k's.
double RelativeL2(const float* a, const float* ref, size_t n);

// How many free selections each expert's threshold must keep for budget b in a window of
// `tokens` tokens. Expert j had n_j selections, f_j of them at ranks < k_min (always kept); it
// keeps max(f_j, lambda * n_j) in all, so need_j = lambda * n_j - f_j of its free ones (highest
// scores first; <= 0: none). lambda is b / k when no expert's forced selections pass that share,
// else the value (found by bisection) that makes the kept total b * tokens: every expert keeps
// the same share of its selections except those the forced ranks alone put above it.
std::vector<double> BudgetNeeds(int64_t budget, int64_t k, int64_t tokens,
                                const std::vector<int64_t>& selections,
                                const std::vector<int64_t>& forced);

// The integer count of free selections each expert keeps: need_j (BudgetNeeds) clamped to
// [0, free_j], apportioned by largest remainder so that the counts sum to exactly `total` (the
// window's b * tokens minus its forced selections; clamped to [0, sum of free_j]): each expert
// keeps floor(x_j), and the experts with the largest fractional parts one more (ties: the lower
// expert id first); should the floors pass the total (rounding of the bisection), the smallest
// fractional parts give one back. Per expert within 1 of x_j, so the total is reached when it
// lies within n of the floors' sum (always, for BudgetNeeds' needs). Rounding each count on its own
// missed the budget by -5.6% (K3, b = 8) to +1.4% (mid, b = 4) in the window itself.
std::vector<int64_t> ApportionKept(const std::vector<double>& need,
                                   const std::vector<int64_t>& free_counts, int64_t total);

// The exact thresholds of one window of raw sigmoid scores [m, n] routed with `bias`:
// theta_j for budget b is the c_j-th largest free score of expert j, c_j its ApportionKept count
// (total b * m - forced), so the window itself keeps exactly b * m pairs (without ties in the
// scores); +inf when c_j = 0 (only forced selections stay), 0 when c_j = the free count.
// Returns the table [k - 1, n]. The single-node form, and the tests' oracle for the histogram.
absl::StatusOr<std::vector<float>> ExactBudgetThresholds(absl::Span<const float> scores, int64_t m,
                                                         int64_t n, absl::Span<const float> bias,
                                                         int64_t k, int64_t k_min);

// What a window of `tokens` tokens can tell about budget b over `experts` experts: thresholds
// solved from it keep each expert's share up to the sampling noise of about b * tokens / experts
// kept selections per expert, so the kept loads on fresh traffic carry that noise's MaxVio on
// top of their own: NoiseFloorMaxVio(experts, b * tokens / experts) (docs/math.md, "The
// window"). +inf for an empty window.
double BudgetWindowFloor(int64_t experts, int64_t budget, int64_t tokens);
// The fewest tokens whose BudgetWindowFloor is at most `bound` (> 0).
int64_t BudgetWindowTokens(int64_t experts, int64_t budget, double bound);

struct BudgetWindow {
  uint64_t bias_version = 0;
  int32_t layer = 0;
  int64_t top_k = 0;
  int64_t k_min = 1;
  int32_t bins = 512;  // uniform over the sigmoid's [0, 1]
};

// Per expert: the count of selections at ranks < k_min, and a histogram of the scores of the
// others. Integer counts, so Merge is exact however traffic is split over attention nodes.
class BudgetHistogram {
 public:
  // INVALID_ARGUMENT for top_k < 2, k_min outside [0, top_k], bins outside [1, 65536].
  static absl::StatusOr<BudgetHistogram> Create(const BudgetWindow& window, int64_t num_experts);

  // full: the batch's top-k routing before any budget (rank order); scores [tokens, E].
  absl::Status Accumulate(const Routing& full, const float* scores);
  // Adds another node's histogram of the same window; refuses a different bias version, layer,
  // shape or k_min (the message says which).
  absl::Status Merge(const BudgetHistogram& other);
  // The table [k - 1, E]: per budget and expert, theta = the score above which its
  // ApportionKept count of the free selections lie, interpolated inside its bin (+inf and 0 as
  // in ExactBudgetThresholds).
  // An empty window gives all zeros (every selection kept).
  std::vector<float> SolveTable() const;

  // Binary form (varint counts, zero runs) for ReportStatsRequest.budget_histogram; Deserialize
  // validates everything (sizes, counts summing to tokens * k).
  std::string Serialize() const;
  static absl::StatusOr<BudgetHistogram> Deserialize(absl::string_view bytes);

  const BudgetWindow& window() const { return window_; }
  int64_t num_experts() const { return num_experts_; }
  int64_t tokens() const { return tokens_; }
  const std::vector<int64_t>& forced() const { return forced_; }  // [E]
  // counts()[j * bins + l]: free selections of expert j with score in bin l
  const std::vector<uint32_t>& counts() const { return counts_; }

 private:
  BudgetHistogram() = default;

  BudgetWindow window_;
  int64_t num_experts_ = 0;
  int64_t tokens_ = 0;
  std::vector<int64_t> forced_;
  std::vector<uint32_t> counts_;
};

}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_DYNAMIC_K_H_
