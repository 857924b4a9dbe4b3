// Backend consistency: every optimized CPU op against its scalar reference, on every ISA this
// machine supports (scalar, AVX2, AVX-512), with named tolerances.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <ostream>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "services/checkpoint/synthetic.h"
#include "services/common/random.h"
#include "services/numerics/cpu/expert_ffn.h"
#include "services/numerics/cpu/kernel_choice.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/numerics/cpu/packed_linear.h"
#include "services/numerics/dynamic_k.h"
#include "services/numerics/expert_ffn.h"
#include "services/numerics/linear.h"
#include "services/numerics/moe_layer.h"
#include "services/numerics/precision_mode.h"
#include "services/numerics/router.h"
#include "services/numerics/shared_expert.h"
#include "services/numerics/situ.h"
#include "services/numerics/tolerance.h"

namespace moe::numerics::cpu {

// ctest names a parameterized test by the parameter's printed form (found next to Isa): the
// ISA's name, not a dump of its bytes.
void PrintTo(Isa isa, std::ostream* os) { *os << IsaName(isa); }

namespace {

using tensor::Bf16;

// The named tolerances (kMxfp4SumRelBound, kSituTolerance, kExpertFfnTolerance,
// kLayerTolerance) and the comparison (UlpStats) are services/numerics/tolerance.h, shared with
// expert-svc's production check.

// Every ISA the kernels have; those this CPU lacks are instantiated too and skip by name.
std::vector<Isa> AllIsas() {
  return {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAvx512Amx};
}
bool CpuHas(Isa isa) { return static_cast<int>(isa) <= static_cast<int>(DetectIsa()); }

class Consistency : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!CpuHas(GetParam())) {
      GTEST_SKIP() << IsaName(GetParam()) << ": not on this CPU (" << IsaName(DetectIsa())
                   << " is the best it has); these kernels were not run";
    }
  }
  const KernelTable& k() const { return KernelsFor(GetParam()); }
};

std::vector<Bf16> RandomBf16(int64_t n, float scale, uint64_t seed) {
  Rng rng(seed);
  std::vector<Bf16> v(static_cast<size_t>(n));
  for (Bf16& b : v) b = Bf16::FromFloat(scale * rng.Normal());
  return v;
}

TEST_P(Consistency, PackedLinearIsBitExact) {
  ThreadPool pool(2);
  for (auto [tokens, in, out] :
       std::vector<std::tuple<int64_t, int64_t, int64_t>>{{1, 64, 16},
                                                          {2, 96, 128},
                                                          {3, 200, 200},
                                                          {5, 128, 384},
                                                          {13, 64, 130},
                                                          {30, 100, 256},
                                                          // many tokens: the packed-panel path,
                                                          // reduction not a multiple of a block
                                                          {100, 600, 256},
                                                          {37, 257, 130}}) {
    const std::vector<Bf16> x = RandomBf16(tokens * in, 1.0f, tokens + in);
    const std::vector<Bf16> w = RandomBf16(out * in, 0.1f, out);
    std::vector<float> want(static_cast<size_t>(tokens * out));
    ref::LinearF32(x.data(), tokens, in, w.data(), out, want.data());
    const PackedLinear p = PackedLinear::Pack(w.data(), out, in);
    std::vector<float> xf(x.size());
    for (size_t i = 0; i < x.size(); ++i) xf[i] = x[i].ToFloat();
    std::vector<float> got(static_cast<size_t>(tokens * p.padded_out()));
    p.Apply(k(), &pool, xf.data(), tokens, got.data());
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t o = 0; o < out; ++o) {
        ASSERT_EQ(got[t * p.padded_out() + o], want[t * out + o])
            << tokens << "x" << in << "x" << out << " at " << t << "," << o;
      }
    }
  }
}

// A random MXFP4 matrix [rows, cols] (weights ~ N(0, 0.05^2)), quantized by the reference.
struct RandomMxfp4 {
  RandomMxfp4(int64_t rows, int64_t cols, Rng& rng)
      : cols(cols), packed(rows * cols / 2), scales(rows * cols / 32) {
    std::vector<float> wv(rows * cols);
    for (float& v : wv) v = rng.Normal() * 0.05f;
    for (int64_t r = 0; r < rows; ++r) {
      QuantizeMxfp4Row(wv.data() + r * cols, cols, packed.data() + r * cols / 2,
                       scales.data() + r * cols / 32);
    }
  }
  // Asserts out[t * ld_out + (r - r0)] equals row r . x[t] (x: [tokens, cols]) within the fp32
  // summation bound of any order, for rows [r0, r1).
  void ExpectRows(int64_t r0, int64_t r1, const std::vector<float>& x, int64_t tokens,
                  const std::vector<float>& out, int64_t ld_out) const {
    std::vector<float> row(cols);
    for (int64_t r = r0; r < r1; ++r) {
      DequantizeMxfp4Row(packed.data() + r * cols / 2, scales.data() + r * cols / 32, cols,
                         row.data());
      for (int64_t t = 0; t < tokens; ++t) {
        double exact = 0, abs_sum = 0;
        for (int64_t i = 0; i < cols; ++i) {
          exact += double(row[i]) * x[t * cols + i];
          abs_sum += std::fabs(double(row[i]) * x[t * cols + i]);
        }
        ASSERT_NEAR(out[t * ld_out + (r - r0)], exact, cols * kMxfp4SumRelBound * abs_sum)
            << "cols " << cols << " row " << r << " token " << t;
      }
    }
  }
  int64_t cols;
  std::vector<uint8_t> packed, scales;
};

std::vector<float> RandomBf16Values(int64_t n, Rng& rng) {
  std::vector<float> x(n);
  for (float& v : x) v = tensor::RoundBf16(rng.Normal());
  return x;
}

TEST_P(Consistency, Mxfp4RowsWithinTheSummationBound) {
  Rng rng(7);
  // 1056 and 2080 columns reach the column blocks of the AVX2 decode (activations of a block
  // <= 16 KB), with a 32-column tail chunk.
  for (int64_t cols : {32, 64, 96, 128, 448, 512, 1056, 2080}) {
    const int64_t rows = 37, tokens = 11;
    const RandomMxfp4 w(rows, cols, rng);
    const std::vector<float> x = RandomBf16Values(tokens * cols, rng);
    std::vector<float> xp(tokens * ActivationSlots(k(), cols));
    PrepareActivations(k(), x.data(), tokens, cols, xp.data());
    for (int64_t t_count : {int64_t{1}, int64_t{2}, int64_t{5}, tokens}) {
      const int64_t r0 = 3, r1 = rows;
      std::vector<float> out(t_count * (r1 - r0), -1.0f);
      k().mxfp4_rows(w.packed.data(), w.scales.data(), cols, r0, r1, xp.data(),
                     ActivationSlots(k(), cols), t_count, out.data(), r1 - r0);
      w.ExpectRows(r0, r1, x, t_count, out, r1 - r0);
    }
  }
}

TEST_P(Consistency, SituWithinOneUlp) {
  Rng rng(8);
  const int64_t n = 200003;  // not a multiple of the vector width
  std::vector<float> g(n), u(n), h(n);
  for (int64_t i = 0; i < n; ++i) {
    const float scale = i % 3 == 0 ? 0.05f : (i % 3 == 1 ? 2.0f : 30.0f);
    g[i] = scale * rng.Normal();
    u[i] = scale * rng.Normal();
  }
  k().situ(g.data(), u.data(), n, 4.0f, 25.0f, h.data());
  std::vector<Bf16> got(n), want(n);
  for (int64_t i = 0; i < n; ++i) {
    got[i] = Bf16::FromFloat(h[i]);
    want[i] = Bf16::FromFloat(Situ(tensor::RoundBf16(g[i]), tensor::RoundBf16(u[i]), 4.0f, 25.0f));
  }
  UlpStats stats;
  stats.AddRows(got.data(), want.data(), 1, n);
  std::printf("[ %s ] situ: %s\n", IsaName(GetParam()), stats.Str().c_str());
  EXPECT_LE(stats.max_ulp, kSituTolerance.max_ulp) << stats.Str();
  EXPECT_LE(double(stats.differing) / n, kSituTolerance.differing_fraction) << stats.Str();
  EXPECT_TRUE(stats.Within(kSituTolerance)) << stats.Str();
  // situ_f32 (W4A8's h before MXFP8): the same values before the bf16 rounding, within a few
  // fp32 ulp of the reference's fp32 SiTU (relative 2^-20), and rounding them gives situ's bits.
  std::vector<float> hf(n);
  k().situ_f32(g.data(), u.data(), n, 4.0f, 25.0f, hf.data());
  double worst = 0;
  int64_t unrounded = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float want_f = Situ(tensor::RoundBf16(g[i]), tensor::RoundBf16(u[i]), 4.0f, 25.0f);
    const double scale = std::max(std::fabs(static_cast<double>(want_f)), 1e-30);
    worst = std::max(worst, std::fabs(static_cast<double>(hf[i]) - want_f) / scale);
    unrounded += tensor::RoundBf16(hf[i]) != hf[i];
    ASSERT_EQ(tensor::RoundBf16(hf[i]), h[i]) << i;
  }
  std::printf("[ %s ] situ_f32: max relative difference %.3g, %lld of %lld not bf16 values\n",
              IsaName(GetParam()), worst, static_cast<long long>(unrounded),
              static_cast<long long>(n));
  EXPECT_LE(worst, 0x1p-20);
  EXPECT_GT(unrounded, n / 2);  // fp32 indeed, not bf16
}

TEST_P(Consistency, ExpertFfnMatchesReference) {
  const ModelConfig cfg = *PresetConfig("mid");
  checkpoint::SyntheticOptions opt;
  const MoeLayerWeights w = checkpoint::SyntheticLayer(cfg, 1, opt);
  // 12 tokens run the decode kernels, 40 the prefill (panel) kernel where the ISA has one.
  for (int64_t tokens : {int64_t{12}, int64_t{40}}) {
    const std::vector<Bf16> z = RandomBf16(tokens * cfg.latent, 1.0f, 3);
    UlpStats stats;
    for (int64_t e : {0, 17, 99}) {
      std::vector<Bf16> want(tokens * cfg.latent), got(want.size());
      ref::ExpertFfn(*w.Expert(e), z.data(), tokens, 4.0f, 25.0f, want.data());
      ExpertFfn(k(), *w.Expert(e), z.data(), tokens, 4.0f, 25.0f, got.data());
      stats.AddRows(got.data(), want.data(), tokens, cfg.latent);
    }
    std::printf("[ %s ] expert ffn, %lld tokens: %s\n", IsaName(GetParam()),
                static_cast<long long>(tokens), stats.Str().c_str());
    EXPECT_LE(stats.max_row_ulps, kExpertFfnTolerance.max_row_ulps) << stats.Str();
    EXPECT_LE(double(stats.over1) / stats.total, kExpertFfnTolerance.over1_fraction) << stats.Str();
    EXPECT_LE(double(stats.differing) / stats.total, kExpertFfnTolerance.differing_fraction)
        << stats.Str();
    EXPECT_TRUE(stats.Within(kExpertFfnTolerance)) << stats.Str();
  }
}

// W4A8's h rounding per ISA against numerics::RoundTripMxfp8Rows, bit for bit (+-0 apart), over
// blocks at every binade of the scale (2^-149 .. 2^120), exact rounding midpoints, values at the
// subnormal edge 2^-6 of E4M3, all-zero and signed-zero blocks, and a block whose amax sits just
// above and at 448 x 2^k. A change of the tie rule or of the scale rule in either fails it.
TEST_P(Consistency, Mxfp8RoundTripIsBitExact) {
  Rng rng(11);
  std::vector<float> v;
  for (int b = -149; b <= 120; ++b) {  // one block per binade of the largest value
    for (int i = 0; i < 32; ++i) {
      v.push_back(std::ldexp(static_cast<float>(rng.Normal()), b - (i % 7)));
    }
  }
  for (int k : {-20, 0, 3}) {  // midpoints between E4M3 neighbours, and the 2^-6 edge
    for (int i = 0; i < 32; ++i) {
      const float mid = 1.0f + (2 * (i % 8) + 1) / 16.0f;  // (1 + (m + 1/2)/8)
      v.push_back(std::ldexp(i < 16 ? mid : (i % 9) / 8.0f + 1.0f / 16, k - (i % 5)));
    }
  }
  for (int i = 0; i < 32; ++i) v.push_back(i % 3 == 0 ? -0.0f : 0.0f);
  for (float top : {448.0f, std::nextafter(448.0f, 1e9f), 449.0f}) {
    for (int i = 0; i < 32; ++i) v.push_back(i == 5 ? top : std::ldexp(1.0f + i / 32.0f, -i % 9));
  }
  std::vector<float> want = v, got = v;
  RoundTripMxfp8Rows(want.data(), 1, static_cast<int64_t>(want.size()));
  k().mxfp8_roundtrip(got.data(), static_cast<int64_t>(got.size()));
  int64_t differ = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    uint32_t a, b;
    std::memcpy(&a, &got[i], 4);
    std::memcpy(&b, &want[i], 4);
    if (a != b) {
      if (++differ <= 5)
        ADD_FAILURE() << i << ": " << v[i] << " -> " << got[i] << " vs " << want[i];
    }
  }
  EXPECT_EQ(differ, 0) << " of " << v.size();
}

// W4A8: each ISA's kernels on MXFP8 activations (z decoded from codes, h quantized after
// SiTU) against ref::ExpertFfn in kW4A8. A one-ulp difference in a bf16 h can move its MXFP8
// code, so the bound is kExpertFfnW4A8Tolerance, not the W4A16 one.
// Both orders of h (from fp32, the default; via bf16, --w4a8_h_via_bf16), each against the
// reference in the same order; the two orders are different computations.
TEST_P(Consistency, ExpertFfnW4A8MatchesReference) {
  const ModelConfig cfg = *PresetConfig("mid");
  checkpoint::SyntheticOptions opt;
  const MoeLayerWeights w = checkpoint::SyntheticLayer(cfg, 1, opt);
  for (W4A8H order : {W4A8H::kFromFp32, W4A8H::kViaBf16}) {
    const char* name = order == W4A8H::kFromFp32 ? "h from fp32" : "h via bf16";
    for (int64_t tokens : {int64_t{12}, int64_t{40}}) {
      const std::vector<Bf16> z = RandomBf16(tokens * cfg.latent, 1.0f, 5);
      UlpStats stats, w4a16, other;
      for (int64_t e : {0, 17, 99}) {
        std::vector<Bf16> want(tokens * cfg.latent), got(want.size()), a16(want.size());
        std::vector<Bf16> flip(want.size());
        const W4A8H flipped = order == W4A8H::kFromFp32 ? W4A8H::kViaBf16 : W4A8H::kFromFp32;
        ref::ExpertFfn(*w.Expert(e), z.data(), tokens, 4.0f, 25.0f, want.data(), Precision::kW4A8,
                       order);
        ExpertFfn(k(), *w.Expert(e), z.data(), tokens, 4.0f, 25.0f, got.data(), Precision::kW4A8,
                  order);
        ref::ExpertFfn(*w.Expert(e), z.data(), tokens, 4.0f, 25.0f, a16.data());
        ref::ExpertFfn(*w.Expert(e), z.data(), tokens, 4.0f, 25.0f, flip.data(), Precision::kW4A8,
                       flipped);
        stats.AddRows(got.data(), want.data(), tokens, cfg.latent);
        w4a16.AddRows(a16.data(), want.data(), tokens, cfg.latent);
        other.AddRows(flip.data(), want.data(), tokens, cfg.latent);
      }
      std::printf(
          "[ %s ] expert ffn w4a8 (%s), %lld tokens: %s (w4a16 vs w4a8: %s; the other h "
          "order: %s)\n",
          IsaName(GetParam()), name, static_cast<long long>(tokens), stats.Str().c_str(),
          w4a16.Str().c_str(), other.Str().c_str());
      EXPECT_TRUE(stats.Within(kExpertFfnW4A8Tolerance)) << name << " " << stats.Str();
      // The mode is not a no-op: W4A16 is far outside the W4A8 bound.
      EXPECT_FALSE(w4a16.Within(kExpertFfnW4A8Tolerance)) << w4a16.Str();
      // Nor is the order of h: a share of the outputs differ.
      EXPECT_GT(other.differing, other.total / 20) << other.Str();
    }
  }
}

// budget < k: dynamic k with thresholds solved exactly from another batch of the same layer
// (dynamic_k.h); 0: every token keeps k.
void CheckLayerOn(const KernelTable& kernels, const std::string& label, const char* preset,
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

// The set's own table: its panel kernel from kPrefillTokens tokens per expert.
void CheckLayer(Isa isa, const char* preset, int64_t tokens, uint64_t seed,
                Precision precision = Precision::kW4A16, int64_t budget = 0) {
  CheckLayerOn(KernelsFor(isa), IsaName(isa), preset, tokens, seed, precision, budget);
}

TEST_P(Consistency, TinyLayerMatchesReference) {
  CheckLayer(GetParam(), "tiny", 64, 1);
  CheckLayer(GetParam(), "tiny", 200, 2);
}
TEST_P(Consistency, MidLayerMatchesReference) {
  CheckLayer(GetParam(), "mid", 64, 1);
  CheckLayer(GetParam(), "mid", 96, 2);
}

// W4A8 through the whole layer: the same routing and the layer bound (MXFP8 of z and h on
// every ISA's kernels, against the reference's W4A8).
TEST_P(Consistency, LayerW4A8MatchesReference) {
  CheckLayer(GetParam(), "mid", 64, 1, Precision::kW4A8);
  CheckLayer(GetParam(), "tiny", 200, 2, Precision::kW4A8);
}

// Dynamic k (docs/math.md section 4.1): the same selection and the layer bound under budgets.
TEST_P(Consistency, BudgetedLayerMatchesReference) {
  CheckLayer(GetParam(), "tiny", 200, 3, Precision::kW4A16, 2);
  CheckLayer(GetParam(), "mid", 96, 3, Precision::kW4A16, 3);
  CheckLayer(GetParam(), "mid", 64, 4, Precision::kW4A8, 6);
}

TEST_P(Consistency, ResultsDoNotDependOnTheThreadCount) {
  const ModelConfig cfg = *PresetConfig("mid");
  checkpoint::SyntheticOptions opt;
  opt.router_skew = 1.0;  // hot experts: some get kPrefillTokens or more, most only a few
  // 19 tokens: every expert on the decode kernels; 160: the hot ones on the prefill kernel.
  for (int64_t tokens : {int64_t{19}, int64_t{160}}) {
    const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, tokens, 6);
    std::vector<Bf16> first;
    for (int threads : {1, 2, 3}) {
      CpuLayerOptions o;
      o.kernels = &KernelsFor(GetParam());
      o.threads = threads;
      auto layer = CpuMoeLayer::Create(cfg, checkpoint::SyntheticLayer(cfg, 1, opt), o);
      ASSERT_TRUE(layer.ok());
      auto y = (*layer)->Forward(x, tokens, cfg.hidden);
      ASSERT_TRUE(y.ok());
      if (first.empty()) {
        // The batch reaches the paths it is meant to.
        int64_t most = 0;
        for (const auto& pairs : PairsByExpert(y->routing, cfg.num_experts)) {
          most = std::max<int64_t>(most, static_cast<int64_t>(pairs.size()));
        }
        if (tokens > 100) {
          EXPECT_GE(most, kPrefillTokens);
        } else {
          EXPECT_LT(most, kPrefillTokens);
        }
        first = y->out;
        continue;
      }
      for (size_t i = 0; i < first.size(); ++i) {
        ASSERT_EQ(first[i].bits, y->out[i].bits)
            << threads << " threads, " << tokens << " tokens, element " << i;
      }
    }
  }
}

TEST_P(Consistency, BadInputIsRejected) {
  const ModelConfig cfg = *PresetConfig("tiny");
  auto layer = CpuMoeLayer::Create(cfg, checkpoint::SyntheticLayer(cfg, 1, {}), {});
  ASSERT_TRUE(layer.ok());
  std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, 2, 1);
  EXPECT_EQ((*layer)->Forward(x, 0, cfg.hidden).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*layer)->Forward(x, 2, 96).status().code(), absl::StatusCode::kInvalidArgument);
  x[5] = Bf16::FromFloat(std::nanf(""));
  EXPECT_EQ((*layer)->Forward(x, 2, cfg.hidden).status().code(),
            absl::StatusCode::kInvalidArgument);
  MoeLayerWeights partial = checkpoint::SyntheticLayer(cfg, 1, {});
  partial.expert_hi = 4;
  partial.experts.resize(4);
  EXPECT_FALSE(CpuMoeLayer::Create(cfg, std::move(partial), {}).ok());
}

// The prefill kernel (token-major activations: fp32 panels, bf16 pair panels on AVX512-BF16, or
// bf16 tiles on AMX) where the ISA has one, on row and column counts that are no multiple of a
// tile (29 rows from row 5; 37 tokens; 1216 columns: more than one block of each panel, the last
// one partial). A plain test over the ISAs that have one (no skipped instances in the ctest
// summary).
//
// 411 tokens (ld_t 432) run the kernels' token passes (192 at a time: two whole, one partial);
// the tokens past 411 rounded up to 16 hold NaN, which no kernel may read.
void CheckPanelRows(const KernelTable& k) {
  Rng rng(17);
  for (int64_t cols : {64, 448, 640, 1216, -448, 1088}) {
    // -448: 448 columns with block scales far from trained ones (2^-97): the pair panels' fp32
    // path.
    const bool tiny_scales = cols < 0;
    cols = tiny_scales ? -cols : cols;
    const bool many = cols == 1088;
    const int64_t rows = 29, tokens = many ? 411 : 37, ld_t = many ? 432 : 48,
                  slots = TokenMajorSlots(k, cols);
    RandomMxfp4 w(rows, cols, rng);
    if (tiny_scales) {
      for (uint8_t& s : w.scales) s = 30;
    }
    const std::vector<float> x = RandomBf16Values(tokens * cols, rng);
    std::vector<float> xt(slots * ld_t, 0.0f);  // token-major, in the table's slot order
    for (int64_t slot = 0; slot < slots; ++slot) {
      for (int64_t t = (tokens + 15) / 16 * 16; t < ld_t; ++t) xt[slot * ld_t + t] = std::nanf("");
    }
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t i = 0; i < cols; ++i) StoreTokenMajor(k, xt.data(), ld_t, i, t, x[t * cols + i]);
    }
    const int64_t r0 = 5, r1 = rows;
    std::vector<float> out(tokens * (r1 - r0), -1.0f);
    k.mxfp4_rows_tm(w.packed.data(), w.scales.data(), cols, r0, r1, xt.data(), ld_t, tokens,
                    out.data(), r1 - r0);
    w.ExpectRows(r0, r1, x, tokens, out, r1 - r0);
  }
}

TEST(PrefillKernel, Mxfp4PanelRowsWithinTheSummationBound) {
  int tested = 0;
  for (Isa isa : AllIsas()) {
    if (!CpuHas(isa)) {
      std::printf("[ %s ] not on this CPU: its prefill kernel was not run\n", IsaName(isa));
      continue;
    }
    const KernelTable& k = KernelsFor(isa);
    if (k.mxfp4_rows_tm == nullptr) continue;
    SCOPED_TRACE(IsaName(isa));
    CheckPanelRows(k);
    ++tested;
  }
  if (tested == 0) GTEST_SKIP() << "no ISA with a prefill kernel on this CPU";
}

// What a measured choice runs (kernel_choice.h): one set's row kernels with another set's panel
// kernel, switching at any token count. Every pair of two sets this CPU has (one set's own
// pairing is the Consistency suite's), through the whole layer, within the layer tolerance, on
// both paths (the switch at 4 tokens puts the hot experts of 96 tokens on the panel kernel and
// the cold ones on the rows).
TEST(ComposedKernels, EveryPairOfSetsMatchesReference) {
  int tested = 0;
  // Distinct kernels only (AVX512-BF16 and AMX share their row kernels).
  std::set<std::pair<const void*, const void*>> seen;
  for (Isa isa : kSimdIsas) {  // each set's own table: the Consistency suite's
    seen.insert({reinterpret_cast<const void*>(KernelsFor(isa).mxfp4_rows),
                 reinterpret_cast<const void*>(KernelsFor(isa).mxfp4_rows_tm)});
  }
  for (Isa decode : kSimdIsas) {
    for (Isa prefill : kSimdIsas) {
      if (!CpuHas(decode) || !CpuHas(prefill)) continue;
      const auto rows = reinterpret_cast<const void*>(KernelsFor(decode).mxfp4_rows);
      const auto panel = reinterpret_cast<const void*>(KernelsFor(prefill).mxfp4_rows_tm);
      if (!seen.insert({rows, panel}).second) continue;  // these kernels already ran
      const KernelTable k = ComposeKernels(decode, prefill, 4);
      ASSERT_EQ(k.mxfp4_rows, KernelsFor(decode).mxfp4_rows);
      ASSERT_EQ(k.mxfp4_rows_tm, KernelsFor(prefill).mxfp4_rows_tm);
      ASSERT_EQ(k.panel_from, 4);
      const std::string label = KernelsName(k);
      CheckLayerOn(k, label, "mid", 96, 5);
      CheckLayerOn(k, label, "mid", 64, 6, Precision::kW4A8);
      ++tested;
    }
  }
  if (tested == 0) {
    GTEST_SKIP() << "fewer than two SIMD kernel sets on this CPU (" << IsaName(DetectIsa()) << ")";
  }
  std::printf("%d pairs of kernel sets run\n", tested);
}

// A table whose switch is never reached runs the rows at every size, and agrees too.
TEST(ComposedKernels, NoPanelRunsRowsEverywhere) {
  const Isa best = DetectIsa();
  if (best == Isa::kScalar) GTEST_SKIP() << "scalar only: no panel kernel to leave out";
  const KernelTable k = ComposeKernels(best, best, kNoPanel);
  EXPECT_EQ(KernelsName(k), IsaName(best));
  CheckLayerOn(k, std::string(IsaName(best)) + " rows only", "mid", 160, 7);
}

INSTANTIATE_TEST_SUITE_P(Isas, Consistency, ::testing::ValuesIn(AllIsas()),
                         [](const auto& info) { return std::string(IsaName(info.param)); });

}  // namespace
}  // namespace moe::numerics::cpu
