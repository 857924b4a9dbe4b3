// qb-sim: Quantile Balancing against its baselines on synthetic skewed router traffic.
//
// Each window draws fresh traffic: sigmoid scores s_ij = sigmoid(N(0,1) + offset_j) with
// per-expert popularity offsets skew * u_j^3 (a few hot experts, a long cold tail), optionally
// drifting (before each window every expert's popularity takes a random-walk step of std drift,
// so the hot set changes gradually over time) and with dead experts (offset
// -12: never in anyone's top-k). Every method routes the same traffic with its current bias,
// is measured, and then updates its bias from that window (causal: the new bias serves the
// next window). Methods: none (bias 0), the sign rule for several gammas, exact QB, and
// histogram QB for several bin counts (traffic split over several nodes whose accumulators are
// merged through their wire form, as in the cluster).
//
//   QbSimOptions opt; opt.window_tokens = 4096;
//   QbSimResult r = RunQbSim(opt);
//   std::cout << QbSimSummary(r);
#ifndef MOE_SERVICES_TOOLS_QB_SIM_H_
#define MOE_SERVICES_TOOLS_QB_SIM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace moe::tools {

struct QbSimOptions {
  int64_t num_experts = 896;
  int64_t top_k = 16;
  int64_t window_tokens = 4096;
  int windows = 30;
  double skew = 3.0;   // logit offset of the hottest experts
  double drift = 0.0;  // std of each expert's popularity random-walk step per window
  int64_t dead = 0;    // experts that no token picks without a bias
  uint64_t seed = 1;
  std::vector<float> gammas = {1e-3f, 1e-2f};
  std::vector<int> bins = {100, 1000};
  int nodes = 2;  // attention nodes the histogram method splits each window over
  // RunPlacementSim: expert-parallel shards, spare expert slots per shard (EPLB's redundant
  // experts), and the bytes of one expert's weights (K3's MXFP4 expert: about 17.5 MB).
  int shards = 8;
  int spare_slots_per_shard = 8;
  double expert_bytes = 17.5e6;
  // EPLB re-plans only when the window before left the shards less balanced than this (a
  // placement that already holds is not reshuffled: every re-plan moves weights).
  double eplb_replan_below = 0.95;
};

struct QbSimRow {
  int window = 0;
  std::string method;
  double max_vio = 0;
  double min_over_target = 0;
  double cv = 0;
  int64_t dead = 0;
};

struct QbSimResult {
  QbSimOptions options;
  std::vector<std::string> methods;
  std::vector<QbSimRow> rows;  // window-major, methods in order
  double noise_floor = 0;      // sqrt(2 ln n) / sqrt(q)
};

QbSimResult RunQbSim(const QbSimOptions& options);

// window,method,max_vio,min_load_over_q,cv,dead
std::string QbSimCsv(const QbSimResult& result);
// One line per method: first and last MaxVio, windows until MaxVio <= kReachFactor * floor,
// mean MaxVio and min-load/q over the last third of the windows.
std::string QbSimSummary(const QbSimResult& result);
inline constexpr double kReachFactor = 1.25;
// Renders MaxVio and min-load/q per window, one line per method, with gnuplot (pngcairo).
absl::Status WriteQbSimChart(const QbSimResult& result, const std::string& png_path);

// Balance by the router vs balance by moving weights, on the same traffic (shards of the
// expert tier, not single experts): "none" (the router's own bias, experts on contiguous
// shards), "qb" (Quantile Balancing's exact step each window, contiguous shards: no weights
// move), "eplb" (no bias; before a window whose predecessor's balancedness fell below
// eplb_replan_below, the expert-parallel load balancer vLLM and SGLang run re-plans the
// placement from that window's loads: replicas of the hottest experts
// in the spare slots, then every replica packed greedily onto the least loaded shard with room,
// the greedy of DeepSeek's EPLB), and "qb+eplb". Per window: the shards' balancedness (mean /
// max tokens per shard, as vLLM exports it), the experts' MaxVio, and the bytes of expert
// weights moved to reach the window's placement.
struct PlacementSimRow {
  int window = 0;
  std::string method;
  double balancedness = 0;  // mean / max shard load
  double expert_max_vio = 0;
  double bytes_moved = 0;
};
struct PlacementSimResult {
  QbSimOptions options;
  std::vector<std::string> methods;
  std::vector<PlacementSimRow> rows;  // window-major, methods in order
  // The balancedness sampling noise alone leaves: 1 / (1 + sqrt(2 ln S) / sqrt(m k / S)).
  double balancedness_floor = 0;
};
PlacementSimResult RunPlacementSim(const QbSimOptions& options);
// One line per method: balancedness first, last and over the last third, the first window
// within kReachFactor of the floor's imbalance, and the bytes moved in all.
std::string PlacementSimSummary(const PlacementSimResult& result);

// EPLB's plan for expert loads on `shards` shards of `slots` slots each (shards * slots >= n):
// every expert one replica, each spare slot to the expert with the most load per replica; then
// the replicas, heaviest first, each to the least loaded shard with a free slot (one that does
// not hold that expert yet, when there is one). replicas[j] >= 1 sums to shards * slots.
struct EplbPlan {
  std::vector<int> replicas;                   // [n]
  std::vector<std::vector<int32_t>> on_shard;  // [shards] expert ids, one per used slot
};
EplbPlan PlanEplb(const std::vector<double>& loads, int shards, int slots);

}  // namespace moe::tools

#endif  // MOE_SERVICES_TOOLS_QB_SIM_H_
