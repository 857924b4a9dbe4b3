// qb-sim: Quantile Balancing vs no balancing and the sign rule on synthetic skewed traffic.
//
//   qb-sim [--experts 896] [--top-k 16] [--window 4096] [--windows 30] [--skew 3.0]
//          [--drift 0.0] [--dead 0] [--seed 1] [--nodes 2] [--out qb-sim]
// Writes OUT.csv and OUT.png and prints a summary table with the noise floor.
#include <cstdio>
#include <fstream>
#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "services/tools/qb_sim.h"

int main(int argc, char** argv) {
  moe::tools::QbSimOptions o;
  std::string out = "qb-sim";
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc || flag.rfind("--", 0) != 0) {
      std::fprintf(stderr,
                   "usage: qb-sim [--experts N] [--top-k K] [--window TOKENS] [--windows W]\n"
                   "              [--skew X] [--drift X] [--dead N] [--seed N] [--nodes N] "
                   "[--out PREFIX]\n");
      return 2;
    }
    const std::string v = argv[++i];
    bool ok = true;
    int64_t n64 = 0;
    if (flag == "--experts") {
      ok = absl::SimpleAtoi(v, &o.num_experts);
    } else if (flag == "--top-k") {
      ok = absl::SimpleAtoi(v, &o.top_k);
    } else if (flag == "--window") {
      ok = absl::SimpleAtoi(v, &o.window_tokens);
    } else if (flag == "--windows") {
      ok = absl::SimpleAtoi(v, &o.windows);
    } else if (flag == "--skew") {
      ok = absl::SimpleAtod(v, &o.skew);
    } else if (flag == "--drift") {
      ok = absl::SimpleAtod(v, &o.drift);
    } else if (flag == "--dead") {
      ok = absl::SimpleAtoi(v, &o.dead);
    } else if (flag == "--seed") {
      ok = absl::SimpleAtoi(v, &o.seed);
    } else if (flag == "--nodes") {
      ok = absl::SimpleAtoi(v, &n64) && n64 >= 1 && n64 <= 64;
      o.nodes = static_cast<int>(n64);
    } else if (flag == "--out") {
      out = v;
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
    if (!ok) {
      std::fprintf(stderr, "flag %s: bad value \"%s\"\n", flag.c_str(), v.c_str());
      return 2;
    }
  }
  if (o.top_k < 1 || o.top_k >= o.num_experts || o.window_tokens < 1 || o.windows < 1 ||
      o.dead < 0 || o.dead >= o.num_experts) {
    std::fprintf(stderr, "need 1 <= top-k < experts, window >= 1, windows >= 1, dead < experts\n");
    return 2;
  }
  const moe::tools::QbSimResult r = moe::tools::RunQbSim(o);
  std::ofstream(out + ".csv") << moe::tools::QbSimCsv(r);
  std::printf("%s", moe::tools::QbSimSummary(r).c_str());
  const absl::Status chart = moe::tools::WriteQbSimChart(r, out + ".png");
  if (!chart.ok()) {
    std::fprintf(stderr, "chart: %s\n", std::string(chart.message()).c_str());
    return 1;
  }
  std::printf("wrote %s.csv and %s.png\n", out.c_str(), out.c_str());
  return 0;
}
