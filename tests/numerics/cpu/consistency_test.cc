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
#include "tests/numerics/cpu/kernel_operands.h"
#include "tests/numerics/cpu/layer_check.h"

namespace moe::numerics::cpu {

// ctest names a parameterized test by the parameter's printed form (found next to Isa): the
// ISA's name, not a dump of its bytes.
void PrintTo(Isa isa, std::ostream* os) { *os << IsaName(isa); }

namespace {

using tensor::Bf16;
using testing::AllIsas;
using testing::CheckLayerOn;
using testing::CpuHas;
using testing::RandomBf16;
using testing::RandomBf16Values;
using testing::RandomMxfp4;

// The named tolerances (kMxfp4SumRelBound, kSituTolerance, kExpertFfnTolerance,
// kLayerTolerance) and the comparison (UlpStats) are services/numerics/tolerance.h, shared with
// expert-svc's production check.

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

TEST_P(Consistency, Mxfp4RowsWithinTheSummationBound) {
  Rng rng(7);
  // 1056 and 2080 columns reach the column blocks of the AVX2 decode (activations of a block
  // <= 16 KB), with a 32-column tail chunk; 448, 1056 and 2080 end inside the BF16 decode's
  // groups of 4 chunks that share one read of the block scales.
  for (int64_t cols : {32, 64, 96, 128, 448, 512, 1056, 2080}) {
    const int64_t rows = 37, tokens = 11;
    const RandomMxfp4 w(rows, cols, rng);
    const std::vector<float> x = RandomBf16Values(tokens * cols, rng);
    std::vector<float> xp(tokens * ActivationSlots(k(), cols));
    PrepareActivations(k(), x.data(), tokens, cols, xp.data());
    // 34 and 35 rows: the BF16 decode's groups of 6 rows, then pairs, then a single row.
    for (int64_t t_count : {int64_t{1}, int64_t{2}, int64_t{5}, tokens}) {
      for (int64_t r0 : {2, 3}) {
        const int64_t r1 = rows;
        std::vector<float> out(t_count * (r1 - r0), -1.0f);
        k().mxfp4_rows(w.packed.data(), w.scales.data(), cols, r0, r1, xp.data(),
                       ActivationSlots(k(), cols), t_count, out.data(), r1 - r0);
        w.ExpectRows(r0, r1, x, t_count, out, r1 - r0);
      }
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

// An expert's prefill runs in blocks of 512 tokens (expert_ffn.cc, kTokenBlock), several experts'
// blocks in one set of work items. Oracle: each expert's tokens in slices of at most 100 (one
// block each, cut where the blocks are not), through ExpertFfn: every token's sums run in the same
// order whatever its batch, so the two agree bit for bit. 1,100 tokens (blocks of 512, 512 and 76,
// a partial tile of 16), 513 (a last block of one token), 547 and 40, on 3 threads; W4A16 and
// W4A8.
TEST_P(Consistency, TokenBlocksAreInvisible) {
  const ModelConfig cfg = *PresetConfig("mid");
  const MoeLayerWeights w = checkpoint::SyntheticLayer(cfg, 1, checkpoint::SyntheticOptions{});
  constexpr int64_t kTokens = 1100;
  Routing routing;
  routing.tokens = kTokens;
  routing.top_k = 2;
  for (int64_t t = 0; t < kTokens; ++t) {
    const int32_t second = t < 513 ? 1 : t < kTokens - 40 ? 2 : 3;
    routing.expert_ids.insert(routing.expert_ids.end(), {0, second});
    routing.weights.insert(routing.weights.end(), {0.5f, 0.5f});
  }
  const std::vector<Bf16> z = RandomBf16(kTokens * cfg.latent, 1.0f, 21);
  ThreadPool pool(3);
  const std::vector<std::vector<int64_t>> pairs = PairsByExpert(routing, cfg.num_experts);
  for (Precision precision : {Precision::kW4A16, Precision::kW4A8}) {
    const std::vector<Bf16> y = RunExperts(k(), &pool, cfg, w, routing, z.data(), precision);
    int64_t checked = 0;
    for (int32_t e = 0; e < 4; ++e) {
      const int64_t n = static_cast<int64_t>(pairs[e].size());
      ASSERT_EQ(n, (std::vector<int64_t>{kTokens, 513, kTokens - 553, 40})[e]);
      const int64_t slices = (n + 99) / 100;  // nearly equal, each >= 32 tokens: the panel kernel
      for (int64_t i = 0; i < slices; ++i) {
        const int64_t t0 = n * i / slices, t1 = n * (i + 1) / slices;
        std::vector<Bf16> zs, want((t1 - t0) * cfg.latent);
        for (int64_t j = t0; j < t1; ++j) {
          const Bf16* row = z.data() + pairs[e][j] / 2 * cfg.latent;
          zs.insert(zs.end(), row, row + cfg.latent);
        }
        ExpertFfn(k(), *w.Expert(e), zs.data(), t1 - t0, cfg.situ_beta, cfg.situ_linear_beta,
                  want.data(), precision);
        for (int64_t j = t0; j < t1; ++j) {
          for (int64_t c = 0; c < cfg.latent; ++c) {
            ASSERT_EQ(y[pairs[e][j] * cfg.latent + c].bits, want[(j - t0) * cfg.latent + c].bits)
                << PrecisionName(precision) << ", expert " << e << ", its token " << j << " of "
                << n << ", column " << c;
          }
          ++checked;
        }
      }
    }
    EXPECT_EQ(checked, 2 * kTokens);
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

INSTANTIATE_TEST_SUITE_P(Isas, Consistency, ::testing::ValuesIn(AllIsas()),
                         [](const auto& info) { return std::string(IsaName(info.param)); });

}  // namespace
}  // namespace moe::numerics::cpu
