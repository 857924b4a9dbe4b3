// The whole layer on a kernel table against the scalar reference (the layer tolerance), the
// check the consistency and composed-kernel tests share.
#ifndef MOE_TESTS_NUMERICS_CPU_LAYER_CHECK_H_
#define MOE_TESTS_NUMERICS_CPU_LAYER_CHECK_H_

#include <cstdio>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "services/checkpoint/synthetic.h"
#include "services/numerics/cpu/kernel_choice.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/numerics/dynamic_k.h"
#include "services/numerics/moe_layer.h"
#include "services/numerics/precision_mode.h"
#include "services/numerics/router.h"
#include "services/numerics/shared_expert.h"
#include "services/numerics/tolerance.h"

namespace moe::numerics::cpu::testing {

using tensor::Bf16;

// budget < k: dynamic k with thresholds solved exactly from another batch of the same layer
// (dynamic_k.h); 0: every token keeps k.
inline void CheckLayerOn(const KernelTable& kernels, const std::string& label, const char* preset,
                         int64_t tokens, uint64_t seed, Precision precision = Precision::kW4A16,
                         int64_t budget = 0) {
  const ModelConfig cfg = *PresetConfig(preset);
  checkpoint::SyntheticOptions opt;
  opt.router_skew = 1.0;
  opt.seed = seed;
  MoeLayerWeights w = checkpoint::SyntheticLayer(cfg, 1, opt);
  const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, tokens, seed + 4);
  std::vector<float> table;
  BudgetRule rule;
  if (budget > 0) {
    const int64_t m = 512, e = cfg.num_experts;
    const std::vector<Bf16> calib = checkpoint::SyntheticHiddenStates(cfg, m, seed + 40);
    std::vector<float> scores(static_cast<size_t>(m * e));
    ref::RouterScores(calib.data(), m, cfg.hidden, w.gate.data(), e, scores.data());
    table = *ExactBudgetThresholds(scores, m, e, w.bias, cfg.top_k, /*k_min=*/1);
    rule.thresholds = BudgetRow(table, budget, e);
  }
  const BudgetRule* r = budget > 0 ? &rule : nullptr;
  // The scalar reference once per case (several tables are checked against the same one).
  static std::map<std::tuple<std::string, int64_t, uint64_t, int, int64_t>, LayerOutput> refs;
  const auto key =
      std::make_tuple(std::string(preset), tokens, seed, static_cast<int>(precision), budget);
  if (refs.count(key) == 0) {
    auto ref = ref::MoeLayerForward(cfg, w, x, tokens, cfg.hidden, nullptr, nullptr, precision, r);
    ASSERT_TRUE(ref.ok());
    refs[key] = std::move(*ref);
  }
  const LayerOutput* want = &refs[key];
  CpuLayerOptions o;
  o.kernels = &kernels;
  o.threads = 2;
  auto layer = CpuMoeLayer::Create(cfg, std::move(w), o);
  ASSERT_TRUE(layer.ok()) << layer.status();
  auto got = (*layer)->Forward(x, tokens, cfg.hidden, nullptr, nullptr, precision, r);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->routing.expert_ids, want->routing.expert_ids);
  EXPECT_EQ(got->routing.weights, want->routing.weights);
  if (budget > 0) {  // the budget bites: about budget experts per token, not k
    int64_t kept = 0;
    for (int32_t id : got->routing.expert_ids) kept += id >= 0;
    const double per_token = static_cast<double>(kept) / tokens;
    std::printf("[ %s ] %s budget %lld of %lld: %.2f experts per token\n", label.c_str(), preset,
                static_cast<long long>(budget), static_cast<long long>(cfg.top_k), per_token);
    EXPECT_GT(per_token, budget * 0.7);
    EXPECT_LT(per_token, budget * 1.3);
  }
  // The shared experts' part of the output, for the row scale.
  const MoeLayerWeights sw = checkpoint::SyntheticLayer(cfg, 1, opt);
  std::vector<Bf16> sh(static_cast<size_t>(tokens * cfg.hidden));
  ref::SharedExpert(x.data(), tokens, cfg.hidden, sw.shared_gate.data(), sw.shared_up.data(),
                    sw.shared_down.data(), cfg.shared_intermediate(), cfg.situ_beta,
                    cfg.situ_linear_beta, sh.data());
  UlpStats stats;
  stats.AddRows(got->out.data(), want->out.data(), tokens, cfg.hidden, sh.data());
  std::printf("[ %s ] %s layer %s, %lld tokens, seed %llu: %s\n", label.c_str(), preset,
              PrecisionName(precision), static_cast<long long>(tokens),
              static_cast<unsigned long long>(seed), stats.Str().c_str());
  EXPECT_LE(double(stats.over1) / stats.total, kLayerTolerance.over1_fraction) << stats.Str();
  EXPECT_LE(double(stats.differing) / stats.total, kLayerTolerance.differing_fraction)
      << stats.Str();
  EXPECT_LE(stats.max_row_ulps, kLayerTolerance.max_row_ulps) << stats.Str();
}

}  // namespace moe::numerics::cpu::testing

#endif  // MOE_TESTS_NUMERICS_CPU_LAYER_CHECK_H_
