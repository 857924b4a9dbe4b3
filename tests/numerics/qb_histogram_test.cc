// Quantile Balancing's mergeable histograms (docs/quantile-balancing.md "Tests that pin it
// down"): counts past 16 bits, exact merges under any sharding, the solve within two bin widths
// of the exact step, predicted loads against measured ones, and the wire form against
// corruption. (The exact step and the rest: qb_test.cc.)
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
#include "services/numerics/qb.h"
#include "services/numerics/router.h"
#include "tests/numerics/routing_scores.h"

namespace moe::numerics {
namespace {

using testing::MakeHistogram;
using testing::PowerLawOffsets;
using testing::SkewedScores;

// A piece of a window counts in 16 bits and moves its counts to 32 bits every 65535 tokens: a
// window of 200,000 tokens in one call (pieces past 65535 on any machine) counts exactly what the
// same tokens in calls of 1000 do, with one bin holding every token (200,000 > 2^16) and with
// 64 bins.
TEST(QbHistogram, LargeWindowsCountPastSixteenBits) {
  const int64_t m = 200000, n = 8, k = 2;
  Rng rng(43);
  std::vector<float> s(static_cast<size_t>(m * n));
  for (float& v : s) v = static_cast<float>(rng.Uniform());
  const std::vector<float> b(static_cast<size_t>(n), 0.0f);
  for (int bins : {1, 64}) {
    QbHistogram whole = MakeHistogram(b, k, bins), chunked = MakeHistogram(b, k, bins);
    ASSERT_TRUE(whole.Accumulate(s, m).ok());
    for (int64_t t0 = 0; t0 < m; t0 += 1000) {
      ASSERT_TRUE(chunked.Accumulate(absl::MakeConstSpan(s.data() + t0 * n, 1000 * n), 1000).ok());
    }
    EXPECT_EQ(whole.tokens(), m);
    EXPECT_EQ(whole.Serialize(), chunked.Serialize()) << bins << " bins";
    if (bins == 1) {
      for (int64_t j = 0; j < n; ++j) EXPECT_EQ(whole.counts()[j], static_cast<uint32_t>(m));
    }
  }
}

TEST(QbHistogram, RowsSumToTokensAndMergeIsExactForAnySharding) {
  Rng rng(9);
  const int64_t m = 3000, n = 96, k = 6;
  const std::vector<float> s = SkewedScores(m, n, PowerLawOffsets(n, 2.0f, 1), 2);
  std::vector<float> b(n);
  for (float& v : b) v = 0.2f * rng.Normal();
  QbHistogram pooled = MakeHistogram(b, k, 1000);
  ASSERT_TRUE(pooled.Accumulate(s, m).ok());
  for (int64_t j = 0; j < n; ++j) {
    int64_t row = 0;
    for (int l = 0; l < 1000; ++l) row += pooled.counts()[j * 1000 + l];
    ASSERT_EQ(row, m);
  }
  EXPECT_EQ(pooled.loads(), RouteLoads(s, m, n, b, k));
  for (int trial = 0; trial < 5; ++trial) {
    // Split the tokens at random cut points into 1..4 nodes, each accumulating in pieces.
    std::vector<int64_t> cuts = {0, m};
    const int nodes = 1 + trial % 4;
    for (int c = 1; c < nodes; ++c) cuts.push_back(rng.Next() % m);
    std::sort(cuts.begin(), cuts.end());
    QbHistogram merged = MakeHistogram(b, k, 1000);
    for (size_t c = 0; c + 1 < cuts.size(); ++c) {
      QbHistogram node = MakeHistogram(b, k, 1000);
      const int64_t lo = cuts[c], hi = cuts[c + 1], mid = lo + (hi - lo) / 2;
      ASSERT_TRUE(
          node.Accumulate(absl::MakeSpan(s).subspan(lo * n, (mid - lo) * n), mid - lo).ok());
      ASSERT_TRUE(
          node.Accumulate(absl::MakeSpan(s).subspan(mid * n, (hi - mid) * n), hi - mid).ok());
      // Through the wire format, as attention nodes send it.
      auto wire = QbHistogram::Deserialize(node.Serialize());
      ASSERT_TRUE(wire.ok()) << wire.status();
      ASSERT_TRUE(merged.Merge(*wire).ok());
    }
    EXPECT_EQ(merged.counts(), pooled.counts());
    EXPECT_EQ(merged.loads(), pooled.loads());
    EXPECT_EQ(merged.tokens(), m);
    EXPECT_EQ(merged.Solve(), pooled.Solve());
  }
}

// An attention node counts every batch into its window (attention-svc/node_stats.cc), most of
// them a few tokens. Batches that get one thread count straight into the window's table; pieces
// of a large batch count in tables of their own. Either way each count is the one the definition
// gives, read here token by token with plain loops: alpha_i the (k+1)-th largest s_ij + b_j, bin
// floor((double(alpha_i - s_ij) - lo) * bins / (hi - lo)) clamped, loads the top k. Batch sizes
// 1, 7, 32 (a tile), 33 (a tile and one), 300 and 2,500 (pieces on a machine with two cores),
// n = 900 (not a multiple of 16), added one after another to one window. A batch whose last
// token is not finite is refused and changes nothing, at a size of one and of two tiles.
TEST(QbHistogram, EveryBatchSizeCountsWhatTheDefinitionGives) {
  const int64_t n = 900, k = 16;
  const int bins = 1000;
  Rng rng(77);
  std::vector<float> b(static_cast<size_t>(n));
  for (float& v : b) v = 0.3f * static_cast<float>(rng.Normal());
  const double lo = *std::min_element(b.begin(), b.end()) - 1.0;
  const double hi = *std::max_element(b.begin(), b.end()) + 1.0;
  const std::vector<int64_t> sizes = {1, 7, 32, 33, 300, 2500};
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  const std::vector<float> s = SkewedScores(total, n, PowerLawOffsets(n, 2.0f, 3), 5);
  std::vector<uint32_t> want(static_cast<size_t>(n * bins), 0);
  for (int64_t t = 0; t < total; ++t) {
    std::vector<float> biased(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) biased[j] = s[t * n + j] + b[j];
    std::vector<float> sorted = biased;
    std::nth_element(sorted.begin(), sorted.begin() + k, sorted.end(), std::greater<float>());
    const float alpha = sorted[k];
    for (int64_t j = 0; j < n; ++j) {
      const float r = alpha - s[t * n + j];
      const double pos = std::floor((static_cast<double>(r) - lo) * (bins / (hi - lo)));
      const int64_t l = static_cast<int64_t>(std::clamp(pos, 0.0, static_cast<double>(bins - 1)));
      ++want[j * bins + l];
    }
  }
  QbHistogram h = MakeHistogram(b, k, bins);
  int64_t at = 0;
  for (int64_t m : sizes) {
    ASSERT_TRUE(h.Accumulate(absl::MakeConstSpan(s).subspan(at * n, m * n), m).ok()) << m;
    at += m;
  }
  EXPECT_EQ(h.tokens(), total);
  EXPECT_EQ(h.loads(), RouteLoads(s, total, n, b, k));
  int64_t differ = 0;
  for (size_t i = 0; i < want.size(); ++i) differ += h.counts()[i] != want[i];
  EXPECT_EQ(differ, 0) << "of " << want.size() << " bins";
  const std::string before = h.Serialize();
  for (int64_t m : {int64_t{1}, int64_t{64}}) {
    std::vector<float> bad(s.begin(), s.begin() + m * n);
    bad[(m - 1) * n + n - 1] = std::nanf("");
    const absl::Status refused = h.Accumulate(bad, m);
    ASSERT_FALSE(refused.ok()) << m;
    EXPECT_NE(std::string(refused.message()).find(absl::StrCat("token ", m - 1)), std::string::npos)
        << refused;
    EXPECT_EQ(h.Serialize(), before) << "a refused batch of " << m << " changed the window";
  }
}

TEST(QbHistogram, SolveIsWithinTwoBinWidthsOfExact) {
  Rng rng(10);
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t m = 500 + rng.Next() % 3000, n = 16 + rng.Next() % 200;
    const int64_t k = 1 + rng.Next() % std::min<int64_t>(16, n - 1);
    const std::vector<float> s =
        SkewedScores(m, n, PowerLawOffsets(n, 2.5f, rng.Next()), rng.Next());
    std::vector<float> b(n);
    for (float& v : b) v = 0.3f * rng.Normal();
    const int bins = trial % 2 ? 1000 : 100;
    QbHistogram h = MakeHistogram(b, k, bins);
    ASSERT_TRUE(h.Accumulate(s, m).ok());
    const std::vector<float> hist = h.Solve();
    auto exact = QbExactStep(s, m, n, b, k);
    ASSERT_TRUE(exact.ok());
    for (int64_t j = 0; j < n; ++j) {
      ASSERT_LE(std::fabs(hist[j] - exact->bias[j]), 2 * h.bin_width())
          << "trial " << trial << " expert " << j << " bins " << bins;
    }
  }
}

TEST(QbHistogram, PredictedLoadsMatchMeasuredAtTheRoutingBiasAndEvenOutAtTheSolvedOne) {
  const int64_t m = 4096, n = 128, k = 8;
  const std::vector<float> s = SkewedScores(m, n, PowerLawOffsets(n, 3.0f, 3), 4);
  std::vector<float> b(n, 0.0f);
  QbHistogram h = MakeHistogram(b, k, 1000);
  ASSERT_TRUE(h.Accumulate(s, m).ok());
  const double q = static_cast<double>(m) * k / n;
  // At the routing bias: the measured loads, up to the mass of one bin per expert.
  const std::vector<double> at_routing = h.PredictLoads(b);
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    sum += at_routing[j];
    int64_t bin_max = 0;
    for (int64_t l = 0; l < 1000; ++l)
      bin_max = std::max<int64_t>(bin_max, h.counts()[j * 1000 + l]);
    EXPECT_NEAR(at_routing[j], static_cast<double>(h.loads()[j]), bin_max + 1.0) << "expert " << j;
  }
  EXPECT_NEAR(sum, static_cast<double>(m * k), 1e-6 * m * k);
  // The skewed window is far from even; the solved bias predicts every load within 2% of q.
  EXPECT_GT(ComputeBalance(h.loads()).max_vio, 1.0);
  const std::vector<double> after = h.PredictLoads(h.Solve());
  for (int64_t j = 0; j < n; ++j) EXPECT_NEAR(after[j], q, 0.02 * q) << "expert " << j;
  // Wrong size: all zero.
  EXPECT_EQ(h.PredictLoads(std::vector<float>(3, 0.0f)), std::vector<double>(n, 0.0));
}

TEST(QbHistogram, RejectsMismatchedStatistics) {
  const std::vector<float> b(8, 0.0f);
  QbHistogram h = MakeHistogram(b, 2, 100, /*window=*/5, /*version=*/2);
  auto expect_reject = [&](const QbHistogram& other, const char* word) {
    const absl::Status st = h.Merge(other);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(std::string(st.message()).find(word), std::string::npos) << st;
  };
  expect_reject(MakeHistogram(b, 2, 100, 6, 2), "window 6");
  expect_reject(MakeHistogram(b, 2, 100, 5, 3), "bias version 3");
  expect_reject(MakeHistogram(b, 2, 50, 5, 2), "bins 50");
  std::vector<float> shifted(8, 0.0f);
  shifted[0] = 0.5f;  // another routing bias: another range
  expect_reject(MakeHistogram(shifted, 2, 100, 5, 2), "range");
  EXPECT_TRUE(h.Merge(MakeHistogram(b, 2, 100, 5, 2)).ok());
}

TEST(QbHistogram, SerializedFormRoundTripsAndRejectsCorruption) {
  const int64_t m = 200, n = 32, k = 4;
  const std::vector<float> s = SkewedScores(m, n, PowerLawOffsets(n, 2.0f, 3), 4);
  QbHistogram h = MakeHistogram(std::vector<float>(n, 0.01f), k, 100);
  ASSERT_TRUE(h.Accumulate(s, m).ok());
  const std::string wire = h.Serialize();
  auto back = QbHistogram::Deserialize(wire);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->counts(), h.counts());
  EXPECT_EQ(back->loads(), h.loads());
  EXPECT_EQ(back->window().layer, 3);
  EXPECT_EQ(back->Solve(), h.Solve());
  for (size_t len = 0; len < wire.size(); len += 7) {
    EXPECT_FALSE(QbHistogram::Deserialize(wire.substr(0, len)).ok()) << len;
  }
  Rng rng(5);
  int rejected = 0;
  for (int trial = 0; trial < 500; ++trial) {
    std::string bad = wire;
    bad[rng.Next() % bad.size()] ^= static_cast<char>(1 + rng.Next() % 255);
    rejected += !QbHistogram::Deserialize(bad).ok();  // must not crash either way
  }
  EXPECT_GT(rejected, 400);  // the row-sum and load-sum checks catch most flips

  // A header that claims n x bins = 2^28 counts (1 GiB) with a few KB behind it is refused
  // before anything that size is allocated (found by tests/fuzz/qb_histogram_fuzz.cc).
  std::string claim = wire.substr(0, 4 + 8 + 8 + 4);
  const uint32_t big_n = 1u << 14, big_bins = 1u << 14, top_k = 4;
  for (uint32_t v : {big_n, top_k, big_bins}) claim.append(reinterpret_cast<const char*>(&v), 4);
  claim.append(std::string(4 * big_n + 64, '\0'));
  auto refused = QbHistogram::Deserialize(claim);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("need at least"), std::string::npos)
      << refused.status();

  // A histogram whose routing bias is 2.1e37 (finite) had bins of width 0 and sent
  // PredictLoads into NaN indices (found by the fuzzer): such a bias is refused.
  const std::vector<float> huge = {2.1e37f, 2.1e37f};
  auto no = QbHistogram::Create(QbWindow{1, 0, 1, 1, 2}, huge);
  ASSERT_FALSE(no.ok());
  EXPECT_NE(no.status().message().find("|bias| must be at most"), std::string::npos) << no.status();
  EXPECT_TRUE(QbHistogram::Create(QbWindow{1, 0, 1, 1, 2}, std::vector<float>{-5.0f, 7.0f}).ok());
}

}  // namespace
}  // namespace moe::numerics
