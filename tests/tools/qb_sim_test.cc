// The simulator on a small shape: its CSV has a row per (window, method), Quantile Balancing
// gets near the noise floor within a few windows where no balancing stays skewed, and the
// chart is a real PNG drawn by gnuplot.
#include "services/tools/qb_sim.h"

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

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

}  // namespace
}  // namespace moe::tools
