// The attention node's dispatch plan and gather without processes: the
// messages a hand-made routing produces (rows, row_source, distinct tokens, chunking at the
// byte budget, partial-sum fields), the errors, and the round trip through in-process expert
// channels against the in-process layer (bit-exact per pair, within a named bound with partial
// sums).
#include "attention-svc/dispatch_plan.h"

#include <cstring>

#include "attention-svc/expert_channel_local.h"
#include "gtest/gtest.h"
#include "services/checkpoint/synthetic.h"
#include "services/numerics/combine.h"
#include "services/numerics/cpu/kernel_choice.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/numerics/tolerance.h"

namespace moe::attention_svc {
namespace {

using tensor::Bf16;

// Partial sums change the order of the fp32 latent sum (per shard, then across shards) and
// round each shard's subtotal to fp32, so r = bf16(sum) can land on the neighbouring bf16
// value when the exact sum sits next to a rounding boundary. The fp32 reordering error is a
// few 2^-24 of the sum of |terms|, far below one bf16 ulp of the row's scale; an element that
// is a near-cancelling sum can still move by more than its own ulp (measured: one element by
// 2 ulps, 0.25 ulp of its row scale, 8 of 102400 differing). Stated at the row scale.
constexpr numerics::Tolerance kPartialSumLatentTolerance = {1.0, 1e-3, 0.01, -1};

ShardRef Shard(const std::string& name, int32_t lo, int32_t hi, bool healthy = true) {
  return {name, "127.0.0.1:" + std::to_string(5000 + lo), lo, hi, healthy, 0};
}

// T = 3 tokens, k = 2: token 0 -> {1, 6}, token 1 -> {6, 9}, token 2 -> {9, 1} (rank order).
numerics::Routing HandRouting() {
  numerics::Routing r;
  r.tokens = 3;
  r.top_k = 2;
  r.expert_ids = {1, 6, 6, 9, 9, 1};
  r.weights = {0.7f, 0.3f, 0.6f, 0.4f, 0.55f, 0.45f};
  return r;
}

std::vector<Bf16> Rows(int64_t tokens, int64_t d) {
  std::vector<Bf16> z(static_cast<size_t>(tokens * d));
  for (size_t i = 0; i < z.size(); ++i) z[i] = Bf16::FromFloat(static_cast<float>(i) * 0.25f);
  return z;
}

TEST(PlanDispatch, GroupsRowsByShardAndSendsEachTokenOnce) {
  const int64_t d = 4;
  const std::vector<Bf16> z = Rows(3, d);
  const LayerRoute route = BuildRoute(1, 16, {Shard("shard-0", 0, 5), Shard("shard-1", 5, 16)});
  for (ReplyMode mode : {ReplyMode::kPerPair, ReplyMode::kPartialSum}) {
    SCOPED_TRACE(ReplyModeName(mode));
    DispatchSpec spec;
    spec.mode = mode;
    spec.num_experts = 16;
    spec.latent = d;
    auto plan = PlanDispatch(HandRouting(), tensor::Activations::FromBf16(z, 3, d), route, spec);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->per_expert[1], 2);
    EXPECT_EQ(plan->per_expert[6], 2);
    EXPECT_EQ(plan->per_expert[9], 2);
    EXPECT_EQ(plan->shard_rows,
              (std::vector<std::pair<std::string, int64_t>>{{"shard-0", 2}, {"shard-1", 4}}));
    ASSERT_EQ(plan->messages.size(), 2u);
    const DispatchMessage& a = plan->messages[0];
    EXPECT_EQ(a.shard, 0u);
    EXPECT_EQ(a.groups, (std::vector<std::pair<int32_t, int32_t>>{{1, 2}}));
    EXPECT_EQ(a.pairs, (std::vector<int64_t>{0, 5}));  // (t0, slot 0), (t2, slot 1)
    EXPECT_EQ(a.tokens, (std::vector<int64_t>{0, 2}));
    EXPECT_EQ(a.row_source, (std::vector<int32_t>{0, 1}));
    ASSERT_EQ(a.z.bf16().size(), 2u * d);
    EXPECT_EQ(std::memcmp(a.z.bf16().data() + d, z.data() + 2 * d, d * sizeof(Bf16)),
              0);  // token 2
    const DispatchMessage& b = plan->messages[1];
    EXPECT_EQ(b.groups, (std::vector<std::pair<int32_t, int32_t>>{{6, 2}, {9, 2}}));
    EXPECT_EQ(b.pairs, (std::vector<int64_t>{1, 2, 3, 4}));
    EXPECT_EQ(b.tokens, (std::vector<int64_t>{0, 1, 2}));
    EXPECT_EQ(b.row_source, (std::vector<int32_t>{0, 1, 1, 2}));  // token 1 sent once
    if (mode == ReplyMode::kPartialSum) {
      EXPECT_EQ(b.token_index, (std::vector<int32_t>{0, 1, 1, 2}));
      EXPECT_EQ(b.weights, (std::vector<float>{0.3f, 0.6f, 0.4f, 0.55f}));
    } else {
      EXPECT_TRUE(b.token_index.empty());
      EXPECT_TRUE(b.weights.empty());
    }
  }
}

TEST(PlanDispatch, SplitsAtExpertBoundariesUnderTheByteBudget) {
  const int64_t d = 4;
  const std::vector<Bf16> z = Rows(3, d);
  const LayerRoute route = BuildRoute(1, 16, {Shard("only", 0, 16)});
  DispatchSpec spec;
  spec.num_experts = 16;
  spec.latent = d;
  struct Case {
    int64_t budget_rows;  // reply rows that fit
    std::vector<std::vector<int32_t>> experts;
  };
  // Experts 1, 6 and 9 have 2 rows each.
  for (const Case& c : std::vector<Case>{{6, {{1, 6, 9}}},
                                         {4, {{1, 6}, {9}}},
                                         {3, {{1}, {6}, {9}}},
                                         {1, {{1}, {6}, {9}}}}) {  // an expert is never split
    SCOPED_TRACE(c.budget_rows);
    spec.max_message_bytes = c.budget_rows * d * 2;
    auto plan = PlanDispatch(HandRouting(), tensor::Activations::FromBf16(z, 3, d), route, spec);
    ASSERT_TRUE(plan.ok());
    ASSERT_EQ(plan->messages.size(), c.experts.size());
    for (size_t i = 0; i < c.experts.size(); ++i) {
      std::vector<int32_t> got;
      for (const auto& [e, n] : plan->messages[i].groups) got.push_back(e);
      EXPECT_EQ(got, c.experts[i]);
    }
  }
}

TEST(PlanDispatch, NamesAMissingOrUnhealthyOwner) {
  const int64_t d = 4;
  const std::vector<Bf16> z = Rows(3, d);
  DispatchSpec spec;
  spec.num_experts = 16;
  spec.latent = d;
  auto gap = PlanDispatch(HandRouting(), tensor::Activations::FromBf16(z, 3, d),
                          BuildRoute(7, 16, {Shard("a", 0, 8)}), spec);
  EXPECT_EQ(gap.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(gap.status().message().find("no expert shard hosts expert 9 of layer 7"),
            absl::string_view::npos)
      << gap.status();
  auto sick = PlanDispatch(HandRouting(), tensor::Activations::FromBf16(z, 3, d),
                           BuildRoute(7, 16, {Shard("a", 0, 5), Shard("b", 5, 16, false)}), spec);
  EXPECT_EQ(sick.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(sick.status().message().find("expert shard b ("), absl::string_view::npos);
  EXPECT_NE(sick.status().message().find("is unhealthy"), absl::string_view::npos);
  // Unrouted experts need no owner: only expert 1 is routed here.
  numerics::Routing one;
  one.tokens = 1;
  one.top_k = 1;
  one.expert_ids = {1};
  one.weights = {1.0f};
  const tensor::Activations z1 = tensor::Activations::FromBf16({z.begin(), z.begin() + d}, 1, d);
  EXPECT_TRUE(PlanDispatch(one, z1, BuildRoute(7, 16, {Shard("a", 0, 5)}), spec).ok());
  // Activations of another shape than [T, latent] are refused by name.
  EXPECT_EQ(PlanDispatch(one, tensor::Activations::FromBf16(z, 3, d),
                         BuildRoute(7, 16, {Shard("a", 0, 5)}), spec)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Gather, RefusesARepliesOfTheWrongShape) {
  const int64_t d = 4;
  const std::vector<Bf16> z = Rows(3, d);
  const LayerRoute route = BuildRoute(1, 16, {Shard("shard-0", 0, 5), Shard("shard-1", 5, 16)});
  DispatchSpec spec;
  spec.num_experts = 16;
  spec.latent = d;
  auto plan = PlanDispatch(HandRouting(), tensor::Activations::FromBf16(z, 3, d), route, spec);
  ASSERT_TRUE(plan.ok());
  std::vector<ExpertReply> replies(2);
  replies[0].rows = 2;
  replies[0].Own(std::vector<Bf16>(2 * d));
  replies[1].rows = 3;  // 4 expected
  replies[1].Own(std::vector<Bf16>(3 * d));
  auto r = Gather(*plan, HandRouting(), route, replies);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(r.status().message().find("shard shard-1 returned 3 rows for 4"),
            absl::string_view::npos)
      << r.status();
  replies.pop_back();
  EXPECT_EQ(Gather(*plan, HandRouting(), route, replies).status().code(),
            absl::StatusCode::kInternal);
}

// The plan and gather through in-process channels on two unequal shards equal the in-process
// layer's combine: bit for bit per pair (also with chunked messages), within
// kPartialSumLatentTolerance with partial sums.
TEST(DispatchRoundTrip, EqualsTheInProcessCombine) {
  const ModelConfig cfg = *PresetConfig("mid");
  checkpoint::SyntheticOptions so;
  so.seed = 2;
  so.router_skew = 1.0;
  auto layer = numerics::cpu::CpuMoeLayer::Create(cfg, checkpoint::SyntheticLayer(cfg, 1, so), {});
  ASSERT_TRUE(layer.ok());
  const numerics::MoeLayerWeights lo = checkpoint::SyntheticExperts(cfg, 1, 0, 40, so);
  const numerics::MoeLayerWeights hi =
      checkpoint::SyntheticExperts(cfg, 1, 40, cfg.num_experts, so);
  const auto& kernels = numerics::cpu::ChosenKernels(cfg.latent, cfg.intermediate);
  ThreadPool pool(2);
  LocalExpertChannel ch0("shard-0", cfg, &lo, kernels, &pool);
  LocalExpertChannel ch1("shard-1", cfg, &hi, kernels, &pool);
  const LayerRoute route = BuildRoute(
      1, static_cast<int32_t>(cfg.num_experts),
      {Shard("shard-0", 0, 40), Shard("shard-1", 40, static_cast<int32_t>(cfg.num_experts))});
  for (int64_t tokens : {1, 37, 200}) {
    const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, tokens, 5 + tokens);
    auto batch = (*layer)->RouteAndProject(x, tokens, cfg.hidden, nullptr, nullptr);
    ASSERT_TRUE(batch.ok());
    const std::vector<Bf16> y = (*layer)->RunLocalExperts(batch->routing, batch->z.data());
    std::vector<Bf16> want(static_cast<size_t>(tokens * cfg.latent));
    numerics::ref::Combine(batch->routing, y.data(), cfg.latent, want.data());
    for (auto [mode, budget] :
         std::vector<std::pair<ReplyMode, int64_t>>{{ReplyMode::kPerPair, int64_t{64} << 20},
                                                    {ReplyMode::kPerPair, 16 << 10},
                                                    {ReplyMode::kPartialSum, int64_t{64} << 20},
                                                    {ReplyMode::kPartialSum, 16 << 10}}) {
      SCOPED_TRACE(std::string(ReplyModeName(mode)) + ", budget " + std::to_string(budget) +
                   ", T " + std::to_string(tokens));
      DispatchSpec spec;
      spec.mode = mode;
      spec.num_experts = cfg.num_experts;
      spec.latent = cfg.latent;
      spec.max_message_bytes = budget;
      auto plan = PlanDispatch(
          batch->routing, tensor::Activations::FromBf16(batch->z, tokens, cfg.latent), route, spec);
      ASSERT_TRUE(plan.ok()) << plan.status();
      if (budget < (1 << 20) && tokens == 200) {
        EXPECT_GT(plan->messages.size(), 2u);
      }
      DispatchHeader h;
      h.layer = 1;
      h.mode = mode;
      h.num_tokens = tokens;
      h.latent = cfg.latent;
      std::vector<ExpertReply> replies;
      for (const DispatchMessage& m : plan->messages) {
        auto reply = (m.shard == 0 ? ch0 : ch1).Send(h, m)->Wait(absl::InfiniteFuture());
        ASSERT_TRUE(reply.ok()) << reply.status();
        replies.push_back(std::move(*reply));
      }
      auto r = Gather(*plan, batch->routing, route, replies);
      ASSERT_TRUE(r.ok()) << r.status();
      if (mode == ReplyMode::kPerPair) {
        ASSERT_EQ(std::memcmp(r->data(), want.data(), want.size() * sizeof(Bf16)), 0);
      } else {
        numerics::UlpStats stats;
        stats.AddRows(r->data(), want.data(), tokens, cfg.latent);
        EXPECT_TRUE(stats.Within(kPartialSumLatentTolerance)) << stats.Str();
      }
    }
  }
}

TEST(LocalExpertChannel, RefusesAnExpertOutsideItsRange) {
  const ModelConfig cfg = *PresetConfig("tiny");
  const numerics::MoeLayerWeights w = checkpoint::SyntheticExperts(cfg, 1, 0, 5, {});
  ThreadPool pool(1);
  LocalExpertChannel ch("shard-0", cfg, &w, numerics::cpu::ScalarKernels(), &pool);
  DispatchMessage m;
  m.groups = {{7, 1}};
  m.pairs = {0};
  m.row_source = {0};
  m.tokens = {0};
  m.z = tensor::Activations::FromBf16(
      std::vector<Bf16>(static_cast<size_t>(cfg.latent), Bf16::FromFloat(1.0f)), 1, cfg.latent);
  DispatchHeader h;
  h.latent = cfg.latent;
  h.num_tokens = 1;
  auto r = ch.Send(h, m)->Wait(absl::InfiniteFuture());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("expert 7 is not hosted here [0, 5)"),
            absl::string_view::npos)
      << r.status();
}

}  // namespace
}  // namespace moe::attention_svc
