// TwinAuditor's judgement without processes: a message of three rows (two experts, two
// tokens) answered by an honest replica (the scalar reference itself), by a replica whose kernels
// sum in another order (the honest answer moved by one ulp in a few places, within the bound),
// and by a lying one (the same experts of another seed: a member with a valid identity serving
// other weights), in per-pair and partial-sum mode, against the named bounds.
#include "attention-svc/twin_audit.h"

#include <gtest/gtest.h>

#include <vector>

#include "services/checkpoint/synthetic.h"
#include "services/numerics/combine.h"
#include "services/numerics/expert_ffn.h"

namespace moe::attention_svc {
namespace {

using tensor::Bf16;

class TwinAuditTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cfg_ = *PresetConfig("tiny");
    layer_ = static_cast<int32_t>(cfg_.first_moe_layer);
    checkpoint::SyntheticOptions so;
    so.seed = 7;
    right_ = checkpoint::SyntheticExperts(cfg_, layer_, 0, cfg_.num_experts, so);
    so.seed = 8;
    other_ = checkpoint::SyntheticExperts(cfg_, layer_, 0, cfg_.num_experts, so);
    d_ = cfg_.latent;
    // Token 0 -> experts 2 and 5, token 1 -> expert 2: rows (2, t0), (2, t1), (5, t0).
    m_.groups = {{2, 2}, {5, 1}};
    m_.pairs = {0, 2, 1};
    m_.row_source = {0, 1, 0};
    m_.tokens = {0, 1};
    m_.token_index = {0, 1, 0};
    m_.weights = {0.6f, 1.0f, 0.4f};
    std::vector<Bf16> z(static_cast<size_t>(2 * d_));
    for (int64_t i = 0; i < 2 * d_; ++i) {
      z[static_cast<size_t>(i)] = Bf16::FromFloat(0.05f * static_cast<float>((i * 37) % 41 - 20));
    }
    m_.z = tensor::Activations::FromBf16(std::move(z), 2, d_);
    header_.layer = layer_;
    header_.num_tokens = 2;
    header_.latent = d_;
  }

  // Per-pair rows of the message computed on w.
  std::vector<Bf16> Rows(const numerics::MoeLayerWeights& w) const {
    std::vector<Bf16> y(static_cast<size_t>(3 * d_));
    const int32_t experts[3] = {2, 2, 5};
    for (int r = 0; r < 3; ++r) {
      numerics::ref::ExpertFfn(*w.Expert(experts[r]),
                               m_.z.bf16().data() + m_.row_source[static_cast<size_t>(r)] * d_, 1,
                               cfg_.situ_beta, cfg_.situ_linear_beta, y.data() + r * d_);
    }
    return y;
  }
  ExpertReply PerPair(std::vector<Bf16> y) const {
    ExpertReply r;
    r.rows = 3;
    r.Own(std::move(y));
    return r;
  }
  ExpertReply Partial(const std::vector<Bf16>& y) const {
    ExpertReply r;
    r.rows = 2;
    numerics::PartialSums(y.data(), 3, d_, m_.token_index.data(), m_.weights.data(), 2, &r.f32);
    return r;
  }

  TwinAuditor Auditor(bool with_reference = true) {
    return TwinAuditor(
        cfg_, {},
        [this, with_reference](int32_t layer) -> const numerics::MoeLayerWeights* {
          return with_reference && layer == layer_ ? &right_ : nullptr;
        },
        [this](const ShardQuarantine& q) { caught_.push_back(q); });
  }

  ModelConfig cfg_;
  int32_t layer_ = 0;
  int64_t d_ = 0;
  numerics::MoeLayerWeights right_, other_;
  DispatchMessage m_;
  DispatchHeader header_;
  const ShardRef a_{"shard-a", "127.0.0.1:1", 0, 8, true, 0};
  const ShardRef b_{"shard-b", "127.0.0.1:2", 0, 8, true, 0};
  std::vector<ShardQuarantine> caught_;
};

TEST_F(TwinAuditTest, SamplesExactlyOneInShareOfEachRange) {
  TwinAuditOptions o;
  o.share = 64;
  TwinAuditor audit(cfg_, o, nullptr, nullptr);
  // Two ranges' messages alternating, as a request's plan sends them: each range gets its own
  // share (one counter for both would sample one range only).
  int sampled[2] = {0, 0};
  for (int i = 0; i < 1280; ++i) sampled[i % 2] += audit.Sample(layer_, i % 2 * 8, i % 2 * 8 + 8);
  EXPECT_EQ(sampled[0], 10);
  EXPECT_EQ(sampled[1], 10);
  o.share = 0;
  TwinAuditor off(cfg_, o, nullptr, nullptr);
  EXPECT_FALSE(off.Sample(layer_, 0, 8));
}

TEST_F(TwinAuditTest, BitIdenticalRepliesAgree) {
  TwinAuditor audit = Auditor();
  const ExpertReply r = PerPair(Rows(right_));
  const TwinVerdict v = audit.Judge(header_, m_, {&a_, &b_}, {&r, &r});
  EXPECT_EQ(v.outcome, TwinOutcome::kAgree) << v.detail;
  EXPECT_TRUE(caught_.empty());
}

TEST_F(TwinAuditTest, ASummationOrderApartIsWithinTheBound) {
  TwinAuditor audit = Auditor();
  std::vector<Bf16> y = Rows(right_);
  std::vector<Bf16> moved = y;
  for (size_t i = 0; i < moved.size(); i += 97) {  // one ulp up, here and there
    moved[i] = Bf16::FromBits(static_cast<uint16_t>(moved[i].bits + 1));
  }
  const ExpertReply r = PerPair(y), s = PerPair(moved);
  const TwinVerdict v = audit.Judge(header_, m_, {&a_, &b_}, {&r, &s});
  EXPECT_EQ(v.outcome, TwinOutcome::kWithinBound) << v.detail;
  EXPECT_TRUE(caught_.empty());
  EXPECT_FALSE(audit.Quarantined(a_) || audit.Quarantined(b_));
}

TEST_F(TwinAuditTest, TheLiarIsCaughtWhicheverSideItIsOn) {
  for (const bool liar_first : {false, true}) {
    SCOPED_TRACE(liar_first);
    caught_.clear();
    TwinAuditor audit = Auditor();
    const ExpertReply good = PerPair(Rows(right_)), bad = PerPair(Rows(other_));
    // Three answers of the liar served before the audit, none after a passed one.
    for (int i = 0; i < 3; ++i) audit.Answered(liar_first ? a_ : b_);
    const TwinVerdict v = liar_first ? audit.Judge(header_, m_, {&a_, &b_}, {&bad, &good})
                                     : audit.Judge(header_, m_, {&a_, &b_}, {&good, &bad});
    EXPECT_EQ(v.outcome, TwinOutcome::kCaught) << v.detail;
    EXPECT_EQ(v.use, liar_first ? 1 : 0);
    ASSERT_EQ(caught_.size(), 1u);
    EXPECT_EQ(caught_[0].shard.shard, liar_first ? "shard-a" : "shard-b");
    EXPECT_EQ(caught_[0].layer, layer_);
    EXPECT_EQ(caught_[0].suspect_answers, 3);
    EXPECT_TRUE(audit.Quarantined(liar_first ? a_ : b_));
    EXPECT_EQ(audit.counts().quarantined,
              std::vector<std::string>{liar_first ? "shard-a" : "shard-b"});
    EXPECT_FALSE(audit.Quarantined(liar_first ? b_ : a_));
    // Caught again: counted, but the sink hears of a shard once.
    audit.Judge(header_, m_, {&a_, &b_}, {&good, &bad});
    EXPECT_EQ(caught_.size(), liar_first ? 2u : 1u);
  }
}

TEST_F(TwinAuditTest, PartialSumsAreJudgedAtTheScaleOfTheirTerms) {
  TwinAuditor audit = Auditor();
  const std::vector<Bf16> y = Rows(right_);
  std::vector<Bf16> moved = y;
  for (size_t i = 0; i < moved.size(); i += 89) {
    moved[i] = Bf16::FromBits(static_cast<uint16_t>(moved[i].bits + 1));
  }
  const ExpertReply good = Partial(y), near = Partial(moved), bad = Partial(Rows(other_));
  EXPECT_EQ(audit.Judge(header_, m_, {&a_, &b_}, {&good, &good}).outcome, TwinOutcome::kAgree);
  header_.mode = ReplyMode::kPartialSum;
  TwinVerdict v = audit.Judge(header_, m_, {&a_, &b_}, {&good, &near});
  EXPECT_EQ(v.outcome, TwinOutcome::kWithinBound) << v.detail;
  v = audit.Judge(header_, m_, {&a_, &b_}, {&bad, &good});
  EXPECT_EQ(v.outcome, TwinOutcome::kCaught) << v.detail;
  EXPECT_EQ(v.use, 1);
  ASSERT_EQ(caught_.size(), 1u);
  EXPECT_EQ(caught_[0].shard.shard, "shard-a");
}

TEST_F(TwinAuditTest, WithoutAVerdictTheMessageIsNotAnswered) {
  const ExpertReply good = PerPair(Rows(right_)), bad = PerPair(Rows(other_));
  {
    TwinAuditor audit = Auditor(/*with_reference=*/false);
    const TwinVerdict v = audit.Judge(header_, m_, {&a_, &b_}, {&good, &bad});
    EXPECT_EQ(v.outcome, TwinOutcome::kUnresolved) << v.detail;
    EXPECT_NE(v.detail.find("no reference"), std::string::npos) << v.detail;
  }
  {
    // Both wrong, differently: neither is confirmed, nobody is quarantined.
    TwinAuditor audit = Auditor();
    std::vector<Bf16> worse = Rows(other_);
    for (Bf16& x : worse) x = Bf16::FromFloat(x.ToFloat() * 2.0f + 1.0f);
    const ExpertReply w = PerPair(worse);
    const TwinVerdict v = audit.Judge(header_, m_, {&a_, &b_}, {&bad, &w});
    EXPECT_EQ(v.outcome, TwinOutcome::kUnresolved) << v.detail;
    EXPECT_TRUE(caught_.empty());
    EXPECT_EQ(audit.counts().outcomes.at(TwinOutcome::kUnresolved), 1);
  }
}

}  // namespace
}  // namespace moe::attention_svc
