// Known-value tests of the scalar reference ops: SiTU, RMSNorm, the router's top-k and weights,
// the dense projection's fixed summation order, the combine's order, and the expert FFN.
#include <algorithm>
#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "services/common/random.h"
#include "services/common/thread_pool.h"
#include "services/numerics/combine.h"
#include "services/numerics/expert_ffn.h"
#include "services/numerics/linear.h"
#include "services/numerics/rms_norm.h"
#include "services/numerics/router.h"
#include "services/numerics/situ.h"

namespace moe::numerics {
namespace {

using tensor::Bf16;

// fp32 evaluation of SiTU (three transcendental calls, four products) against a double oracle:
// a few fp32 ulps, far below one bf16 ulp (2^-8 relative), which is what the layer keeps.
constexpr double kSituFp32RelTol = 4e-7;

double SituDouble(double g, double u) {
  return (4.0 * std::tanh(g / 4.0) / (1.0 + std::exp(-g))) * (25.0 * std::tanh(u / 25.0));
}

std::vector<Bf16> ToBf16(const std::vector<float>& v) {
  std::vector<Bf16> out;
  for (float f : v) out.push_back(Bf16::FromFloat(f));
  return out;
}

TEST(Situ, KnownPoints) {
  EXPECT_EQ(Situ(0.0f, 5.0f, 4.0f, 25.0f), 0.0f);
  EXPECT_EQ(Situ(3.0f, 0.0f, 4.0f, 25.0f), 0.0f);
  for (auto [g, u] :
       {std::pair{1.0f, 1.0f}, {-1.0f, 2.0f}, {8.0f, -30.0f}, {-20.0f, 50.0f}, {0.5f, 0.25f}}) {
    const double want = SituDouble(g, u);
    EXPECT_NEAR(Situ(g, u, 4.0f, 25.0f), want, std::fabs(want) * kSituFp32RelTol + 1e-30)
        << "g=" << g << " u=" << u;
  }
  // 4 tanh(1/4) sigmoid(1) * 25 tanh(1/25) = 0.71617... * 0.99947... = 0.7158178...
  EXPECT_NEAR(Situ(1.0f, 1.0f, 4.0f, 25.0f), 0.7158178, 1e-6);
  // The gate factor's minimum, 4 tanh(g/4) sigmoid(g) at g near -1.28, is about -0.2698.
  EXPECT_NEAR(Situ(-1.28f, 1e6f, 4.0f, 25.0f), SituDouble(-1.28, 1e6), 1e-5);
}

TEST(Situ, BehavesLikeSwiGluNearTheOrigin) {
  for (float g : {0.01f, -0.02f, 0.03f}) {
    for (float u : {0.01f, -0.05f}) {
      const double swiglu = g / (1.0 + std::exp(-g)) * u;
      EXPECT_NEAR(Situ(g, u, 4.0f, 25.0f) / swiglu, 1.0, 1e-3);
    }
  }
}

TEST(Situ, IsBoundedByOneHundred) {
  // Gate factor in (-0.27, 4), up factor in (-25, 25): |SiTU| < 100 in exact arithmetic; in
  // fp32 the factors saturate at exactly 4 and 25 for huge inputs, so the bound is <= 100
  // (reached as +-100 when g and |u| are huge).
  std::vector<double> gs;
  for (double a = 1e-3; a <= 1e4; a *= 1.1) {
    gs.push_back(a);
    gs.push_back(-a);
  }
  float lo = 0, hi = 0;
  for (double g : gs) {
    for (double u : {-1e6, -300.0, -25.0, -1.0, 1.0, 25.0, 300.0, 1e6}) {
      const float s = Situ(static_cast<float>(g), static_cast<float>(u), 4.0f, 25.0f);
      ASSERT_TRUE(std::isfinite(s));
      ASSERT_LE(std::fabs(s), 100.0f) << g << " " << u;
      lo = std::min(lo, s);
      hi = std::max(hi, s);
    }
  }
  EXPECT_GT(hi, 99.0f);  // the bound is approached from both sides
  EXPECT_LT(lo, -99.0f);
  for (float g : {0.5f, 3.0f, 12.0f}) EXPECT_LT(Situ(g, 40.0f, 4.0f, 25.0f), 100.0f);
}

TEST(RmsNorm, KnownValues) {
  // r = [3, 4]: mean square 12.5, n = r / sqrt(12.5 + 1e-5), gamma = [1, 2].
  const std::vector<Bf16> r = ToBf16({3.0f, 4.0f}), gamma = ToBf16({1.0f, 2.0f});
  std::vector<Bf16> out(2);
  ref::RmsNorm(r.data(), 1, 2, gamma.data(), 1e-5f, out.data());
  const double inv = 1.0 / std::sqrt(12.5 + 1e-5);
  EXPECT_EQ(out[0].bits, Bf16::FromFloat(tensor::RoundBf16(float(3 * inv)) * 1.0f).bits);
  EXPECT_EQ(out[1].bits, Bf16::FromFloat(tensor::RoundBf16(float(4 * inv)) * 2.0f).bits);
  EXPECT_NEAR(out[0].ToFloat(), 0.8485, 0.004);
  EXPECT_NEAR(out[1].ToFloat(), 2.2627, 0.01);
}

TEST(RmsNorm, ZeroRowStaysZeroAndEpsilonKeepsItFinite) {
  const std::vector<Bf16> r(8, Bf16::FromFloat(0.0f)), gamma(8, Bf16::FromFloat(1.0f));
  std::vector<Bf16> out(8);
  ref::RmsNorm(r.data(), 1, 8, gamma.data(), 1e-5f, out.data());
  for (const Bf16& v : out) EXPECT_EQ(v.ToFloat(), 0.0f);
}

TEST(RmsNorm, UnitRmsOnRandomRowsAndMatchesDoubleOracle) {
  Rng rng(3);
  const int64_t tokens = 16, dim = 512;
  std::vector<float> v(tokens * dim);
  for (float& x : v) x = 3.0f * rng.Normal();
  const std::vector<Bf16> r = ToBf16(v);
  const std::vector<Bf16> gamma(dim, Bf16::FromFloat(1.0f));
  std::vector<Bf16> out(tokens * dim);
  ref::RmsNorm(r.data(), tokens, dim, gamma.data(), 1e-5f, out.data());
  for (int64_t t = 0; t < tokens; ++t) {
    double ss = 0, ss_out = 0;
    for (int64_t d = 0; d < dim; ++d)
      ss += double(r[t * dim + d].ToFloat()) * r[t * dim + d].ToFloat();
    const double inv = 1.0 / std::sqrt(ss / dim + 1e-5);
    for (int64_t d = 0; d < dim; ++d) {
      const double want = r[t * dim + d].ToFloat() * inv;
      const double got = out[t * dim + d].ToFloat();
      // One bf16 rounding (half an ulp, 2^-9 relative) plus fp32 noise in inv.
      EXPECT_NEAR(got, want, std::fabs(want) * 0x1p-8) << t << " " << d;
      ss_out += got * got;
    }
    EXPECT_NEAR(std::sqrt(ss_out / dim), 1.0, 0.01);
  }
}

TEST(Router, TopKTiesGoToTheLowerExpertId) {
  // Experts 1, 2 and 3 tie; k = 2 picks 1 and 2, in that order.
  const std::vector<float> scores = {0.1f, 0.7f, 0.7f, 0.7f, 0.2f};
  const Routing r = SelectExperts(scores.data(), nullptr, 1, 5, 2, true, 1.0f);
  EXPECT_EQ(r.expert_ids, (std::vector<int32_t>{1, 2}));
  EXPECT_FLOAT_EQ(r.weights[0], 0.5f);
  EXPECT_FLOAT_EQ(r.weights[1], 0.5f);
}

TEST(Router, BiasSelectsButWeightsComeFromUnbiasedScores) {
  const std::vector<float> scores = {0.9f, 0.6f, 0.3f, 0.2f};
  const std::vector<float> bias = {-1.0f, 0.0f, 0.5f, 0.0f};
  const Routing r = SelectExperts(scores.data(), bias.data(), 1, 4, 2, true, 1.0f);
  // biased: -0.1, 0.6, 0.8, 0.2 -> ranks 2, 1.
  EXPECT_EQ(r.expert_ids, (std::vector<int32_t>{2, 1}));
  EXPECT_FLOAT_EQ(r.weights[0], 0.3f / (0.3f + 0.6f));
  EXPECT_FLOAT_EQ(r.weights[1], 0.6f / (0.3f + 0.6f));
  const Routing raw = SelectExperts(scores.data(), bias.data(), 1, 4, 2, false, 2.0f);
  EXPECT_FLOAT_EQ(raw.weights[0], 0.6f);
  EXPECT_FLOAT_EQ(raw.weights[1], 1.2f);
}

TEST(Router, ScoresAreSigmoidOfFp32Logits) {
  const std::vector<Bf16> x = ToBf16({1.0f, 2.0f}), gate = ToBf16({0.5f, -1.0f, 0.25f, 0.25f});
  std::vector<float> s(2);
  ref::RouterScores(x.data(), 1, 2, gate.data(), 2, s.data());
  EXPECT_FLOAT_EQ(s[0], 1.0f / (1.0f + std::exp(1.5f)));    // logit -1.5
  EXPECT_FLOAT_EQ(s[1], 1.0f / (1.0f + std::exp(-0.75f)));  // logit 0.75
}

TEST(Linear, SumsInAscendingIndexOrderInFp32) {
  // Sequential fp32: (2^24 + 1) rounds to 2^24, minus 2^24 leaves 0. Any other order (pairwise,
  // or starting from the end) gives 1: the value pins the documented order down.
  const std::vector<Bf16> x = ToBf16({16777216.0f, 1.0f, -16777216.0f});
  const std::vector<Bf16> w = ToBf16({1.0f, 1.0f, 1.0f});
  float y;
  ref::LinearF32(x.data(), 1, 3, w.data(), 1, &y);
  EXPECT_EQ(y, 0.0f);
}

TEST(Linear, Bf16ResultIsRoundedFp32Sum) {
  Rng rng(5);
  const int64_t t = 3, in = 64, out = 5;
  std::vector<float> xv(t * in), wv(out * in);
  for (float& v : xv) v = rng.Normal();
  for (float& v : wv) v = rng.Normal() * 0.1f;
  const std::vector<Bf16> x = ToBf16(xv), w = ToBf16(wv);
  std::vector<Bf16> y(t * out);
  ref::LinearBf16(x.data(), t, in, w.data(), out, y.data());
  for (int64_t a = 0; a < t; ++a) {
    for (int64_t j = 0; j < out; ++j) {
      float acc = 0.0f;
      for (int64_t i = 0; i < in; ++i) acc += x[a * in + i].ToFloat() * w[j * in + i].ToFloat();
      EXPECT_EQ(y[a * out + j].bits, Bf16::FromFloat(acc).bits);
    }
  }
}

TEST(Combine, SumsInAscendingExpertIdNotRankOrder) {
  // Rank order 9, 5, 2 would give (-2^24 + 2^24) + 1 = 1; ascending ids 2, 5, 9 give
  // (1 + 2^24) - 2^24 = 0 because 2^24 + 1 rounds to 2^24 in fp32.
  Routing r;
  r.tokens = 1;
  r.top_k = 3;
  r.expert_ids = {9, 5, 2};
  r.weights = {1.0f, 1.0f, 1.0f};
  const std::vector<Bf16> y = ToBf16({-16777216.0f, 16777216.0f, 1.0f});
  Bf16 out;
  ref::Combine(r, y.data(), 1, &out);
  EXPECT_EQ(out.ToFloat(), 0.0f);
  // And CombineRows, which the layer and the attention node run, from the rows where they lie.
  const Bf16* rows[3] = {&y[0], &y[1], &y[2]};
  Bf16 from_rows;
  CombineRows(r, rows, 1, &from_rows, nullptr);
  EXPECT_EQ(from_rows.ToFloat(), 0.0f);
}

TEST(Combine, WeightsScaleEachExpertOutput) {
  Routing r;
  r.tokens = 2;
  r.top_k = 2;
  r.expert_ids = {0, 1, 1, 0};
  r.weights = {0.25f, 0.75f, 0.5f, 0.5f};
  const std::vector<Bf16> y = ToBf16({4.0f, 8.0f, -2.0f, 2.0f, 1.0f, 3.0f, 5.0f, 7.0f});
  std::vector<Bf16> out(4);
  ref::Combine(r, y.data(), 2, out.data());
  EXPECT_EQ(out[0].ToFloat(), 4.0f * 0.25f - 2.0f * 0.75f);
  EXPECT_EQ(out[1].ToFloat(), 8.0f * 0.25f + 2.0f * 0.75f);
  EXPECT_EQ(out[2].ToFloat(), 0.5f * 1.0f + 0.5f * 5.0f);
  EXPECT_EQ(out[3].ToFloat(), 0.5f * 3.0f + 0.5f * 7.0f);
}

// CombineRows (what the layer and the attention node run) against the reference: rows read where
// they lie (here a buffer in another order than [T, k, D]), tokens split over a pool or not,
// dropped slots (id -1) never read, a row no one sent counted as zeros; every output bit equal.
TEST(Combine, RowsWhereTheyLieOnAPoolMatchTheReferenceBitForBit) {
  ThreadPool pool(3);
  Rng rng(11);
  struct Shape {
    int64_t tokens, k, latent;
  };
  for (const Shape& sh : {Shape{1, 1, 1}, Shape{3, 8, 17}, Shape{37, 8, 512}, Shape{300, 16, 515},
                          Shape{64, 2, 4096}}) {
    const int64_t pairs = sh.tokens * sh.k;
    Routing r;
    r.tokens = sh.tokens;
    r.top_k = sh.k;
    for (int64_t t = 0; t < sh.tokens; ++t) {
      std::vector<int32_t> ids(static_cast<size_t>(sh.k));
      for (int64_t j = 0; j < sh.k; ++j) ids[j] = static_cast<int32_t>(j * 7 + (t % 5));
      for (int64_t j = sh.k - 1; j > 0; --j) std::swap(ids[j], ids[rng.Next() % (j + 1)]);
      if (sh.k > 1 && rng.Uniform() < 0.3) ids[rng.Next() % sh.k] = -1;  // dropped by a budget
      for (int32_t id : ids) {
        r.expert_ids.push_back(id);
        r.weights.push_back(static_cast<float>(rng.Uniform()));
      }
    }
    // Values over 2^-10 .. 2^12 so that the order of the sums shows in the last bits.
    std::vector<Bf16> y(static_cast<size_t>(pairs * sh.latent));
    for (Bf16& v : y)
      v = Bf16::FromFloat(std::ldexp(rng.Normal(), static_cast<int>(rng.Next() % 23) - 10));
    // The same rows stored in reverse pair order, and one row (a live slot) that no one sent.
    std::vector<Bf16> lying(y.size());
    std::vector<const Bf16*> rows(static_cast<size_t>(pairs));
    for (int64_t p = 0; p < pairs; ++p) {
      Bf16* dst = lying.data() + (pairs - 1 - p) * sh.latent;
      std::copy_n(y.data() + p * sh.latent, sh.latent, dst);
      rows[p] = dst;
    }
    const int64_t unsent = pairs / 2;
    if (r.expert_ids[unsent] >= 0) {
      rows[unsent] = nullptr;
      std::fill_n(y.begin() + unsent * sh.latent, sh.latent, Bf16::FromFloat(0.0f));
    }
    std::vector<Bf16> want(static_cast<size_t>(sh.tokens * sh.latent));
    ref::Combine(r, y.data(), sh.latent, want.data());
    for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
      std::vector<Bf16> got(want.size(), Bf16::FromFloat(-1.0f));
      CombineRows(r, rows.data(), sh.latent, got.data(), p);
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(got[i].bits, want[i].bits)
            << "T " << sh.tokens << " k " << sh.k << " D " << sh.latent << " at " << i
            << (p ? " on the pool" : "");
      }
    }
  }
}

// The expert FFN against a straightforward re-implementation: dequantize whole matrices first,
// then plain loops with the rounding points of docs/math.md section 4 step 3.
TEST(ExpertFfn, MatchesDequantizedOracleBitExactly) {
  const int64_t d = 64, inter = 96, tokens = 5;
  Rng rng(9);
  auto make = [&](int64_t rows, int64_t cols, std::vector<uint8_t>* packed,
                  std::vector<uint8_t>* scales, std::vector<float>* dense) {
    std::vector<float> v(rows * cols);
    for (float& x : v) x = rng.Normal() / std::sqrt(float(cols));
    packed->resize(rows * cols / 2);
    scales->resize(rows * cols / 32);
    for (int64_t r = 0; r < rows; ++r) {
      QuantizeMxfp4Row(v.data() + r * cols, cols, packed->data() + r * cols / 2,
                       scales->data() + r * cols / 32);
    }
    dense->resize(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      DequantizeMxfp4Row(packed->data() + r * cols / 2, scales->data() + r * cols / 32, cols,
                         dense->data() + r * cols);
    }
    return Mxfp4Matrix{rows, cols, packed->data(), scales->data()};
  };
  std::vector<uint8_t> p1, s1, p3, s3, p2, s2;
  std::vector<float> w1, w3, w2;
  ExpertWeights w{make(inter, d, &p1, &s1, &w1), make(inter, d, &p3, &s3, &w3),
                  make(d, inter, &p2, &s2, &w2)};
  std::vector<float> zv(tokens * d);
  for (float& v : zv) v = rng.Normal();
  const std::vector<Bf16> z = ToBf16(zv);
  std::vector<Bf16> y(tokens * d);
  ref::ExpertFfn(w, z.data(), tokens, 4.0f, 25.0f, y.data());
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<float> h(inter);
    for (int64_t i = 0; i < inter; ++i) {
      float g = 0, u = 0;
      for (int64_t k = 0; k < d; ++k) {
        g += z[t * d + k].ToFloat() * w1[i * d + k];
        u += z[t * d + k].ToFloat() * w3[i * d + k];
      }
      h[i] = tensor::RoundBf16(Situ(tensor::RoundBf16(g), tensor::RoundBf16(u), 4.0f, 25.0f));
    }
    for (int64_t o = 0; o < d; ++o) {
      float acc = 0;
      for (int64_t i = 0; i < inter; ++i) acc += h[i] * w2[o * inter + i];
      ASSERT_EQ(y[t * d + o].bits, Bf16::FromFloat(acc).bits) << "token " << t << " out " << o;
    }
  }
}

}  // namespace
}  // namespace moe::numerics
