// Quantile Balancing (docs/quantile-balancing.md): per-expert selection biases computed from score
// quantiles so that every expert gets its target load q = m*k/n, with no auxiliary loss and no
// step size. Plain deterministic C++; no gRPC.
//
// Three forms:
//   QbExactStep     one step from the raw fp32 scores of a window (single node, exact quantiles);
//   QbHistogram     the distributed form (K3 Appendix D): each attention node accumulates
//                   per-expert histograms of the required bias r_ij = alpha_i - s_ij over a range
//                   fixed by the routing bias; integer counts merge exactly; Solve() interpolates
//                   inside the bin;
//   SignRuleStep    DeepSeek-V3's b += gamma * sign(q - load), the baseline.
// And the balance metrics (MaxVio, CV, min load / q, dead experts, per-shard max/mean).
//
//   MOE_ASSIGN_OR_RETURN(QbStep step, QbExactStep(scores, m, n, bias, k));
//   bias = step.bias;  // applies to the next window, never to the one it came from
//
//   QbWindow w; w.window_id = 7; w.bias_version = version; w.layer = 1; w.top_k = k;
//   MOE_ASSIGN_OR_RETURN(QbHistogram h, QbHistogram::Create(w, bias));
//   MOE_RETURN_IF_ERROR(h.Accumulate(scores, m));      // on each attention node
//   MOE_RETURN_IF_ERROR(pooled.Merge(h));               // on the control plane
//   std::vector<float> next = pooled.Solve();
#ifndef MOE_SERVICES_NUMERICS_QB_H_
#define MOE_SERVICES_NUMERICS_QB_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace moe::numerics {

// The largest |bias| QB takes: scores lie in [0, 1], and a bias near 2^53 leaves the
// histogram's range [min - 1, max + 1] empty in double arithmetic.
inline constexpr float kMaxQbBias = 1e6f;

// Checks 1 <= k < n, scores.size() == m * n, bias.size() == n, every value finite, every
// |bias| <= kMaxQbBias.
absl::Status ValidateQbInput(absl::Span<const float> scores, int64_t m, int64_t n,
                             absl::Span<const float> bias, int64_t k);

// Routes with the bias (top-k of s_i + b, rank order) and counts the load of each expert.
std::vector<int64_t> RouteLoads(absl::Span<const float> scores, int64_t m, int64_t n,
                                absl::Span<const float> bias, int64_t k);

struct QbStep {
  std::vector<int32_t> routes;  // [m, k] with the old bias, rank order
  std::vector<float> cutoffs;   // [m] alpha_i: the (k+1)-th biased score of token i
  std::vector<int64_t> loads;   // [n] with the old bias
  std::vector<float> raw_bias;  // [n] b-hat, before centering
  std::vector<float> bias;      // [n] b-hat - mean(b-hat): the new bias
};

// One exact QB step. b-hat_j = -(the (floor(q)+1)-th largest margin s_ij - alpha_i of column j),
// which for integer q is docs/quantile-balancing.md's (q+1)-th largest and for any q keeps the
// fixed-cutoff sandwich
// #{s_ij + b-hat_j > alpha_i} <= q <= #{s_ij + b-hat_j >= alpha_i}. An empty window (m = 0)
// keeps the bias.
absl::StatusOr<QbStep> QbExactStep(absl::Span<const float> scores, int64_t m, int64_t n,
                                   absl::Span<const float> bias, int64_t k);

// DeepSeek-V3's rule: b_j + gamma * sign(q - load_j), with q = total load / n. Not centered.
std::vector<float> SignRuleStep(absl::Span<const float> bias, absl::Span<const int64_t> loads,
                                float gamma);

// Subtracts the mean (computed in double): adding a constant to all biases changes no routing.
std::vector<float> CenterBias(absl::Span<const float> bias);

struct QbWindow {
  uint64_t window_id = 0;
  uint64_t bias_version = 0;
  int32_t layer = 0;
  int64_t top_k = 0;
  int32_t bins = 1000;  // K3 uses 1000
};

// Per-expert histograms of the required bias r_ij = alpha_i - s_ij for one window of one layer.
// Range fixed from the routing bias: [min(b) - 1, max(b) + 1], `bins` uniform bins, floor
// binning, values outside clamped to the end bins. Counts are integers, so Merge is exact: the
// sum of per-node histograms equals the pooled histogram bit for bit, however traffic is split.
class QbHistogram {
 public:
  static absl::StatusOr<QbHistogram> Create(const QbWindow& window,
                                            absl::Span<const float> routing_bias);

  // Routes scores [m, n] with the routing bias, counts loads, bins r_ij for every (i, j).
  absl::Status Accumulate(absl::Span<const float> scores, int64_t m);
  // Adds another node's histogram of the same window; rejects a different window id, bias
  // version, layer, shape or range (the message says which).
  absl::Status Merge(const QbHistogram& other);
  // The new centered bias. Per expert: q = M*k/n, need = ceil(q), l = first bin whose cumulative
  // count reaches need, c = count before l, h = count in l:
  //   b-hat_j = lo + (l + clamp((q - c) / h, 0, 1)) * w, then centered.
  // An empty window returns the routing bias unchanged.
  std::vector<float> Solve() const;
  // The loads this window would have had under `bias` at the fixed-cutoff approximation
  // (docs/quantile-balancing.md): load_j = #{i : r_ij < b_j + c}, read off the histogram with
  // linear interpolation inside a bin, where the constant c (routing ignores a common shift, fixed
  // cutoffs do not) makes the loads sum to tokens * k. At the routing bias this returns the
  // measured loads up to binning; at Solve()'s bias every load is close to q.
  std::vector<double> PredictLoads(absl::Span<const float> bias) const;

  // Compact binary form (LEB128 varints for the counts) that travels from attention nodes to
  // the control plane; Deserialize validates everything (sizes, range, row sums == tokens).
  std::string Serialize() const;
  static absl::StatusOr<QbHistogram> Deserialize(absl::string_view bytes);

  const QbWindow& window() const { return window_; }
  int64_t num_experts() const { return num_experts_; }
  int64_t tokens() const { return tokens_; }
  double lo() const { return lo_; }
  double hi() const { return hi_; }
  double bin_width() const { return (hi_ - lo_) / window_.bins; }
  const std::vector<float>& routing_bias() const { return bias_; }
  const std::vector<int64_t>& loads() const { return loads_; }
  // counts()[j * bins + l]
  const std::vector<uint32_t>& counts() const { return counts_; }

 private:
  QbHistogram() = default;
  // Accumulate of a batch that gets one thread: counted straight into the window's table. A
  // piece's own table costs a pass over all n x bins counts whatever the batch (1.1 ms per
  // batch at K3's n = 896 and 1,000 bins on AMD Zen 3, one token or sixteen;
  // tests/bench/qb_bench.cc).
  absl::Status AccumulateDirect(absl::Span<const float> scores, int64_t m, double inv_w);

  QbWindow window_;
  int64_t num_experts_ = 0;
  double lo_ = 0, hi_ = 0;
  std::vector<float> bias_;
  int64_t tokens_ = 0;
  std::vector<int64_t> loads_;
  std::vector<uint32_t> counts_;
};

struct BalanceMetrics {
  double target = 0;               // q = total load / n
  double max_vio = 0;              // max_j load_j / q - 1
  double cv = 0;                   // std(load) / q
  double min_over_target = 0;      // min_j load_j / q
  int64_t dead = 0;                // experts with load 0
  double shard_max_over_mean = 0;  // per-shard load max / mean (1 when no placement is given)
};

// shard_of_expert: optional placement, expert j -> shard id in [0, shards).
BalanceMetrics ComputeBalance(absl::Span<const int64_t> loads,
                              absl::Span<const int32_t> shard_of_expert = {});

// sqrt(2 ln n) / sqrt(q): the MaxVio that sampling noise alone produces
// (docs/quantile-balancing.md).
double NoiseFloorMaxVio(int64_t n, double q);

}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_QB_H_
