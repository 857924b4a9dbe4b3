// qb-sim: Quantile Balancing vs no balancing and the sign rule on synthetic skewed traffic.
//
//   qb-sim [--experts 896] [--top_k 16] [--window 4096] [--windows 30] [--skew 3.0]
//          [--drift 0.0] [--dead 0] [--seed 1] [--nodes 2] [--out qb-sim]
//          [--shards 8] [--spare_slots 8] [--expert_mb 17.5]
// Writes OUT.csv and OUT.png and prints a summary table with the noise floor, then the
// router-vs-weights comparison on the shards (QB vs EPLB's placement, qb_sim.h).
#include <cstdio>
#include <fstream>
#include <string>

#include "services/common/flags.h"
#include "services/tools/qb_sim.h"

int main(int argc, char** argv) {
  moe::tools::QbSimOptions o;
  std::string out = "qb-sim";
  int64_t nodes = o.nodes;
  moe::SvcFlags f("qb-sim",
                  "Quantile Balancing vs no balancing and the sign rule on synthetic skewed "
                  "traffic; writes OUT.csv, OUT.png and a summary.");
  f.Int64("experts", &o.num_experts, "experts n");
  f.Int64("top_k", &o.top_k, "experts per token k");
  f.Int64("window", &o.window_tokens, "tokens per window");
  f.Int("windows", &o.windows, "windows");
  f.Double("skew", &o.skew, "router skew");
  f.Double("drift", &o.drift, "random-walk std of each expert's popularity per window");
  f.Int64("dead", &o.dead, "dead experts (logit offset -12)");
  f.Uint64("seed", &o.seed, "seed");
  f.Int64("nodes", &nodes, "attention nodes each window is split over (1..64)");
  f.String("out", &out, "output prefix");
  double expert_mb = o.expert_bytes / 1e6;
  f.Int("shards", &o.shards, "expert-tier shards of the router-vs-weights comparison (0: skip it)");
  f.Int("spare_slots", &o.spare_slots_per_shard,
        "spare expert slots per shard (EPLB's redundant experts)");
  f.Double("expert_mb", &expert_mb, "MB of one expert's weights (bytes moved by EPLB)");
  if (int rc = f.Parse(argc, argv); rc >= 0) return rc;
  if (nodes < 1 || nodes > 64) {
    std::fprintf(stderr, "qb-sim: --nodes must lie in [1, 64]\n");
    return 2;
  }
  o.nodes = static_cast<int>(nodes);
  if (o.top_k < 1 || o.top_k >= o.num_experts || o.window_tokens < 1 || o.windows < 1 ||
      o.dead < 0 || o.dead >= o.num_experts) {
    std::fprintf(stderr, "need 1 <= top_k < experts, window >= 1, windows >= 1, dead < experts\n");
    return 2;
  }
  if (o.shards < 0 || o.shards > o.num_experts || o.spare_slots_per_shard < 0 || expert_mb < 0) {
    std::fprintf(stderr, "need 0 <= shards <= experts, spare_slots >= 0, expert_mb >= 0\n");
    return 2;
  }
  o.expert_bytes = expert_mb * 1e6;
  const moe::tools::QbSimResult r = moe::tools::RunQbSim(o);
  std::ofstream(out + ".csv") << moe::tools::QbSimCsv(r);
  std::printf("%s", moe::tools::QbSimSummary(r).c_str());
  if (o.shards > 0) {
    std::printf("\n%s", moe::tools::PlacementSimSummary(moe::tools::RunPlacementSim(o)).c_str());
  }
  const absl::Status chart = moe::tools::WriteQbSimChart(r, out + ".png");
  if (!chart.ok()) {
    std::fprintf(stderr, "chart: %s\n", std::string(chart.message()).c_str());
    return 1;
  }
  std::printf("wrote %s.csv and %s.png\n", out.c_str(), out.c_str());
  return 0;
}
