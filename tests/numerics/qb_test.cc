// Quantile Balancing: everything docs/quantile-balancing.md "Tests that pin it down" lists.
#include "services/numerics/qb.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "services/common/random.h"
#include "services/numerics/router.h"
#include "tests/numerics/routing_scores.h"

namespace moe::numerics {
namespace {

using testing::MakeHistogram;
using testing::PowerLawOffsets;
using testing::SkewedScores;

// A margin s - alpha with alpha = s' + b is rounded twice in fp32, so the built-in tie of the
// (k+1)-th expert (margin exactly -b_j) holds up to one fp32 ulp of values below 2.
constexpr float kMarginRoundingTol = 0x1p-23f;

TEST(TopK, MatchesAFullSortWithTheTieRule) {
  Rng rng(17);
  // Small rows (every path of the insertion), then K3-like rows where the block test (16 values
  // at a time) decides most values: with many ties, and with distinct values.
  // Wide rows take the floor form (the k-th of 64 group maxima, k <= 32); k up to 40 there
  // crosses into the insertion form. Signed zeros are equal values (index order decides).
  for (int trial = 0; trial < 1500; ++trial) {
    const bool wide = trial >= 300;
    const int64_t n = wide ? 17 + rng.Next() % 1000 : 2 + rng.Next() % 40;
    const int64_t k = 1 + rng.Next() % (wide ? std::min<int64_t>(40, n - 1) : n - 1);
    std::vector<float> v(n);
    for (float& x : v) {
      switch (trial % 3) {
        case 0:  // many ties
          x = static_cast<float>(rng.Next() % 5) * 0.25f;
          break;
        case 1:
          x = static_cast<float>(rng.Uniform());
          break;
        default:  // signed zeros, negatives, ties at the top
          x = (rng.Next() % 2 == 0 ? -0.0f : 0.0f) + static_cast<float>(rng.Next() % 3) * -0.5f;
      }
    }
    std::vector<int32_t> want(n);
    std::iota(want.begin(), want.end(), 0);
    std::stable_sort(want.begin(), want.end(), [&](int32_t a, int32_t b) { return v[a] > v[b]; });
    std::vector<int32_t> got(k);
    TopK(v.data(), n, k, got.data());
    ASSERT_EQ(got, std::vector<int32_t>(want.begin(), want.begin() + k)) << "trial " << trial;
  }
}

// The exact step's per-column selection (a sampled threshold, a row-major filter, threads) is
// the definition's: each b-hat_j is minus the (floor(q)+1)-th largest margin s_ij - cutoff_i of
// its column, here by a full sort, at shapes up to K3's n and k, on skewed and on tied scores
// (many equal margins: a threshold sample can under-count), bit for bit.
TEST(QuantileBalancing, ExactStepSelectsAsAFullSortDoes) {
  Rng rng(29);
  struct Shape {
    int64_t m, n, k;
    bool ties;
  };
  for (const Shape& sh : {Shape{4096, 896, 16, false}, Shape{3000, 128, 8, false},
                          Shape{2048, 64, 4, true}, Shape{100, 16, 3, false}}) {
    SCOPED_TRACE(sh.m);
    std::vector<float> s(static_cast<size_t>(sh.m * sh.n));
    for (float& v : s) {
      v = sh.ties ? static_cast<float>(rng.Next() % 4) * 0.25f
                  : static_cast<float>(std::pow(rng.Uniform(), 2.0));
    }
    std::vector<float> b(static_cast<size_t>(sh.n));
    for (float& v : b) v = static_cast<float>(rng.Uniform() * 0.1 - 0.05);
    auto step = QbExactStep(s, sh.m, sh.n, b, sh.k);
    ASSERT_TRUE(step.ok()) << step.status();
    const int64_t rank = static_cast<int64_t>(std::floor(static_cast<double>(sh.m) * sh.k / sh.n));
    std::vector<float> biased(static_cast<size_t>(sh.n));
    std::vector<int32_t> top(static_cast<size_t>(sh.k + 1));
    for (int64_t i = 0; i < sh.m; ++i) {  // cutoffs and routes: a plain TopK per token
      for (int64_t j = 0; j < sh.n; ++j) biased[j] = s[i * sh.n + j] + b[j];
      TopK(biased.data(), sh.n, sh.k + 1, top.data());
      ASSERT_EQ(step->cutoffs[i], biased[top[sh.k]]) << i;
      for (int64_t r = 0; r < sh.k; ++r) ASSERT_EQ(step->routes[i * sh.k + r], top[r]);
    }
    for (int64_t j = 0; j < sh.n; ++j) {
      std::vector<float> column(static_cast<size_t>(sh.m));
      for (int64_t i = 0; i < sh.m; ++i) column[i] = s[i * sh.n + j] - step->cutoffs[i];
      std::sort(column.begin(), column.end(), std::greater<float>());
      ASSERT_EQ(step->raw_bias[j], -column[rank]) << "column " << j;
    }
  }
}

TEST(QuantileBalancing, GoldenToy) {
  // docs/quantile-balancing.md test 1: n = 4, k = 1, m = 8 (q = 2), b = 0, scores x 64.
  const float raw[8][4] = {{37, 52, 16, 31}, {45, 6, 61, 30},  {63, 47, 27, 15}, {6, 60, 44, 24},
                           {7, 61, 49, 11},  {29, 21, 26, 13}, {50, 15, 45, 29}, {54, 12, 42, 49}};
  std::vector<float> s;
  for (const auto& row : raw) {
    for (float v : row) s.push_back(v / 64.0f);
  }
  const std::vector<float> b(4, 0.0f);
  auto step = QbExactStep(s, 8, 4, b, 1);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->loads, (std::vector<int64_t>{4, 3, 1, 0}));
  const std::vector<float> raw_x64 = {-5, -12, 0, 13};
  for (int j = 0; j < 4; ++j) EXPECT_EQ(step->raw_bias[j] * 64.0f, raw_x64[j]) << j;
  EXPECT_EQ(step->bias, (std::vector<float>{-0.0625f, -0.171875f, 0.015625f, 0.21875f}));
  EXPECT_EQ(RouteLoads(s, 8, 4, step->bias, 1), (std::vector<int64_t>{2, 2, 2, 2}));
}

struct Case {
  int64_t m, n, k;
  std::vector<float> s, b;
};

Case RandomCase(Rng& rng, int64_t max_m, int64_t max_n) {
  Case c;
  c.m = 1 + rng.Next() % max_m;
  c.n = 2 + rng.Next() % (max_n - 1);
  c.k = 1 + rng.Next() % (c.n - 1);
  std::vector<float> offsets(c.n);
  for (float& o : offsets) o = 2.0f * rng.Normal();
  c.s = SkewedScores(c.m, c.n, offsets, rng.Next());
  c.b.resize(c.n);
  for (float& v : c.b) v = 0.1f * rng.Normal();
  return c;
}

TEST(QuantileBalancing, FixedCutoffSandwichAndSignDirection) {
  Rng rng(2);
  for (int trial = 0; trial < 200; ++trial) {
    const Case c = RandomCase(rng, 300, 40);
    auto step = QbExactStep(c.s, c.m, c.n, c.b, c.k);
    ASSERT_TRUE(step.ok());
    const double q = double(c.m) * c.k / c.n;
    for (int64_t j = 0; j < c.n; ++j) {
      int64_t above = 0, at_least = 0;
      for (int64_t i = 0; i < c.m; ++i) {
        const float margin = c.s[i * c.n + j] - step->cutoffs[i];
        above += margin > -step->raw_bias[j];
        at_least += margin >= -step->raw_bias[j];
      }
      ASSERT_LE(above, q) << "trial " << trial << " expert " << j;
      ASSERT_GE(at_least, q) << "trial " << trial << " expert " << j;
      // Direction agrees with the sign rule.
      if (step->loads[j] > q) {
        ASSERT_LT(step->raw_bias[j], c.b[j]) << "trial " << trial << " expert " << j;
      } else if (step->loads[j] < q) {
        ASSERT_GE(step->raw_bias[j], c.b[j] - kMarginRoundingTol)
            << "trial " << trial << " expert " << j;
      }
    }
  }
}

TEST(QuantileBalancing, MatchesBruteForceSortReference) {
  Rng rng(3);
  for (int trial = 0; trial < 300; ++trial) {
    const Case c = RandomCase(rng, 50, 10);
    auto step = QbExactStep(c.s, c.m, c.n, c.b, c.k);
    ASSERT_TRUE(step.ok());
    std::vector<float> alpha(c.m);
    for (int64_t i = 0; i < c.m; ++i) {
      std::vector<std::pair<float, int64_t>> row;
      for (int64_t j = 0; j < c.n; ++j) row.push_back({-(c.s[i * c.n + j] + c.b[j]), j});
      std::sort(row.begin(), row.end());  // biased descending, then id ascending
      alpha[i] = -row[c.k].first;
      for (int64_t r = 0; r < c.k; ++r) ASSERT_EQ(step->routes[i * c.k + r], row[r].second);
    }
    const int64_t rank = static_cast<int64_t>(std::floor(double(c.m) * c.k / c.n));
    for (int64_t j = 0; j < c.n; ++j) {
      std::vector<float> col;
      for (int64_t i = 0; i < c.m; ++i) col.push_back(c.s[i * c.n + j] - alpha[i]);
      std::sort(col.rbegin(), col.rend());
      ASSERT_EQ(step->raw_bias[j], -col[rank]) << "trial " << trial << " expert " << j;
    }
  }
}

TEST(QuantileBalancing, CenteringChangesNoRouting) {
  Rng rng(4);
  for (int trial = 0; trial < 50; ++trial) {
    const Case c = RandomCase(rng, 200, 64);
    auto step = QbExactStep(c.s, c.m, c.n, c.b, c.k);
    ASSERT_TRUE(step.ok());
    double mean = 0;
    for (float v : step->bias) mean += v;
    EXPECT_NEAR(mean / c.n, 0.0, 1e-6);
    const Case fresh = RandomCase(rng, 200, 64);
    if (fresh.n != c.n) continue;
    EXPECT_EQ(RouteLoads(fresh.s, fresh.m, c.n, step->bias, c.k),
              RouteLoads(fresh.s, fresh.m, c.n, step->raw_bias, c.k));
  }
}

TEST(QuantileBalancing, ConvergesOnASkewedFixedBatchAtK3Shape) {
  const int64_t m = 8192, n = 896, k = 16;
  const std::vector<float> s = SkewedScores(m, n, PowerLawOffsets(n, 3.0f, 5), 6);
  std::vector<float> b(n, 0.0f);
  const double before = ComputeBalance(RouteLoads(s, m, n, b, k)).max_vio;
  EXPECT_GT(before, 2.0);
  double vio = before;
  int steps = 0;
  for (; steps < 10 && vio >= 0.05; ++steps) {
    auto step = QbExactStep(s, m, n, b, k);
    ASSERT_TRUE(step.ok());
    b = step->bias;
    vio = ComputeBalance(RouteLoads(s, m, n, b, k)).max_vio;
  }
  EXPECT_LT(vio, 0.05) << "after " << steps << " steps, from " << before;
}

TEST(QuantileBalancing, RevivesDeadExpertsInOneStepWhereTheSignRuleCannot) {
  const int64_t m = 4096, n = 128, k = 8;
  std::vector<float> offsets = PowerLawOffsets(n, 1.0f, 7);
  for (int64_t j = 0; j < 10; ++j) offsets[j] = -12.0f;  // never in anyone's top-k
  const std::vector<float> s = SkewedScores(m, n, offsets, 8);
  const std::vector<float> b(n, 0.0f);
  const std::vector<int64_t> loads = RouteLoads(s, m, n, b, k);
  EXPECT_EQ(ComputeBalance(loads).dead, 10);
  auto step = QbExactStep(s, m, n, b, k);
  ASSERT_TRUE(step.ok());
  const std::vector<int64_t> after = RouteLoads(s, m, n, step->bias, k);
  EXPECT_EQ(ComputeBalance(after).dead, 0);
  for (int64_t j = 0; j < 10; ++j) EXPECT_GT(after[j], 0) << "expert " << j;
  // The sign rule with a typical gamma moves each bias by 1e-3 per step: still dead.
  const std::vector<float> signed_b = SignRuleStep(b, loads, 1e-3f);
  EXPECT_EQ(ComputeBalance(RouteLoads(s, m, n, signed_b, k)).dead, 10);
}

TEST(QuantileBalancing, EdgeCases) {
  const std::vector<float> s = {0.1f, 0.9f, 0.5f, 0.4f};
  EXPECT_EQ(QbExactStep(s, 2, 2, {0, 0}, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(QbExactStep(s, 2, 2, {0, 0}, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(QbExactStep(s, 1, 2, {0, 0}, 1).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<float> nan = s;
  nan[2] = std::nanf("");
  const auto st = QbExactStep(nan, 2, 2, {0, 0}, 1).status();
  EXPECT_NE(std::string(st.message()).find("token 1, expert 0"), std::string::npos) << st;
  // An empty window keeps the bias, in both forms.
  const std::vector<float> b = {0.25f, -0.25f};
  auto empty = QbExactStep({}, 0, 2, b, 1);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->bias, b);
  EXPECT_EQ(MakeHistogram(b, 1, 10).Solve(), b);
  QbWindow k_eq_n;
  k_eq_n.top_k = 2;
  EXPECT_FALSE(QbHistogram::Create(k_eq_n, b).ok());
}

// The steps check the scores as they route them (one pass over memory): a NaN or an infinity
// anywhere (a sampled token, another, the row's tail past the last block of 16) is refused by
// name, and a refused window leaves a histogram as it was.
TEST(QuantileBalancing, NonFiniteScoresAnywhereAreRefusedAndChangeNothing) {
  const int64_t m = 4096, n = 900, k = 16;
  Rng rng(41);
  std::vector<float> good(static_cast<size_t>(m * n));
  for (float& v : good) v = static_cast<float>(rng.Uniform());
  const std::vector<float> bias(static_cast<size_t>(n), 0.0f);
  for (auto [token, expert] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 0}, {32, 5}, {1000, 17}, {4095, 899}, {2049, 897}}) {
    for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity()}) {
      std::vector<float> s = good;
      s[token * n + expert] = bad;
      const std::string want = absl::StrCat("token ", token, ", expert ", expert);
      const auto step = QbExactStep(s, m, n, bias, k);
      ASSERT_FALSE(step.ok());
      EXPECT_NE(std::string(step.status().message()).find(want), std::string::npos)
          << step.status();
      QbWindow w;
      w.top_k = static_cast<int32_t>(k);
      w.bins = 100;
      auto h = QbHistogram::Create(w, bias);
      ASSERT_TRUE(h.ok());
      ASSERT_TRUE(h->Accumulate(good, m).ok());
      const std::string before = h->Serialize();
      const absl::Status refused = h->Accumulate(s, m);
      ASSERT_FALSE(refused.ok());
      EXPECT_NE(std::string(refused.message()).find(want), std::string::npos) << refused;
      EXPECT_EQ(h->Serialize(), before) << "a refused window changed the histogram";
    }
  }
}

TEST(BalanceMetrics, KnownValues) {
  const std::vector<int64_t> loads = {4, 3, 1, 0};
  const BalanceMetrics m = ComputeBalance(loads, std::vector<int32_t>{0, 0, 1, 1});
  EXPECT_DOUBLE_EQ(m.target, 2.0);
  EXPECT_DOUBLE_EQ(m.max_vio, 1.0);
  EXPECT_DOUBLE_EQ(m.min_over_target, 0.0);
  EXPECT_EQ(m.dead, 1);
  EXPECT_DOUBLE_EQ(m.cv, std::sqrt((4.0 + 1.0 + 1.0 + 4.0) / 4) / 2.0);
  EXPECT_DOUBLE_EQ(m.shard_max_over_mean, 7.0 / 4.0);
  EXPECT_NEAR(NoiseFloorMaxVio(896, 1024), 0.115, 0.001);
  const std::vector<float> stepped = SignRuleStep({0, 0, 0, 0}, loads, 0.5f);
  EXPECT_EQ(stepped, (std::vector<float>{-0.5f, -0.5f, 0.5f, 0.5f}));
}

}  // namespace
}  // namespace moe::numerics
