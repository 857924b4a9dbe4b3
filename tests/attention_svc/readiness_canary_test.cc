// CanaryOracle's judgement without processes, at a shape with K3's k x intermediate (16 experts
// of 3,072 each per token; hidden 1,024 so that it runs in seconds): the answer of the optimized
// in-process layer (the kernels every shard runs) is a match, whatever its summation order does
// to the bf16 roundings; the answer of the same layer on other weights (a member serving another
// checkpoint), and the optimized answer with one output moved past the bound, are mismatches; an
// answer under another bias version is skipped. A K3 local cluster never became ready when the
// canary also held the consistency suite's fractions, which the optimized layer itself misses at
// this shape (docs/math.md).
#include "attention-svc/readiness_canary.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "services/checkpoint/synthetic.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/numerics/tolerance.h"
#include "services/transport/tensor_codec.h"

namespace moe::attention_svc {
namespace {

using tensor::Bf16;

constexpr int64_t kTokens = 4;
constexpr uint64_t kCanarySeed = 9;

ModelConfig WideExperts() {
  ModelConfig c;
  c.name = "k3-experts";
  c.hidden = 1024;
  c.latent = 512;
  c.intermediate = 3072;
  c.num_experts = 32;
  c.top_k = 16;
  c.num_shared_experts = 2;
  c.num_layers = 2;
  c.first_moe_layer = 1;
  return c;
}

// The optimized layer's answer to the canary's request on `w`.
std::vector<Bf16> Optimized(const ModelConfig& cfg, const numerics::MoeLayerWeights& w,
                            const v1::ForwardRequest& req, const std::vector<float>& bias) {
  auto layer = numerics::cpu::CpuMoeLayer::Create(cfg, w, {});
  EXPECT_TRUE(layer.ok()) << layer.status();
  auto x = transport::DecodeBf16Matrix(req.hidden_states(), "x", cfg.hidden, false);
  EXPECT_TRUE(x.ok()) << x.status();
  auto out = (*layer)->Forward(x->values, kTokens, cfg.hidden, bias.data());
  EXPECT_TRUE(out.ok()) << out.status();
  return out->out;
}

v1::ForwardResponse Answer(const ModelConfig& cfg, const std::vector<Bf16>& out, uint64_t version) {
  v1::ForwardResponse resp;
  resp.set_bias_version(version);
  transport::EncodeBf16Into(out, kTokens, cfg.hidden, resp.mutable_output());
  return resp;
}

// Busy canaries double the next one's timeout up to a minute (or the configured timeout, if
// longer); any other outcome sets it back to the configured one.
TEST(ReadinessCanary, BusyCanariesWaitTwiceAsLongNextAndAnythingElseResets) {
  int64_t t = 3000;
  std::vector<int64_t> seen;
  for (int i = 0; i < 6; ++i)
    seen.push_back(t = NextCanaryTimeoutMs(CanaryOutcome::kBusy, t, 3000));
  EXPECT_EQ(seen, (std::vector<int64_t>{6000, 12000, 24000, 48000, 60000, 60000}));
  for (CanaryOutcome o : {CanaryOutcome::kMatch, CanaryOutcome::kMismatch, CanaryOutcome::kTimeout,
                          CanaryOutcome::kError, CanaryOutcome::kSkipped}) {
    EXPECT_EQ(NextCanaryTimeoutMs(o, 48000, 3000), 3000) << kCanaryOutcomes.Name(o);
  }
  EXPECT_EQ(NextCanaryTimeoutMs(CanaryOutcome::kBusy, 30, 30), 60);
  EXPECT_EQ(NextCanaryTimeoutMs(CanaryOutcome::kBusy, 90000, 90000), 90000);  // never below it
  EXPECT_EQ(NextCanaryTimeoutMs(CanaryOutcome::kBusy, int64_t{1} << 62, 3000), 60000);
}

TEST(ReadinessCanary, TheOptimizedLayerMatchesAtK3sExpertWidthAndOtherWeightsDoNot) {
  const ModelConfig cfg = WideExperts();
  ASSERT_TRUE(ValidateConfig(cfg).ok());
  checkpoint::SyntheticOptions so;
  so.seed = 5;
  const numerics::MoeLayerWeights w = checkpoint::SyntheticLayer(cfg, 1, so);
  so.seed = 6;
  const numerics::MoeLayerWeights other = checkpoint::SyntheticLayer(cfg, 1, so);
  CanaryOracle oracle(cfg, &w, kTokens, kCanarySeed);
  const v1::ForwardRequest req = oracle.Request(1);
  BiasEntry bias;
  bias.version = 3;
  bias.bias = w.bias;

  const std::vector<Bf16> got = Optimized(cfg, w, req, bias.bias);
  std::string detail;
  EXPECT_EQ(oracle.Judge(Answer(cfg, got, 3), bias, &detail), CanaryOutcome::kMatch) << detail;
  // What the answer is: not bit-exact (the kernels sum in lanes), within the hard bound.
  auto want = oracle.Want(bias);
  ASSERT_TRUE(want.ok()) << want.status();
  numerics::UlpStats stats;
  stats.AddRows(got.data(), want->data(), kTokens, cfg.hidden);
  EXPECT_GT(stats.differing, 0) << "the optimized layer was bit-exact: this test shows nothing";
  std::printf("optimized layer against the canary's reference: %s\n", stats.Str().c_str());

  // A member serving other weights under a valid identity.
  EXPECT_EQ(oracle.Judge(Answer(cfg, Optimized(cfg, other, req, bias.bias), 3), bias, &detail),
            CanaryOutcome::kMismatch)
      << detail;
  // One output moved by a quarter of its row's scale: past 8 ulps of it (2^-5).
  std::vector<Bf16> moved = got;
  double rms = 0;
  for (int64_t i = 0; i < cfg.hidden; ++i)
    rms += static_cast<double>(got[i].ToFloat()) * got[i].ToFloat();
  rms = std::sqrt(rms / static_cast<double>(cfg.hidden));
  moved[7] = Bf16::FromFloat(got[7].ToFloat() + static_cast<float>(0.25 * rms));
  EXPECT_EQ(oracle.Judge(Answer(cfg, moved, 3), bias, &detail), CanaryOutcome::kMismatch) << detail;
  // Served under another bias version: not judged.
  EXPECT_EQ(oracle.Judge(Answer(cfg, got, 4), bias, &detail), CanaryOutcome::kSkipped) << detail;
}

// The statistics of the optimized layer against the scalar reference at K3's own shape, measured
// (out/ckpt-k3-seed1-skew1.0, `moe-tool forward --tokens 16 --seed 9`, --backend cpu against
// ref; and the canary of a K3 local cluster): 4.6-4.7% of the outputs differ, 1.6-1.7% by more
// than 1 ulp (the consistency suite's fraction is 1%), every one within 4 ulps of its row's
// scale. An answer with that pattern on the canary's reference is a match.
TEST(ReadinessCanary, SummationOrderNoiseOfK3sShapeIsAMatch) {
  const ModelConfig cfg = WideExperts();
  checkpoint::SyntheticOptions so;
  so.seed = 5;
  const numerics::MoeLayerWeights w = checkpoint::SyntheticLayer(cfg, 1, so);
  CanaryOracle oracle(cfg, &w, kTokens, kCanarySeed);
  BiasEntry bias;
  bias.version = 1;
  bias.bias = w.bias;
  auto want = oracle.Want(bias);
  ASSERT_TRUE(want.ok()) << want.status();
  std::vector<Bf16> got = *want;
  for (int64_t t = 0; t < kTokens; ++t) {
    double rms = 0;
    for (int64_t i = 0; i < cfg.hidden; ++i) {
      const double v = (*want)[t * cfg.hidden + i].ToFloat();
      rms += v * v;
    }
    rms = std::sqrt(rms / static_cast<double>(cfg.hidden));
    for (int64_t i = 0; i < cfg.hidden; ++i) {
      Bf16& g = got[t * cfg.hidden + i];
      if (g.bits == 0 || g.bits == 0x8000) continue;
      if (i % 30 == 0) g.bits += 1;  // a flipped rounding: one of its own ulps
      // A small difference of large terms: several of its own ulps, a fraction of the row's.
      if (i % 25 == 1 && std::abs(g.ToFloat()) < 0.5 * rms) g.bits += 3;
    }
  }
  numerics::UlpStats stats;
  stats.AddRows(got.data(), want->data(), kTokens, cfg.hidden);
  ASSERT_GT(stats.over1, stats.total / 100) << stats.Str();
  ASSERT_FALSE(stats.Within(numerics::kLayerTolerance)) << stats.Str();
  std::string detail;
  EXPECT_EQ(oracle.Judge(Answer(cfg, got, 1), bias, &detail), CanaryOutcome::kMatch) << detail;
}

}  // namespace
}  // namespace moe::attention_svc
