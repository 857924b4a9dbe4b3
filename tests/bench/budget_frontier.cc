// Dynamic k's two modes at matched experts per token (issue 41, docs/math.md 4.1): the
// quantile-balanced thresholds against top-p by routing weight, on the same traffic through the
// in-process layer (optimized CPU kernels), both solved from one calibration window routed with a
// QB-balanced bias and applied to fresh tokens. Per budget and mode: experts per token, the
// output's relative L2 difference from the full top-k, the routing weight kept, the top-1
// agreement of a stand-in LM head (numerics::Top1Agreement), and the kept loads' MaxVio per
// expert and max / mean per shard (contiguous ranges, --shards).
//
//   build/tests/budget_frontier [--preset mid | --checkpoint DIR] [--budgets 6,4,2]
//                               [--calibration_tokens 16384] [--eval_tokens 1024] [--shards 8]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/synthetic.h"
#include "services/common/flags.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/numerics/dynamic_k.h"
#include "services/numerics/qb.h"
#include "services/numerics/router.h"
#include "tests/bench/bench_checkpoint.h"

namespace moe::bench {
namespace {

using tensor::Bf16;

std::vector<float> ToFloat(const std::vector<Bf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = v[i].ToFloat();
  return out;
}

// One table row: the rule's routing on the eval scores, its kept loads' balance, and the
// output against the full top-k.
void PrintRow(int64_t b, const char* mode, const numerics::BudgetRule& rule, const ModelConfig& cfg,
              const std::vector<float>& se, const numerics::Routing& full_routing,
              const std::vector<float>& o, const std::vector<float>& full_out,
              const std::vector<int32_t>& shard_of) {
  const int64_t e = cfg.num_experts, eval = full_routing.tokens;
  numerics::Routing r = full_routing;
  double mass = 0;
  const int64_t pairs = numerics::ApplyBudget(se.data(), e, rule, cfg.renormalize,
                                              cfg.routed_scaling_factor, &r, &mass);
  std::vector<int64_t> loads(static_cast<size_t>(e), 0);
  for (int32_t id : r.expert_ids) {
    if (id >= 0) ++loads[id];
  }
  const numerics::BalanceMetrics bal = numerics::ComputeBalance(loads, shard_of);
  std::printf(
      "| %lld | %s | %s | %.2f | %.4f | %.3f | %.3f | %.3f | %.3f |\n", static_cast<long long>(b),
      mode, rule.top_p > 0 ? absl::StrFormat("%.4f", rule.top_p).c_str() : "-",
      static_cast<double>(pairs) / eval, numerics::RelativeL2(o.data(), full_out.data(), o.size()),
      mass / eval, numerics::Top1Agreement(o.data(), full_out.data(), eval, cfg.hidden),
      bal.max_vio, bal.shard_max_over_mean);
}

int Main(int argc, char** argv) {
  std::string checkpoint, preset = "mid", budgets_flag;
  int64_t calibration = 16384, eval = 1024;
  int shards = 8;
  SvcFlags f("budget_frontier",
             "Dynamic k: quantile-balanced thresholds vs top-p at matched experts per token.");
  f.String("checkpoint", &checkpoint, "checkpoint directory (empty: synthetic --preset)");
  f.String("preset", &preset, "synthetic preset when no checkpoint");
  f.String("budgets", &budgets_flag, "budgets (default: 3k/4, k/2, k/4)");
  f.Int64("calibration_tokens", &calibration, "tokens the thresholds and p are solved from");
  f.Int64("eval_tokens", &eval, "fresh tokens both modes are measured on");
  f.Int("shards", &shards, "contiguous expert shards for the per-shard balance");
  if (int rc = f.Parse(argc, argv); rc >= 0) return rc;
  auto dir = BenchCheckpoint(checkpoint, preset, "moe_budget_frontier_");
  if (!dir.ok()) return 1;
  auto ckpt = checkpoint::Checkpoint::Open(*dir);
  if (!ckpt.ok()) return 1;
  auto cfg = (*ckpt)->LoadConfig();
  if (!cfg.ok()) return 1;
  const int64_t k = cfg->top_k, e = cfg->num_experts, h = cfg->hidden;
  const int64_t layer_id = cfg->first_moe_layer;
  auto weights = checkpoint::LoadMoeLayer(**ckpt, *cfg, layer_id, {});
  if (!weights.ok()) return 1;
  const std::vector<Bf16> gate = weights->gate;
  const std::vector<float> checkpoint_bias = weights->bias;
  auto layer = numerics::cpu::CpuMoeLayer::Create(*cfg, std::move(*weights), {});
  if (!layer.ok()) return 1;
  std::vector<int64_t> budgets;
  if (budgets_flag.empty()) {
    budgets = {3 * k / 4, k / 2, k / 4};
  } else {
    for (absl::string_view s : absl::StrSplit(budgets_flag, ',')) {
      int64_t b = 0;
      if (!absl::SimpleAtoi(s, &b) || b < 1 || b >= k) return 2;
      budgets.push_back(b);
    }
  }
  auto scores_of = [&](const std::vector<Bf16>& x, int64_t m) {
    std::vector<float> s(static_cast<size_t>(m * e));
    numerics::ref::RouterScores(x.data(), m, h, gate.data(), e, s.data());
    return s;
  };
  // The calibration window and a QB-balanced bias for it (what a deployment serves with).
  const std::vector<Bf16> xc = checkpoint::SyntheticHiddenStates(*cfg, calibration, 4242);
  const std::vector<float> sc = scores_of(xc, calibration);
  std::vector<float> bias = checkpoint_bias;
  for (int i = 0; i < 3; ++i) bias = numerics::QbExactStep(sc, calibration, e, bias, k)->bias;
  auto table = numerics::ExactBudgetThresholds(sc, calibration, e, bias, k, 1);
  if (!table.ok()) return 1;
  const std::vector<Bf16> xe = checkpoint::SyntheticHiddenStates(*cfg, eval, 777);
  const std::vector<float> se = scores_of(xe, eval);
  auto full = (*layer)->Forward(xe, eval, h, bias.data());
  if (!full.ok()) return 1;
  const std::vector<float> full_out = ToFloat(full->out);
  const numerics::Routing full_routing = numerics::SelectExperts(
      se.data(), bias.data(), eval, e, k, cfg->renormalize, cfg->routed_scaling_factor);
  std::vector<int32_t> shard_of(static_cast<size_t>(e));
  for (int64_t j = 0; j < e; ++j) shard_of[j] = static_cast<int32_t>(j * shards / e);
  std::printf(
      "checkpoint %s (H %lld, E %lld, k %lld); thresholds and p solved from %lld tokens with a "
      "QB-balanced bias, measured on %lld fresh tokens; %d contiguous shards\n\n"
      "| budget | mode | p | experts/token | rel. output diff | weight kept | top-1 agreement | "
      "kept-load MaxVio | shard max/mean |\n|---|---|---|---|---|---|---|---|---|\n",
      dir->c_str(), static_cast<long long>(h), static_cast<long long>(e), static_cast<long long>(k),
      static_cast<long long>(calibration), static_cast<long long>(eval), shards);
  for (int64_t b : budgets) {
    auto p = numerics::TopPForBudget(sc, calibration, e, bias, k, 1, static_cast<double>(b));
    if (!p.ok()) return 1;
    for (const char* mode : {"thresholds", "top-p"}) {
      numerics::BudgetRule rule;
      rule.k_min = 1;
      if (std::string(mode) == "top-p") {
        rule.top_p = *p;
      } else {
        rule.thresholds = numerics::BudgetRow(*table, b, e);
      }
      auto out =
          (*layer)->Forward(xe, eval, h, bias.data(), nullptr, numerics::Precision::kW4A16, &rule);
      if (!out.ok()) return 1;
      PrintRow(b, mode, rule, *cfg, se, full_routing, ToFloat(out->out), full_out, shard_of);
    }
  }
  return 0;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) { return moe::bench::Main(argc, argv); }
