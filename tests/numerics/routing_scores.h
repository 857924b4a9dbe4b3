// Routing scores for the QB and dynamic-k tests: sigmoid scores with hot and dead experts, the
// QB bias that evens a window, kept loads, and the budget check on fresh traffic that several
// tests share.
#ifndef MOE_TESTS_NUMERICS_ROUTING_SCORES_H_
#define MOE_TESTS_NUMERICS_ROUTING_SCORES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "services/common/random.h"
#include "services/numerics/dynamic_k.h"
#include "services/numerics/qb.h"
#include "services/numerics/router.h"

namespace moe::numerics::testing {

// Sigmoid scores with per-expert logit offsets: offset > 0 makes an expert hot, very negative
// makes it dead.
inline std::vector<float> SkewedScores(int64_t m, int64_t n, const std::vector<float>& offsets,
                                       uint64_t seed) {
  Rng rng(seed);
  std::vector<float> s(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      s[i * n + j] = 1.0f / (1.0f + std::exp(-(rng.Normal() + offsets[j])));
    }
  }
  return s;
}

inline std::vector<float> PowerLawOffsets(int64_t n, float strength, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> o(static_cast<size_t>(n));
  for (float& v : o) v = strength * static_cast<float>(std::pow(rng.Uniform(), 3.0));
  return o;
}

// The same with the offsets of PowerLawOffsets(n, strength, 1000 + n): the same experts are
// hot in every window.
inline std::vector<float> SkewedScores(int64_t m, int64_t n, uint64_t seed, float strength = 2.0f) {
  return SkewedScores(m, n, PowerLawOffsets(n, strength, 1000 + n), seed);
}

// The QB bias of a window, so that the full top-k loads are even before any budget.
inline std::vector<float> BalancedBias(const std::vector<float>& s, int64_t m, int64_t n,
                                       int64_t k) {
  std::vector<float> bias(static_cast<size_t>(n), 0.0f);
  for (int step = 0; step < 2; ++step) bias = QbExactStep(s, m, n, bias, k)->bias;
  return bias;
}

// The kept loads of `routing` per expert.
inline std::vector<int64_t> KeptLoads(const Routing& r, int64_t n) {
  std::vector<int64_t> loads(static_cast<size_t>(n), 0);
  for (int32_t e : r.expert_ids) {
    if (e >= 0) ++loads[e];
  }
  return loads;
}

// Thresholds solved on one window, applied to a fresh window of the same traffic: the mean
// experts per token is the budget, every expert keeps about budget / k of its selections, and
// the kept loads stay within the sampling noise of even (the QB MaxVio test).
inline void CheckBudgetsOnFreshTraffic(const std::vector<float>& table, const char* form) {
  const int64_t m = 16384, n = 128, k = 8;
  const std::vector<float> calib = SkewedScores(m, n, 11);
  const std::vector<float> bias = BalancedBias(calib, m, n, k);
  const std::vector<float> fresh = SkewedScores(m, n, 12);
  const Routing full = SelectExperts(fresh.data(), bias.data(), m, n, k, true, 1.0f);
  const BalanceMetrics full_balance = ComputeBalance(KeptLoads(full, n));
  for (int64_t b : {1, 2, 4, 6, 7}) {
    Routing r = full;
    const int64_t kept = ApplyBudget(fresh.data(), n, {1, BudgetRow(table, b, n)}, true, 1.0f, &r);
    const double per_token = static_cast<double>(kept) / m;
    const BalanceMetrics balance = ComputeBalance(KeptLoads(r, n));
    const double floor = NoiseFloorMaxVio(n, static_cast<double>(kept) / n);
    std::printf(
        "[ %s ] budget %lld of %lld: %.3f experts per token, MaxVio %.3f (full k %.3f, "
        "noise floor %.3f), min load / mean %.3f\n",
        form, static_cast<long long>(b), static_cast<long long>(k), per_token, balance.max_vio,
        full_balance.max_vio, floor, balance.min_over_target);
    EXPECT_NEAR(per_token, static_cast<double>(b), 0.03 * b) << form << " " << b;
    if (b == 1) {
      // b = k_min: no freedom left, every token keeps its first selection and the loads are
      // those of the first ranks (docs/math.md section 4.1 says so).
      EXPECT_EQ(kept, m) << form;
      continue;
    }
    EXPECT_LE(balance.max_vio, full_balance.max_vio + 1.5 * floor) << form << " " << b;
    EXPECT_EQ(balance.dead, 0) << form << " " << b;
  }
}

// Scores [m, n] with no two equal in any expert's column (a threshold cannot split equal
// scores): each repeat moved down by one float step until none is left.
inline void MakeColumnsDistinct(std::vector<float>* s, int64_t m, int64_t n) {
  for (int64_t e = 0; e < n; ++e) {
    for (bool again = true; again;) {
      again = false;
      std::vector<std::pair<float, int64_t>> col;
      for (int64_t t = 0; t < m; ++t) col.emplace_back((*s)[t * n + e], t);
      std::sort(col.begin(), col.end());
      for (size_t i = 1; i < col.size(); ++i) {
        if (col[i].first == col[i - 1].first) {
          float& x = (*s)[col[i].second * n + e];
          x = std::nextafter(x, 0.0f);
          again = true;
        }
      }
    }
  }
}

// An empty histogram of layer 3 over `bias` (window and bias version 1 unless told).
inline QbHistogram MakeHistogram(const std::vector<float>& bias, int64_t k, int bins,
                                 uint64_t window = 1, uint64_t version = 1) {
  QbWindow w;
  w.window_id = window;
  w.bias_version = version;
  w.layer = 3;
  w.top_k = k;
  w.bins = bins;
  return *QbHistogram::Create(w, bias);
}

}  // namespace moe::numerics::testing

#endif  // MOE_TESTS_NUMERICS_ROUTING_SCORES_H_
