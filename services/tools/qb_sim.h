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

}  // namespace moe::tools

#endif  // MOE_SERVICES_TOOLS_QB_SIM_H_
