// Dynamic k (docs/math.md section 4.1): the rule against SelectExperts as an oracle, the
// quantile-balanced thresholds (exact and histogram) against counts on fresh traffic, the
// histogram's wire form against hostile bytes.
#include "services/numerics/dynamic_k.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>

#include "gtest/gtest.h"
#include "services/common/random.h"
#include "services/numerics/qb.h"
#include "services/numerics/router.h"
#include "tests/numerics/routing_scores.h"

namespace moe::numerics {
namespace {

using testing::BalancedBias;
using testing::CheckBudgetsOnFreshTraffic;
using testing::KeptLoads;
using testing::MakeColumnsDistinct;
using testing::SkewedScores;

TEST(ApplyBudget, KeepingEverySelectionIsBitIdentical) {
  const int64_t m = 300, n = 64, k = 8;
  const std::vector<float> s = SkewedScores(m, n, 3);
  const std::vector<float> bias(n, 0.01f);
  const Routing want = SelectExperts(s.data(), bias.data(), m, n, k, true, 2.5f);
  Routing got = want;
  EXPECT_EQ(ApplyBudget(s.data(), n, {1, nullptr}, true, 2.5f, &got), m * k);
  EXPECT_EQ(got.expert_ids, want.expert_ids);
  const std::vector<float> zeros(n, 0.0f);  // every sigmoid score clears 0
  EXPECT_EQ(ApplyBudget(s.data(), n, {1, zeros.data()}, true, 2.5f, &got), m * k);
  EXPECT_EQ(got.expert_ids, want.expert_ids);
  EXPECT_EQ(got.weights, want.weights);
}

TEST(ApplyBudget, ThresholdsAboveEveryScoreKeepTheFirstKMinAsTopKMin) {
  // With nothing clearing its threshold a token keeps its first k_min selections: exactly the
  // routing SelectExperts gives with top_k = k_min (ids and weights bit for bit, both
  // renormalize modes), then -1 / 0 in the dropped slots.
  const int64_t m = 200, n = 48, k = 6;
  const std::vector<float> s = SkewedScores(m, n, 4);
  const std::vector<float> inf(n, std::numeric_limits<float>::infinity());
  for (bool renorm : {true, false}) {
    for (int64_t k_min : {1, 2, 5}) {
      Routing got = SelectExperts(s.data(), nullptr, m, n, k, renorm, 1.5f);
      EXPECT_EQ(ApplyBudget(s.data(), n, {k_min, inf.data()}, renorm, 1.5f, &got), m * k_min);
      const Routing want = SelectExperts(s.data(), nullptr, m, n, k_min, renorm, 1.5f);
      for (int64_t t = 0; t < m; ++t) {
        for (int64_t j = 0; j < k; ++j) {
          if (j < k_min) {
            ASSERT_EQ(got.expert_ids[t * k + j], want.expert_ids[t * k_min + j]);
            ASSERT_EQ(got.weights[t * k + j], want.weights[t * k_min + j]);
          } else {
            ASSERT_EQ(got.expert_ids[t * k + j], kDroppedSlot);
            ASSERT_EQ(got.weights[t * k + j], 0.0f);
          }
        }
      }
    }
  }
}

TEST(ApplyBudget, KeepsExactlyTheSelectionsThatClearTheirThreshold) {
  const int64_t m = 500, n = 32, k = 4;
  const std::vector<float> s = SkewedScores(m, n, 5);
  Rng rng(6);
  std::vector<float> theta(n);
  for (float& v : theta) v = static_cast<float>(0.3 + 0.6 * rng.Uniform());
  const Routing full = SelectExperts(s.data(), nullptr, m, n, k, true, 1.0f);
  Routing got = full;
  const int64_t kept = ApplyBudget(s.data(), n, {1, theta.data()}, true, 1.0f, &got);
  int64_t counted = 0;
  for (int64_t t = 0; t < m; ++t) {
    std::vector<int32_t> want;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = full.expert_ids[t * k + j];
      if (j == 0 || s[t * n + e] >= theta[e]) want.push_back(e);
    }
    counted += static_cast<int64_t>(want.size());
    float sum = 0;
    for (int32_t e : want) sum += s[t * n + e];
    for (int64_t j = 0; j < k; ++j) {
      if (j < static_cast<int64_t>(want.size())) {
        ASSERT_EQ(got.expert_ids[t * k + j], want[j]);
        // The weights over the kept experts sum to 1 (renormalize, scale 1).
        ASSERT_NEAR(got.weights[t * k + j], s[t * n + want[j]] / sum, 1e-6);
      } else {
        ASSERT_EQ(got.expert_ids[t * k + j], kDroppedSlot);
      }
    }
  }
  EXPECT_EQ(kept, counted);
  EXPECT_GT(kept, m);  // the thresholds bite somewhere between k_min and k
  EXPECT_LT(kept, m * k);
  // Dropped slots belong to no expert.
  int64_t paired = 0;
  for (const auto& p : PairsByExpert(got, n)) paired += static_cast<int64_t>(p.size());
  EXPECT_EQ(paired, kept);
}

TEST(BudgetThresholds, ExactKeepsTheBudgetAndEvenLoadsOnFreshTraffic) {
  const int64_t m = 16384, n = 128, k = 8;
  const std::vector<float> calib = SkewedScores(m, n, 11);
  const std::vector<float> bias = BalancedBias(calib, m, n, k);
  auto table = ExactBudgetThresholds(calib, m, n, bias, k, 1);
  ASSERT_TRUE(table.ok()) << table.status();
  ASSERT_EQ(table->size(), static_cast<size_t>((k - 1) * n));
  CheckBudgetsOnFreshTraffic(*table, "exact");
}

// The largest-remainder apportioning against counts taken from its definition.
TEST(ApportionKept, SumsExactlyAndStaysWithinOneOfEachShare) {
  // 0.5 + 0.5 + 0.5 + 1.5 = 3: floors 0 0 0 1, one more each for the first two of the four equal
  // fractions, in id order.
  EXPECT_EQ(ApportionKept({0.5, 0.5, 0.5, 1.5}, {5, 5, 5, 5}, 3),
            (std::vector<int64_t>{1, 1, 0, 1}));
  // Largest fraction first; an expert without room is skipped; negative needs keep none.
  EXPECT_EQ(ApportionKept({1.9, 2.2, -3.0, 0.7}, {2, 9, 9, 9}, 5),
            (std::vector<int64_t>{2, 2, 0, 1}));
  EXPECT_EQ(ApportionKept({2.0, 2.0}, {1, 9}, 3), (std::vector<int64_t>{1, 2}));  // clamped to room
  // Floors past the total (the bisection's rounding): the smallest fractions give one back.
  EXPECT_EQ(ApportionKept({3.0, 2.999999, 1.2}, {9, 9, 9}, 6), (std::vector<int64_t>{3, 2, 1}));
  EXPECT_EQ(ApportionKept({3.0, 2.999999, 1.2}, {9, 9, 9}, 5), (std::vector<int64_t>{2, 2, 1}));
  // At most one more (or less) per expert: a total far from the shares is not reached.
  EXPECT_EQ(ApportionKept({1.0, 1.0}, {9, 9}, 100), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(ApportionKept({1.0, 1.0}, {9, 9}, -4), (std::vector<int64_t>{0, 0}));
}

// In its own window the table keeps exactly b per token on average, every expert within one
// selection of its share max(f_j, lambda n_j) (scores made distinct per expert: equal ones at a
// threshold all pass it); rounding each count on its own (the rule before) missed the budget,
// most in small windows.
TEST(BudgetThresholds, KeepExactlyTheBudgetInTheirWindow) {
  struct Shape {
    int64_t m, n, k;
  };
  for (const Shape& sh : {Shape{16384, 128, 8}, Shape{512, 896, 16}, Shape{8192, 896, 16}}) {
    const int64_t m = sh.m, n = sh.n, k = sh.k;
    std::vector<float> calib = SkewedScores(m, n, 11);
    MakeColumnsDistinct(&calib, m, n);
    const std::vector<float> bias = BalancedBias(calib, m, n, k);
    auto table = ExactBudgetThresholds(calib, m, n, bias, k, 1);
    ASSERT_TRUE(table.ok()) << table.status();
    const Routing full = SelectExperts(calib.data(), bias.data(), m, n, k, true, 1.0f);
    std::vector<int64_t> forced(n, 0), selections(n, 0);
    for (int64_t t = 0; t < m; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = full.expert_ids[t * k + j];
        ++selections[e];
        if (j == 0) ++forced[e];
      }
    }
    double worst_before = 0;
    for (int64_t b = 2; b < k; ++b) {
      Routing r = full;
      const int64_t kept =
          ApplyBudget(calib.data(), n, {1, BudgetRow(*table, b, n)}, true, 1.0f, &r);
      const std::vector<double> need = BudgetNeeds(b, k, m, selections, forced);
      double rounded_each = 0;
      for (int64_t e = 0; e < n; ++e) {
        rounded_each += static_cast<double>(forced[e]) + std::max(0.0, std::floor(need[e] + 0.5));
      }
      const double before = rounded_each / static_cast<double>(b * m) - 1.0;
      worst_before = std::max(worst_before, std::abs(before));
      std::printf(
          "[ m %lld n %lld k %lld ] budget %lld: kept %.4f per token; rounding each "
          "count: %+.2f%%\n",
          static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
          static_cast<long long>(b), static_cast<double>(kept) / m, 100.0 * before);
      EXPECT_EQ(kept, b * m) << "m " << m << " n " << n << " b " << b;
      const std::vector<int64_t> loads = KeptLoads(r, n);
      for (int64_t e = 0; e < n; ++e) {
        const double share = static_cast<double>(forced[e]) + std::max(0.0, need[e]);
        EXPECT_LE(std::abs(static_cast<double>(loads[e]) - share), 1.0 + 1e-6)
            << "m " << m << " n " << n << " b " << b << " e " << e;
      }
    }
    if (m == 512) {
      EXPECT_GT(worst_before, 0.01) << "the small window no longer shows the old miss";
    }
  }
}

// Thresholds solved under one bias, applied to traffic routed with a moved one: how far the kept
// experts per token and the kept-load MaxVio drift with the largest bias change (the measurement
// behind router-svc's --budget_stale_bias: docs/math.md, "Stale thresholds").
TEST(BudgetThresholds, DriftWithTheBiasTheyWereNotSolvedFor) {
  const int64_t m = 16384, n = 128, k = 8, b = 4;
  const std::vector<float> calib = SkewedScores(m, n, 11);
  const std::vector<float> bias = BalancedBias(calib, m, n, k);
  const std::vector<float> table = *ExactBudgetThresholds(calib, m, n, bias, k, 1);
  const std::vector<float> fresh = SkewedScores(m, n, 12);
  Rng rng(5);
  std::vector<float> direction(n);
  for (float& d : direction) d = static_cast<float>(2.0 * rng.Uniform() - 1.0);
  double miss_at_small = 0, miss_at_large = 0;
  for (double change : {0.0, 0.01, 0.02, 0.05, 0.1}) {
    std::vector<float> moved(bias);
    for (int64_t e = 0; e < n; ++e) moved[e] += static_cast<float>(change) * direction[e];
    Routing r = SelectExperts(fresh.data(), moved.data(), m, n, k, true, 1.0f);
    const int64_t kept = ApplyBudget(fresh.data(), n, {1, BudgetRow(table, b, n)}, true, 1.0f, &r);
    const double per_token = static_cast<double>(kept) / m;
    const double miss = per_token / b - 1.0;
    const BalanceMetrics balance = ComputeBalance(KeptLoads(r, n));
    std::printf(
        "[ stale ] bias moved by up to %.2f: %.3f experts per token (%+.1f%%), kept-load "
        "MaxVio %.3f\n",
        change, per_token, 100.0 * miss, balance.max_vio);
    if (change == 0.01) miss_at_small = std::abs(miss);
    if (change == 0.1) miss_at_large = std::abs(miss);
  }
  EXPECT_LT(miss_at_small, 0.02);  // the default tolerance (0.01) keeps the budget within 2%
  EXPECT_GT(miss_at_large, 0.03);  // a large move does not: the thresholds must be solved again
}

// The routing weight mass kept, against its definition computed here from the scores.
TEST(ApplyBudget, ReportsTheRoutingWeightMassKept) {
  const int64_t m = 500, n = 64, k = 8;
  const std::vector<float> s = SkewedScores(m, n, 21);
  const std::vector<float> bias = BalancedBias(s, m, n, k);
  const std::vector<float> table = *ExactBudgetThresholds(s, m, n, bias, k, 1);
  const Routing full = SelectExperts(s.data(), bias.data(), m, n, k, true, 1.0f);
  for (int64_t b : {2, 4, 7}) {
    Routing r = full;
    double mass = 0;
    ApplyBudget(s.data(), n, {1, BudgetRow(table, b, n)}, true, 1.0f, &r, &mass);
    double want = 0;
    for (int64_t t = 0; t < m; ++t) {
      double all = 0, kept = 0;
      for (int64_t j = 0; j < k; ++j) all += s[t * n + full.expert_ids[t * k + j]];
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = r.expert_ids[t * k + j];
        if (e >= 0) kept += s[t * n + e];
      }
      want += kept / all;
    }
    EXPECT_NEAR(mass, want, 1e-9 * m) << b;
    EXPECT_GT(mass / m, 0.1) << b;
    EXPECT_LT(mass / m, 1.0) << b;
  }
  double all_kept = 0;
  Routing r = full;
  ApplyBudget(s.data(), n, {1, nullptr}, true, 1.0f, &r, &all_kept);
  EXPECT_EQ(all_kept, static_cast<double>(m));
}

// The stand-in LM head's top-1 agreement against an argmax computed here from the same
// projection (its seed and shape are the function's contract).
TEST(Top1Agreement, CountsTokensWhoseArgmaxMatches) {
  const int64_t t = 40, h = 32;
  Rng rng(3);
  std::vector<float> a(t * h), b(t * h);
  for (float& v : a) v = rng.Normal();
  b = a;
  EXPECT_EQ(Top1Agreement(a.data(), b.data(), t, h), 1.0);
  for (int64_t i = 0; i < t / 2; ++i) {  // half the tokens replaced by other directions
    for (int64_t j = 0; j < h; ++j) b[i * h + j] = rng.Normal();
  }
  Rng prng(kTop1Seed);
  std::vector<float> p(h * kTop1Columns);
  for (float& v : p) v = prng.Normal();
  auto argmax = [&](const float* x) {
    int64_t best = 0;
    double best_v = -1e300;
    for (int64_t c = 0; c < kTop1Columns; ++c) {
      double v = 0;
      for (int64_t j = 0; j < h; ++j) v += static_cast<double>(x[j]) * p[j * kTop1Columns + c];
      if (v > best_v) best_v = v, best = c;
    }
    return best;
  };
  int64_t same = 0;
  for (int64_t i = 0; i < t; ++i) same += argmax(&a[i * h]) == argmax(&b[i * h]);
  EXPECT_GE(same, t / 2);
  EXPECT_LT(same, t);
  EXPECT_DOUBLE_EQ(Top1Agreement(a.data(), b.data(), t, h), static_cast<double>(same) / t);
}

}  // namespace
}  // namespace moe::numerics
