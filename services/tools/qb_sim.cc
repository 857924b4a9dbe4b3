#include "services/tools/qb_sim.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <queue>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "services/common/random.h"
#include "services/numerics/qb.h"

namespace moe::tools {
namespace {

using numerics::BalanceMetrics;
using numerics::ComputeBalance;

constexpr float kDeadOffset = -12.0f;

struct Method {
  enum Kind { kNone, kSign, kExact, kHistogram } kind;
  float gamma = 0;
  int bins = 0;
  std::string name;
  std::vector<float> bias;
};

// Logit offsets of this window: the drifting popularity, with the dead experts pinned down.
std::vector<float> Offsets(const QbSimOptions& o, const std::vector<float>& popularity) {
  std::vector<float> off(popularity.size());
  for (size_t j = 0; j < off.size(); ++j) {
    off[j] = static_cast<int64_t>(j) < o.dead
                 ? kDeadOffset
                 : static_cast<float>(o.skew * popularity[j] * popularity[j] * popularity[j]);
  }
  return off;
}

std::vector<float> Traffic(const QbSimOptions& o, const std::vector<float>& offsets,
                           uint64_t seed) {
  Rng rng(seed);
  const int64_t n = o.num_experts;
  std::vector<float> s(static_cast<size_t>(o.window_tokens * n));
  for (int64_t i = 0; i < o.window_tokens; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      s[i * n + j] = 1.0f / (1.0f + std::exp(-(rng.Normal() + offsets[j])));
    }
  }
  return s;
}

// The windows' traffic. Popularity u_j in [0, 1]; the offset is skew * u_j^3. Drift: before each
// window after the first, every u_j takes a random-walk step of std `drift`, reflected into
// [0, 1], so the hot set changes gradually (a hot expert cools down over windows, a cold one
// heats up). Both simulations draw the same windows for the same options.
class Windows {
 public:
  explicit Windows(const QbSimOptions& o)
      : o_(o), pop_(MixSeed(o.seed, {1})), popularity_(static_cast<size_t>(o.num_experts)) {
    for (float& v : popularity_) v = static_cast<float>(pop_.Uniform());
  }
  // Scores [window_tokens, n] of window w (called for w = 0, 1, ... in order).
  std::vector<float> Next(int w) {
    if (w > 0 && o_.drift > 0) {
      for (float& u : popularity_) {
        float v = u + static_cast<float>(o_.drift) * pop_.Normal();
        v = v < 0 ? -v : v;
        u = v > 1 ? 2 - v : v;
      }
    }
    return Traffic(o_, Offsets(o_, popularity_), MixSeed(o_.seed, {2, static_cast<uint64_t>(w)}));
  }

 private:
  const QbSimOptions& o_;
  Rng pop_;
  std::vector<float> popularity_;
};

}  // namespace

QbSimResult RunQbSim(const QbSimOptions& o) {
  QbSimResult result;
  result.options = o;
  const int64_t n = o.num_experts, k = o.top_k, m = o.window_tokens;
  result.noise_floor = numerics::NoiseFloorMaxVio(n, static_cast<double>(m) * k / n);
  std::vector<Method> methods;
  methods.push_back({Method::kNone, 0, 0, "none", {}});
  for (float g : o.gammas) methods.push_back({Method::kSign, g, 0, absl::StrCat("sign-", g), {}});
  methods.push_back({Method::kExact, 0, 0, "qb-exact", {}});
  for (int b : o.bins)
    methods.push_back({Method::kHistogram, 0, b, absl::StrCat("qb-hist-", b), {}});
  for (Method& me : methods) {
    me.bias.assign(static_cast<size_t>(n), 0.0f);
    result.methods.push_back(me.name);
  }
  Windows windows(o);
  for (int w = 0; w < o.windows; ++w) {
    const std::vector<float> s = windows.Next(w);
    for (Method& me : methods) {
      std::vector<int64_t> loads;
      switch (me.kind) {
        case Method::kNone:
          loads = numerics::RouteLoads(s, m, n, me.bias, k);
          break;
        case Method::kSign:
          loads = numerics::RouteLoads(s, m, n, me.bias, k);
          me.bias = numerics::SignRuleStep(me.bias, loads, me.gamma);
          break;
        case Method::kExact: {
          auto step = numerics::QbExactStep(s, m, n, me.bias, k);
          loads = step->loads;  // inputs are valid by construction
          me.bias = step->bias;
          break;
        }
        case Method::kHistogram: {
          numerics::QbWindow win;
          win.window_id = static_cast<uint64_t>(w);
          win.bias_version = static_cast<uint64_t>(w);
          win.top_k = k;
          win.bins = me.bins;
          auto pooled = numerics::QbHistogram::Create(win, me.bias);
          const int nodes = std::max(1, o.nodes);
          for (int node = 0; node < nodes; ++node) {
            const int64_t lo = m * node / nodes, hi = m * (node + 1) / nodes;
            auto h = numerics::QbHistogram::Create(win, me.bias);
            (void)h->Accumulate(absl::MakeConstSpan(s).subspan(lo * n, (hi - lo) * n), hi - lo);
            auto wire = numerics::QbHistogram::Deserialize(h->Serialize());
            (void)pooled->Merge(*wire);
          }
          loads = pooled->loads();
          me.bias = pooled->Solve();
          break;
        }
      }
      const BalanceMetrics b = ComputeBalance(loads);
      result.rows.push_back({w, me.name, b.max_vio, b.min_over_target, b.cv, b.dead});
    }
  }
  return result;
}

std::string QbSimCsv(const QbSimResult& r) {
  std::string out = "window,method,max_vio,min_load_over_q,cv,dead\n";
  for (const QbSimRow& row : r.rows) {
    absl::StrAppendFormat(&out, "%d,%s,%.6f,%.6f,%.6f,%d\n", row.window, row.method, row.max_vio,
                          row.min_over_target, row.cv, row.dead);
  }
  return out;
}

std::string QbSimSummary(const QbSimResult& r) {
  const QbSimOptions& o = r.options;
  const double q = static_cast<double>(o.window_tokens) * o.top_k / o.num_experts;
  std::string out = absl::StrFormat(
      "n=%d k=%d window=%d tokens (q=%.1f) windows=%d skew=%.2f drift=%.3f dead=%d\n"
      "noise floor sqrt(2 ln n)/sqrt(q) = %.3f; 'reach' = first window with MaxVio <= %.2f x "
      "floor\n",
      o.num_experts, o.top_k, o.window_tokens, q, o.windows, o.skew, o.drift, o.dead, r.noise_floor,
      kReachFactor);
  absl::StrAppendFormat(&out, "%-16s %10s %10s %8s %14s %14s\n", "method", "MaxVio[0]",
                        "MaxVio[-1]", "reach", "MaxVio(tail)", "min/q(tail)");
  const int tail_from = o.windows - std::max(1, o.windows / 3);
  for (const std::string& name : r.methods) {
    double first = 0, last = 0, tail_vio = 0, tail_min = 0;
    int reach = -1, tail_count = 0;
    for (const QbSimRow& row : r.rows) {
      if (row.method != name) continue;
      if (row.window == 0) first = row.max_vio;
      last = row.max_vio;
      if (reach < 0 && row.max_vio <= kReachFactor * r.noise_floor) reach = row.window;
      if (row.window >= tail_from) {
        tail_vio += row.max_vio;
        tail_min += row.min_over_target;
        ++tail_count;
      }
    }
    absl::StrAppendFormat(&out, "%-16s %10.3f %10.3f %8s %14.3f %14.3f\n", name, first, last,
                          reach < 0 ? std::string("never") : absl::StrCat(reach),
                          tail_vio / tail_count, tail_min / tail_count);
  }
  return out;
}

EplbPlan PlanEplb(const std::vector<double>& loads, int shards, int slots) {
  const int n = static_cast<int>(loads.size());
  EplbPlan plan;
  plan.replicas.assign(static_cast<size_t>(n), 1);
  // Spare slots, one at a time, to the expert with the most load per replica (ties: lower id).
  std::priority_queue<std::pair<double, int>> heaviest;
  for (int j = 0; j < n; ++j) heaviest.push({loads[j], -j});
  for (int spare = shards * slots - n; spare > 0; --spare) {
    const int j = -heaviest.top().second;
    heaviest.pop();
    ++plan.replicas[j];
    heaviest.push({loads[j] / plan.replicas[j], -j});
  }
  // Replicas heaviest first, each to the least loaded shard with room.
  std::vector<std::pair<double, int>> items;
  for (int j = 0; j < n; ++j) {
    for (int r = 0; r < plan.replicas[j]; ++r) items.push_back({loads[j] / plan.replicas[j], j});
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  plan.on_shard.assign(static_cast<size_t>(shards), {});
  std::vector<double> shard_load(static_cast<size_t>(shards), 0.0);
  for (const auto& [load, j] : items) {
    int best = -1;
    for (int pass = 0; pass < 2 && best < 0; ++pass) {
      for (int sh = 0; sh < shards; ++sh) {
        if (static_cast<int>(plan.on_shard[sh].size()) >= slots) continue;
        const auto& held = plan.on_shard[sh];
        if (pass == 0 && std::find(held.begin(), held.end(), j) != held.end()) continue;
        if (best < 0 || shard_load[sh] < shard_load[best]) best = sh;
      }
    }
    plan.on_shard[best].push_back(j);
    shard_load[best] += load;
  }
  return plan;
}

namespace {

// Tokens per shard when expert j's tokens split evenly over its replicas.
std::vector<double> ShardLoads(const std::vector<int64_t>& loads,
                               const std::vector<std::vector<int32_t>>& on_shard) {
  std::vector<int> replicas(loads.size(), 0);
  for (const auto& held : on_shard) {
    for (int32_t j : held) ++replicas[j];
  }
  std::vector<double> out;
  for (const auto& held : on_shard) {
    double sum = 0;
    for (int32_t j : held) sum += static_cast<double>(loads[j]) / replicas[j];
    out.push_back(sum);
  }
  return out;
}

double Balancedness(const std::vector<double>& shard_loads) {
  double sum = 0, max = 0;
  for (double v : shard_loads) {
    sum += v;
    max = std::max(max, v);
  }
  return max > 0 ? sum / static_cast<double>(shard_loads.size()) / max : 1.0;
}

// Experts placed on a shard that did not hold them before (each one expert's weights moved).
int64_t Arrivals(const std::vector<std::vector<int32_t>>& before,
                 const std::vector<std::vector<int32_t>>& after) {
  int64_t moved = 0;
  for (size_t sh = 0; sh < after.size(); ++sh) {
    std::multiset<int32_t> had(before[sh].begin(), before[sh].end());
    for (int32_t j : after[sh]) {
      auto it = had.find(j);
      if (it == had.end()) {
        ++moved;
      } else {
        had.erase(it);
      }
    }
  }
  return moved;
}

}  // namespace

PlacementSimResult RunPlacementSim(const QbSimOptions& o) {
  PlacementSimResult result;
  result.options = o;
  const int64_t n = o.num_experts, k = o.top_k, m = o.window_tokens;
  const int shards = std::max(1, o.shards);
  const int slots =
      static_cast<int>((n + shards - 1) / shards) + std::max(0, o.spare_slots_per_shard);
  const double per_shard = static_cast<double>(m) * static_cast<double>(k) / shards;
  result.balancedness_floor = 1.0 / (1.0 + numerics::NoiseFloorMaxVio(shards, per_shard));
  // Contiguous placement: shard s holds experts [s n / S, (s + 1) n / S).
  std::vector<std::vector<int32_t>> contiguous(static_cast<size_t>(shards));
  for (int64_t j = 0; j < n; ++j) contiguous[j * shards / n].push_back(static_cast<int32_t>(j));
  struct Method {
    std::string name;
    bool qb, eplb;
    std::vector<float> bias;
    std::vector<std::vector<int32_t>> placement;
    std::vector<int64_t> last_loads;
    double last_balancedness = 1.0;
  };
  std::vector<Method> methods = {{"none", false, false, {}, contiguous, {}},
                                 {"qb", true, false, {}, contiguous, {}},
                                 {"eplb", false, true, {}, contiguous, {}},
                                 {"qb+eplb", true, true, {}, contiguous, {}}};
  for (Method& me : methods) {
    me.bias.assign(static_cast<size_t>(n), 0.0f);
    result.methods.push_back(me.name);
  }
  Windows windows(o);
  for (int w = 0; w < o.windows; ++w) {
    const std::vector<float> s = windows.Next(w);
    for (Method& me : methods) {
      double moved = 0;
      // Planned from the window before (causal), when it left the shards unbalanced.
      if (me.eplb && !me.last_loads.empty() && me.last_balancedness < o.eplb_replan_below) {
        const std::vector<double> prev(me.last_loads.begin(), me.last_loads.end());
        EplbPlan plan = PlanEplb(prev, shards, slots);
        moved = static_cast<double>(Arrivals(me.placement, plan.on_shard)) * o.expert_bytes;
        me.placement = std::move(plan.on_shard);
      }
      std::vector<int64_t> loads;
      if (me.qb) {
        auto step = numerics::QbExactStep(s, m, n, me.bias, k);
        loads = step->loads;
        me.bias = step->bias;
      } else {
        loads = numerics::RouteLoads(s, m, n, me.bias, k);
      }
      me.last_loads = loads;
      me.last_balancedness = Balancedness(ShardLoads(loads, me.placement));
      result.rows.push_back(
          {w, me.name, me.last_balancedness, ComputeBalance(loads).max_vio, moved});
    }
  }
  return result;
}

std::string PlacementSimSummary(const PlacementSimResult& r) {
  const QbSimOptions& o = r.options;
  const int slots =
      static_cast<int>((o.num_experts + o.shards - 1) / o.shards) + o.spare_slots_per_shard;
  std::string out = absl::StrFormat(
      "router vs weights: n=%d k=%d on %d shards of %d slots (%d spare each), window=%d tokens, "
      "windows=%d skew=%.2f drift=%.3f; expert %.1f MB\n"
      "balancedness = mean/max tokens per shard; its noise floor %.3f; 'reach' = first window "
      "with max/mean - 1 <= %.2f x the floor's\n",
      o.num_experts, o.top_k, o.shards, slots, o.spare_slots_per_shard, o.window_tokens, o.windows,
      o.skew, o.drift, o.expert_bytes / 1e6, r.balancedness_floor, kReachFactor);
  absl::StrAppendFormat(&out, "%-10s %9s %9s %12s %8s %14s %16s\n", "method", "bal[0]", "bal[-1]",
                        "bal(tail)", "reach", "GB moved", "expert MaxVio(tail)");
  const double floor_vio = 1.0 / r.balancedness_floor - 1.0;
  const int tail_from = o.windows - std::max(1, o.windows / 3);
  for (const std::string& name : r.methods) {
    double first = 0, last = 0, tail = 0, tail_vio = 0, bytes = 0;
    int reach = -1, count = 0;
    for (const PlacementSimRow& row : r.rows) {
      if (row.method != name) continue;
      if (row.window == 0) first = row.balancedness;
      last = row.balancedness;
      bytes += row.bytes_moved;
      if (reach < 0 && 1.0 / row.balancedness - 1.0 <= kReachFactor * floor_vio) {
        reach = row.window;
      }
      if (row.window >= tail_from) {
        tail += row.balancedness;
        tail_vio += row.expert_max_vio;
        ++count;
      }
    }
    absl::StrAppendFormat(&out, "%-10s %9.3f %9.3f %12.3f %8s %14.2f %16.3f\n", name, first, last,
                          tail / count, reach < 0 ? std::string("never") : absl::StrCat(reach),
                          bytes / 1e9, tail_vio / count);
  }
  return out;
}

absl::Status WriteQbSimChart(const QbSimResult& r, const std::string& png_path) {
  const std::string dat = png_path + ".dat", script = png_path + ".gp";
  {
    std::ofstream out(dat);
    for (const std::string& name : r.methods) {
      out << "# " << name << "\n";
      for (const QbSimRow& row : r.rows) {
        if (row.method == name) {
          // MaxVio on a log axis: keep exact zeros visible.
          out << row.window << " " << std::max(row.max_vio, 1e-3) << " " << row.min_over_target
              << "\n";
        }
      }
      out << "\n\n";
    }
    if (!out) return absl::DataLossError(absl::StrCat("cannot write ", dat));
  }
  {
    std::ofstream gp(script);
    std::string titles;
    for (const std::string& name : r.methods) absl::StrAppend(&titles, name, " ");
    const QbSimOptions& o = r.options;
    gp << "set terminal pngcairo size 1200,900 font 'sans,11'\n"
       << "set output '" << png_path << "'\n"
       << "titles = '" << titles << "'\n"
       << "set multiplot layout 2,1 title '"
       << absl::StrFormat(
              "Quantile Balancing vs baselines: n=%d, k=%d, %d tokens/window, skew %.1f, drift "
              "%.3f, dead %d",
              o.num_experts, o.top_k, o.window_tokens, o.skew, o.drift, o.dead)
       << "'\n"
       << "set key outside right\nset grid\nset logscale y\n"
       << "set ylabel 'MaxVio (max load / mean - 1)'\nset xlabel 'window'\n"
       << "plot for [i=1:words(titles)] '" << dat
       << "' index (i-1) using 1:2 with linespoints pt 7 ps 0.5 title word(titles, i), "
       << r.noise_floor << " with lines dt 2 lc rgb 'black' title 'noise floor'\n"
       << "unset logscale y\nset ylabel 'min load / q'\nset yrange [0:1.05]\n"
       << "plot for [i=1:words(titles)] '" << dat
       << "' index (i-1) using 1:3 with linespoints pt 7 ps 0.5 title word(titles, i)\n"
       << "unset multiplot\n";
    if (!gp) return absl::DataLossError(absl::StrCat("cannot write ", script));
  }
  const std::string cmd = absl::StrCat("gnuplot '", script, "' 2>&1");
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return absl::UnavailableError("cannot run gnuplot");
  std::string msg;
  char buf[256];
  while (std::fgets(buf, sizeof(buf), p) != nullptr) msg += buf;
  const int rc = ::pclose(p);
  std::remove(dat.c_str());
  std::remove(script.c_str());
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("gnuplot failed (is gnuplot-nox installed?): ", msg));
  }
  return absl::OkStatus();
}

}  // namespace moe::tools
