// The simulator on a small shape: its CSV has a row per (window, method), Quantile Balancing
// gets near the noise floor within a few windows where no balancing stays skewed, and the
// chart is a real PNG drawn by gnuplot.
#include "services/tools/qb_sim.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "services/numerics/qb.h"

namespace moe::tools {
namespace {

QbSimOptions SmallOptions() {
  QbSimOptions o;
  o.num_experts = 64;
  o.top_k = 4;
  o.window_tokens = 2048;  // q = 128, noise floor 0.26
  o.windows = 10;
  o.skew = 3.0;
  o.dead = 3;
  return o;
}

TEST(QbSim, BalancesWhereNoBalancingCannot) {
  const QbSimResult r = RunQbSim(SmallOptions());
  ASSERT_EQ(r.methods.size(), 6u);  // none, 2 sign rules, exact, 2 histograms
  ASSERT_EQ(r.rows.size(), 6u * 10);
  std::map<std::string, const QbSimRow*> last;
  for (const QbSimRow& row : r.rows) {
    if (row.window == 9) last[row.method] = &row;
  }
  EXPECT_GT(last["none"]->max_vio, 3.0);
  EXPECT_GE(last["none"]->dead, 3);  // the 3 dead ones, and maybe a cold one
  for (const char* qb : {"qb-exact", "qb-hist-1000", "qb-hist-100"}) {
    EXPECT_LT(last[qb]->max_vio, 2.5 * r.noise_floor) << qb;
    EXPECT_EQ(last[qb]->dead, 0) << qb;
  }
  // The CSV is one header plus one line per row.
  const std::string csv = QbSimCsv(r);
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 1 + 60);
  EXPECT_EQ(csv.rfind("window,method,max_vio", 0), 0u);
  const std::string summary = QbSimSummary(r);
  EXPECT_NE(summary.find("noise floor"), std::string::npos);
  EXPECT_NE(summary.find("qb-exact"), std::string::npos);
}

TEST(QbSim, IsDeterministicForASeed) {
  EXPECT_EQ(QbSimCsv(RunQbSim(SmallOptions())), QbSimCsv(RunQbSim(SmallOptions())));
}

TEST(QbSim, ChartIsAPng) {
  QbSimOptions o = SmallOptions();
  o.windows = 4;
  const std::string png = ::testing::TempDir() + "/qb_sim_test_chart.png";
  const absl::Status st = WriteQbSimChart(RunQbSim(o), png);
  ASSERT_TRUE(st.ok()) << st;
  std::ifstream in(png, std::ios::binary);
  std::string head(8, '\0');
  in.read(head.data(), 8);
  EXPECT_EQ(head, std::string("\x89PNG\r\n\x1a\n", 8));
  in.seekg(0, std::ios::end);
  EXPECT_GT(in.tellg(), 10000);  // two plotted panels, not an empty canvas
  std::remove(png.c_str());
}

// EPLB's plan worked by hand: 6 slots for 4 experts; both spare slots go to the hot one (10 -> 5
// -> 3.33 per replica), then the replicas, heaviest first, to the least loaded shard with room
// that does not hold that expert yet (the third copy of expert 0 has no such shard).
TEST(PlanEplb, ReplicatesTheHottestAndPacksGreedily) {
  const EplbPlan p = PlanEplb({10, 1, 1, 1}, /*shards=*/2, /*slots=*/3);
  EXPECT_EQ(p.replicas, (std::vector<int>{3, 1, 1, 1}));
  EXPECT_EQ(p.on_shard, (std::vector<std::vector<int32_t>>{{0, 0, 3}, {0, 1, 2}}));
  // Exactly the slots there are, every expert placed.
  const EplbPlan big = PlanEplb(std::vector<double>(50, 1.0), 4, 14);
  int placed = 0;
  for (const auto& held : big.on_shard) {
    EXPECT_LE(held.size(), 14u);
    placed += static_cast<int>(held.size());
  }
  EXPECT_EQ(placed, 56);
  for (int r : big.replicas) EXPECT_GE(r, 1);
}

// Balance by the router vs by moving weights on the same skewed traffic: both even out the shards
// within a window, QB without moving a byte and also per expert; EPLB moves weights and leaves
// the experts as skewed as without balancing.
TEST(PlacementSim, RouterAndWeightsBothBalanceShardsOnlyOneMovesBytes) {
  QbSimOptions o = SmallOptions();
  o.dead = 0;
  o.shards = 4;
  o.spare_slots_per_shard = 2;
  o.expert_bytes = 1e6;
  const PlacementSimResult r = RunPlacementSim(o);
  ASSERT_EQ(r.methods, (std::vector<std::string>{"none", "qb", "eplb", "qb+eplb"}));
  ASSERT_EQ(r.rows.size(), 4u * 10);
  std::map<std::string, const PlacementSimRow*> last;
  std::map<std::string, double> moved;
  for (const PlacementSimRow& row : r.rows) {
    if (row.window == 9) last[row.method] = &row;
    moved[row.method] += row.bytes_moved;
    if (row.window == 0) {
      EXPECT_EQ(row.bytes_moved, 0) << row.method;  // nothing planned yet
    }
  }
  EXPECT_LT(last["none"]->balancedness, 0.8);
  for (const char* m : {"qb", "eplb", "qb+eplb"}) EXPECT_GT(last[m]->balancedness, 0.9) << m;
  EXPECT_EQ(moved["none"], 0);
  EXPECT_EQ(moved["qb"], 0);
  EXPECT_GT(moved["eplb"], 0);
  EXPECT_EQ(std::fmod(moved["eplb"], o.expert_bytes), 0);  // whole experts
  const double expert_floor = numerics::NoiseFloorMaxVio(
      o.num_experts, static_cast<double>(o.window_tokens) * o.top_k / o.num_experts);
  EXPECT_LT(last["qb"]->expert_max_vio, 2.5 * expert_floor);
  EXPECT_EQ(last["eplb"]->expert_max_vio, last["none"]->expert_max_vio);  // same routing
  const std::string summary = PlacementSimSummary(r);
  EXPECT_NE(summary.find("GB moved"), std::string::npos);
}

}  // namespace
}  // namespace moe::tools
