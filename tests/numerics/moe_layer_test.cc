// The whole in-process layer: shapes, invariants of the routing output, determinism, the
// stages composing to the whole, and bad input answered with a clear Status.
#include "services/numerics/moe_layer.h"

#include <cmath>
#include <limits>
#include <set>
#include <string>

#include "gtest/gtest.h"
#include "services/checkpoint/synthetic.h"
#include "services/numerics/combine.h"

namespace moe::numerics {
namespace {

using tensor::Bf16;

class MoeLayerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cfg_ = *PresetConfig("tiny");
    checkpoint::SyntheticOptions opt;
    opt.seed = 11;
    opt.router_skew = 1.0;
    weights_ = checkpoint::SyntheticLayer(cfg_, 1, opt);
    x_ = checkpoint::SyntheticHiddenStates(cfg_, kTokens, 5);
  }

  static constexpr int64_t kTokens = 24;
  ModelConfig cfg_;
  MoeLayerWeights weights_;
  std::vector<Bf16> x_;
};

TEST_F(MoeLayerTest, ForwardProducesOutputAndValidRouting) {
  auto y = ref::MoeLayerForward(cfg_, weights_, x_, kTokens, cfg_.hidden);
  ASSERT_TRUE(y.ok()) << y.status();
  ASSERT_EQ(y->out.size(), static_cast<size_t>(kTokens * cfg_.hidden));
  ASSERT_EQ(y->routing.expert_ids.size(), static_cast<size_t>(kTokens * cfg_.top_k));
  double abs_sum = 0;
  for (const Bf16& v : y->out) {
    ASSERT_TRUE(std::isfinite(v.ToFloat()));
    abs_sum += std::fabs(v.ToFloat());
  }
  EXPECT_GT(abs_sum / y->out.size(), 0.01);  // not a zero output
  for (int64_t t = 0; t < kTokens; ++t) {
    std::set<int32_t> ids;
    float wsum = 0;
    for (int64_t j = 0; j < cfg_.top_k; ++j) {
      const int32_t e = y->routing.expert_ids[t * cfg_.top_k + j];
      ASSERT_GE(e, 0);
      ASSERT_LT(e, cfg_.num_experts);
      ids.insert(e);
      wsum += y->routing.weights[t * cfg_.top_k + j];
      EXPECT_GT(y->routing.weights[t * cfg_.top_k + j], 0.0f);
    }
    EXPECT_EQ(ids.size(), static_cast<size_t>(cfg_.top_k)) << "token " << t;
    EXPECT_NEAR(wsum, 1.0f, 1e-6f);
  }
}

TEST_F(MoeLayerTest, IsDeterministicAndPerTokenIndependent) {
  auto a = ref::MoeLayerForward(cfg_, weights_, x_, kTokens, cfg_.hidden);
  auto b = ref::MoeLayerForward(cfg_, weights_, x_, kTokens, cfg_.hidden);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->out.size(), b->out.size());
  for (size_t i = 0; i < a->out.size(); ++i) ASSERT_EQ(a->out[i].bits, b->out[i].bits);
  // Token 3 alone gives the same bits as token 3 inside the batch.
  const std::vector<Bf16> one(x_.begin() + 3 * cfg_.hidden, x_.begin() + 4 * cfg_.hidden);
  auto c = ref::MoeLayerForward(cfg_, weights_, one, 1, cfg_.hidden);
  ASSERT_TRUE(c.ok());
  for (int64_t h = 0; h < cfg_.hidden; ++h) {
    ASSERT_EQ(c->out[h].bits, a->out[3 * cfg_.hidden + h].bits);
  }
}

TEST_F(MoeLayerTest, StagesComposeToTheWholeLayer) {
  auto whole = ref::MoeLayerForward(cfg_, weights_, x_, kTokens, cfg_.hidden);
  ASSERT_TRUE(whole.ok());
  const Routing routing = ref::Route(cfg_, weights_, x_.data(), kTokens, nullptr);
  EXPECT_EQ(routing.expert_ids, whole->routing.expert_ids);
  const std::vector<Bf16> z = ref::LatentDown(cfg_, weights_, x_.data(), kTokens);
  const std::vector<Bf16> y = ref::RunExperts(cfg_, weights_, routing, z.data());
  std::vector<Bf16> r(kTokens * cfg_.latent);
  ref::Combine(routing, y.data(), cfg_.latent, r.data());
  const std::vector<Bf16> out =
      ref::FinishLayer(cfg_, weights_, x_.data(), kTokens, r.data(), nullptr);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i].bits, whole->out[i].bits);
}

TEST_F(MoeLayerTest, BiasOverrideChangesSelectionOnly) {
  auto base = ref::MoeLayerForward(cfg_, weights_, x_, kTokens, cfg_.hidden);
  ASSERT_TRUE(base.ok());
  // A large bias on expert 0 puts it into every token's top-k.
  std::vector<float> bias = weights_.bias;
  bias[0] += 10.0f;
  auto biased = ref::MoeLayerForward(cfg_, weights_, x_, kTokens, cfg_.hidden, bias.data());
  ASSERT_TRUE(biased.ok());
  for (int64_t t = 0; t < kTokens; ++t) {
    EXPECT_EQ(biased->routing.expert_ids[t * cfg_.top_k], 0);  // rank 0 every time
    EXPECT_LT(biased->routing.weights[t * cfg_.top_k], 1.0f);  // weight from the raw score
  }
}

// On the mid preset (128 experts, k = 8) with 4096 tokens the sampling-noise floor of MaxVio is
// about sqrt(2 ln 128) / sqrt(256) = 0.19 (docs/quantile-balancing.md); skew 1 must stand far above
// it, skew 0 not.
TEST(SyntheticRouter, SkewMakesSomeExpertsHot) {
  const ModelConfig cfg = *PresetConfig("mid");
  const int64_t tokens = 4096;
  const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, tokens, 9);
  auto max_vio = [&](double skew) {
    checkpoint::SyntheticOptions opt;
    opt.seed = 11;
    opt.router_skew = skew;
    const MoeLayerWeights w = checkpoint::SyntheticLayer(cfg, 1, opt);
    std::vector<int> load(cfg.num_experts, 0);
    for (int32_t e : ref::Route(cfg, w, x.data(), tokens, nullptr).expert_ids) ++load[e];
    const double mean = double(tokens * cfg.top_k) / cfg.num_experts;
    return *std::max_element(load.begin(), load.end()) / mean - 1.0;
  };
  EXPECT_LT(max_vio(0.0), 0.4);
  EXPECT_GT(max_vio(1.0), 1.0);
}

struct BadInputCase {
  const char* name;
  int64_t tokens;
  int64_t width;
  float poison;  // written into x[1, 2] when not zero
  const char* expect;
};
void PrintTo(const BadInputCase& c, std::ostream* os) { *os << c.name; }

class MoeLayerBadInput : public MoeLayerTest, public ::testing::WithParamInterface<BadInputCase> {};

TEST_P(MoeLayerBadInput, IsRejectedWithAClearMessage) {
  const BadInputCase& c = GetParam();
  std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(
      cfg_, 4, 1);  // 4 tokens of the right width; reinterpret with c.tokens and c.width
  x.resize(static_cast<size_t>(std::max<int64_t>(0, c.tokens * c.width)));
  if (c.poison != 0.0f) x[1 * c.width + 2] = Bf16::FromFloat(c.poison);
  auto y = ref::MoeLayerForward(cfg_, weights_, x, c.tokens, c.width);
  ASSERT_FALSE(y.ok());
  EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(y.status().message()).find(c.expect), std::string::npos) << y.status();
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MoeLayerBadInput,
    ::testing::Values(BadInputCase{"zero_tokens", 0, 128, 0.0f, "at least one"},
                      BadInputCase{"wrong_width", 4, 96, 0.0f, "hidden_size 128"},
                      BadInputCase{"nan", 4, 128, std::numeric_limits<float>::quiet_NaN(),
                                   "NaN at token 1, column 2"},
                      BadInputCase{"inf", 4, 128, std::numeric_limits<float>::infinity(),
                                   "Inf at token 1, column 2"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST_F(MoeLayerTest, SizeMismatchAndMissingWeightsAreErrors) {
  std::vector<Bf16> short_x(x_.begin(), x_.end() - 1);
  auto y = ref::MoeLayerForward(cfg_, weights_, short_x, kTokens, cfg_.hidden);
  EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);

  MoeLayerWeights partial = weights_;
  partial.expert_hi = 8;
  partial.experts.resize(8);
  y = ref::MoeLayerForward(cfg_, partial, x_, kTokens, cfg_.hidden);
  EXPECT_EQ(y.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(y.status().message()).find("[0, 8)"), std::string::npos) << y.status();

  MoeLayerWeights no_dense = weights_;
  no_dense.has_dense = false;
  y = ref::MoeLayerForward(cfg_, no_dense, x_, kTokens, cfg_.hidden);
  EXPECT_EQ(y.status().code(), absl::StatusCode::kFailedPrecondition);

  MoeLayerWeights bad_gate = weights_;
  bad_gate.gate.pop_back();
  y = ref::MoeLayerForward(cfg_, bad_gate, x_, kTokens, cfg_.hidden);
  EXPECT_NE(std::string(y.status().message()).find("gate.weight"), std::string::npos);
}

}  // namespace
}  // namespace moe::numerics
