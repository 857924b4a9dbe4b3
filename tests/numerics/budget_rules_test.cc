// Dynamic k's other rules and forms (docs/math.md section 4.1): top-p by routing weight, the
// histogram form of the budget thresholds against the exact one, and its wire form against
// hostile bytes. (The rule and the exact thresholds: dynamic_k_test.cc.)
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>

#include "gtest/gtest.h"
#include "services/common/random.h"
#include "services/numerics/dynamic_k.h"
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

// Top-p by routing weight against its definition, token by token: the kept experts are the
// largest scores of the token's top k, their share reaches p, one fewer would not (unless at
// k_min), and they stay in rank order with weights renormalized over them.
TEST(TopP, KeepsTheFewestLargestScoresThatReachP) {
  const int64_t m = 400, n = 64, k = 8;
  const std::vector<float> s = SkewedScores(m, n, 31);
  const std::vector<float> bias(n, 0.0f);
  const Routing full = SelectExperts(s.data(), bias.data(), m, n, k, true, 1.0f);
  for (double p : {0.3, 0.5, 0.8, 0.95}) {
    for (int64_t k_min : {1, 2}) {
      Routing r = full;
      BudgetRule rule;
      rule.k_min = k_min;
      rule.top_p = p;
      const int64_t kept = ApplyBudget(s.data(), n, rule, true, 1.0f, &r);
      int64_t counted = 0;
      for (int64_t t = 0; t < m; ++t) {
        std::vector<float> all, kept_s;
        for (int64_t j = 0; j < k; ++j) all.push_back(s[t * n + full.expert_ids[t * k + j]]);
        int64_t rank_of_prev = -1;
        for (int64_t j = 0; j < k; ++j) {
          const int32_t e = r.expert_ids[t * k + j];
          if (e < 0) continue;
          kept_s.push_back(s[t * n + e]);
          // rank order kept: e's slot in the full routing comes after the previous kept one
          const int64_t rank =
              std::find(full.expert_ids.begin() + t * k, full.expert_ids.begin() + (t + 1) * k, e) -
              (full.expert_ids.begin() + t * k);
          EXPECT_GT(rank, rank_of_prev);
          rank_of_prev = rank;
        }
        counted += static_cast<int64_t>(kept_s.size());
        double total = 0, got = 0;
        for (float v : all) total += v;
        for (float v : kept_s) got += v;
        ASSERT_GE(static_cast<int64_t>(kept_s.size()), k_min);
        EXPECT_GE(got, p * total - 1e-9) << "token " << t;
        // The kept are the largest: the smallest kept is >= every dropped one.
        const float smallest_kept = *std::min_element(kept_s.begin(), kept_s.end());
        std::sort(all.begin(), all.end(), std::greater<float>());
        const size_t c = kept_s.size();
        if (c < all.size()) {
          EXPECT_GE(smallest_kept, all[c]) << "token " << t;
        }
        // Minimal: without the smallest kept the share is below p (unless k_min binds).
        if (static_cast<int64_t>(c) > k_min) {
          EXPECT_LT(got - smallest_kept, p * total) << "token " << t;
        }
      }
      EXPECT_EQ(kept, counted);
    }
  }
}

// The p matched to a budget keeps at least that many experts per token on the window it was
// solved from, and a p just below keeps fewer.
TEST(TopP, ForABudgetIsTheSmallestPThatKeepsIt) {
  const int64_t m = 2000, n = 64, k = 8;
  const std::vector<float> s = SkewedScores(m, n, 32);
  const std::vector<float> bias = BalancedBias(s, m, n, k);
  const Routing full = SelectExperts(s.data(), bias.data(), m, n, k, true, 1.0f);
  auto kept_at = [&](double p) {
    Routing r = full;
    BudgetRule rule;
    rule.top_p = p;
    return static_cast<double>(ApplyBudget(s.data(), n, rule, true, 1.0f, &r)) / m;
  };
  for (double b : {2.0, 4.0, 6.0}) {
    auto p = TopPForBudget(s, m, n, bias, k, 1, b);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_GE(kept_at(*p), b);
    EXPECT_LT(kept_at(*p - 1e-6), b);
    EXPECT_LT(kept_at(*p), b + 0.05);  // matched: no whole expert more per token
  }
  EXPECT_EQ(TopPForBudget(s, m, n, bias, k, 1, 9.0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(BudgetThresholds, HistogramAgreesWithTheExactForm) {
  const int64_t m = 16384, n = 128, k = 8;
  const std::vector<float> calib = SkewedScores(m, n, 11);
  const std::vector<float> bias = BalancedBias(calib, m, n, k);
  BudgetWindow w;
  w.bias_version = 3;
  w.layer = 1;
  w.top_k = k;
  w.k_min = 1;
  w.bins = 512;
  // Two attention nodes' halves merge into the whole window exactly.
  auto whole = BudgetHistogram::Create(w, n);
  auto a = BudgetHistogram::Create(w, n);
  auto b = BudgetHistogram::Create(w, n);
  ASSERT_TRUE(whole.ok() && a.ok() && b.ok());
  const Routing full = SelectExperts(calib.data(), bias.data(), m, n, k, true, 1.0f);
  ASSERT_TRUE(whole->Accumulate(full, calib.data()).ok());
  Routing first = full, second = full;
  first.tokens = 5000;
  first.expert_ids.resize(5000 * k);
  second.tokens = m - 5000;
  second.expert_ids.erase(second.expert_ids.begin(), second.expert_ids.begin() + 5000 * k);
  ASSERT_TRUE(a->Accumulate(first, calib.data()).ok());
  ASSERT_TRUE(b->Accumulate(second, calib.data() + 5000 * n).ok());
  ASSERT_TRUE(a->Merge(*b).ok());
  EXPECT_EQ(a->counts(), whole->counts());
  EXPECT_EQ(a->forced(), whole->forced());
  EXPECT_EQ(a->tokens(), m);
  // Every selection is counted once: forced + free = m * k.
  int64_t total = std::accumulate(whole->forced().begin(), whole->forced().end(), int64_t{0});
  for (uint32_t c : whole->counts()) total += c;
  EXPECT_EQ(total, m * k);
  EXPECT_EQ(std::accumulate(whole->forced().begin(), whole->forced().end(), int64_t{0}), m);

  const std::vector<float> table = whole->SolveTable();
  const std::vector<float> exact = *ExactBudgetThresholds(calib, m, n, bias, k, 1);
  ASSERT_EQ(table.size(), exact.size());
  // A threshold inside the scores lies within about a bin of the exact one (the exact one rounds
  // its count, the histogram interpolates inside the bin).
  int64_t inside = 0;
  for (size_t i = 0; i < table.size(); ++i) {
    if (std::isinf(exact[i]) || exact[i] == 0.0f) continue;
    ++inside;
    EXPECT_NEAR(table[i], exact[i], 2.0 / w.bins) << "entry " << i;
  }
  EXPECT_GT(inside, static_cast<int64_t>(table.size()) / 2);
  CheckBudgetsOnFreshTraffic(table, "histogram");
}

TEST(BudgetHistogram, RoundTripsAndRefusesHostileBytes) {
  const int64_t m = 700, n = 64, k = 4;
  const std::vector<float> s = SkewedScores(m, n, 21);
  BudgetWindow w;
  w.bias_version = 9;
  w.layer = 2;
  w.top_k = k;
  w.k_min = 2;
  w.bins = 100;
  auto h = BudgetHistogram::Create(w, n);
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(h->Accumulate(SelectExperts(s.data(), nullptr, m, n, k, true, 1.0f), s.data()).ok());
  const std::string bytes = h->Serialize();
  auto back = BudgetHistogram::Deserialize(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->counts(), h->counts());
  EXPECT_EQ(back->forced(), h->forced());
  EXPECT_EQ(back->tokens(), m);
  EXPECT_EQ(back->window().k_min, 2);
  EXPECT_EQ(back->SolveTable(), h->SolveTable());
  // Zero runs keep it small: far under one byte per bin.
  EXPECT_LT(bytes.size(), static_cast<size_t>(n * w.bins));

  for (size_t cut : {size_t{3}, size_t{20}, bytes.size() / 2, bytes.size() - 1}) {
    EXPECT_FALSE(BudgetHistogram::Deserialize(bytes.substr(0, cut)).ok()) << "cut at " << cut;
  }
  EXPECT_FALSE(BudgetHistogram::Deserialize(bytes + "x").ok());
  std::string lying = bytes;
  lying[lying.size() - 1] ^= 1;  // the last count or run changes: sums or runs no longer add up
  EXPECT_FALSE(BudgetHistogram::Deserialize(lying).ok());
  // A 40-byte header claiming 2^20 experts x 4096 bins is refused before any allocation.
  std::string huge = bytes.substr(0, 4 + 8 + 4);
  const uint32_t big_n = 1u << 20, k4 = 4, kmin = 1, bins = 4096;
  for (uint32_t v : {big_n, k4, kmin, bins}) huge.append(reinterpret_cast<const char*>(&v), 4);
  huge.push_back(0);
  auto refused = BudgetHistogram::Deserialize(huge);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("cells"), std::string::npos) << refused.status();
  // A different window does not merge.
  BudgetWindow other = w;
  other.k_min = 1;
  auto o = BudgetHistogram::Create(other, n);
  ASSERT_TRUE(o.ok());
  const absl::Status merged = h->Merge(*o);
  EXPECT_FALSE(merged.ok());
  EXPECT_NE(merged.message().find("k_min 1"), std::string::npos) << merged;
}

}  // namespace
}  // namespace moe::numerics
