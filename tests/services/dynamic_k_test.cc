// Dynamic k across the cluster (docs/math.md section 4.1): router-svc solves the thresholds from
// the attention node's reports and publishes them with a bias version; attention-svc serves the
// layer's budget, capped per request, and says which it served. The oracle is the in-process
// layer with the same published thresholds (CpuMoeLayer::Forward with a BudgetRule), which the
// consistency test ties to the scalar reference and the NumPy reference test to NumPy. Real
// processes on loopback.
#include "services/numerics/dynamic_k.h"

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/moe_client.h"
#include "services/tools/local_cluster.h"
#include "tests/common/metrics_text.h"
#include "tests/services/cluster_fixtures.h"

namespace moe {
namespace {

using tensor::Bf16;
using testing::CheckpointFor;
using testing::ClientFor;
using testing::InProcessLayer;
using testing::SameBits;
using testing::TestCluster;
using tools::LocalCluster;
using tools::LocalClusterOptions;

int64_t Kept(const std::vector<int32_t>& ids) {
  int64_t n = 0;
  for (int32_t id : ids) n += id >= 0;
  return n;
}

TEST(ClusterDynamicK, ServesThePublishedBudgetAsTheInProcessLayerDoes) {
  const std::string& dir = CheckpointFor("mid");
  ModelConfig cfg;
  auto local = InProcessLayer(dir, &cfg);
  const int64_t k = cfg.top_k, e = cfg.num_experts;
  LocalClusterOptions o = TestCluster(dir, {{0, 40}, {40, 128}});
  o.admin_token = "s3cret";
  o.attention_args = {"--report_interval_ms=100"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto admin = ClientFor(**cluster, "s3cret");
  auto user = ClientFor(**cluster);
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);

  // Before any traffic there is nothing to solve thresholds from: refused, saying so.
  auto early = admin->SetExpertBudget(layer, 4);
  ASSERT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition) << early.status();
  EXPECT_NE(early.status().message().find("send traffic"), std::string::npos) << early.status();
  // Out of range, and without the admin token.
  for (int32_t bad : {0, -1, static_cast<int32_t>(k) + 1}) {
    EXPECT_EQ(admin->SetExpertBudget(layer, bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(user->SetExpertBudget(layer, 4).status().code(), absl::StatusCode::kPermissionDenied);

  // Calibration traffic: 1024 tokens reach the router's window with their budget histograms.
  for (int i = 0; i < 8; ++i) {
    const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, 128, 500 + i);
    auto r = user->Forward(layer, x, 128, cfg.hidden);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->expert_budget, k);  // no budget yet: the full top-k
    EXPECT_EQ(r->routed_pairs, 128 * k);
  }
  v1::LayerBias set;
  for (int i = 0; i < 100; ++i) {  // bounded: reports every 100 ms
    auto s = admin->GetLoadStats(layer);
    ASSERT_TRUE(s.ok()) << s.status();
    if (s->window_tokens() >= 1024) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  auto applied = admin->SetExpertBudget(layer, 4);
  ASSERT_TRUE(applied.ok()) << applied.status();
  set = *applied;
  EXPECT_EQ(set.budget().k_avg(), 4);
  EXPECT_EQ(set.budget().k_min(), 1);
  ASSERT_EQ(set.budget().thresholds_size(), (k - 1) * e);
  EXPECT_EQ(set.budget().solved_from_tokens(), 1024);
  EXPECT_NE(set.reason().find("budget 4 of 8"), std::string::npos) << set.reason();
  const std::vector<float> table(set.budget().thresholds().begin(),
                                 set.budget().thresholds().end());
  // The version reaches the attention node through WatchBias.
  const std::vector<Bf16> probe = checkpoint::SyntheticHiddenStates(cfg, 4, 1);
  for (int i = 0; i < 100; ++i) {
    auto r = user->Forward(layer, probe, 4, cfg.hidden);
    ASSERT_TRUE(r.ok()) << r.status();
    if (r->bias_version == set.version()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }

  // The layer's budget, a lower cap, a cap above the layer's (no effect), on fresh tokens: the
  // same selection, weights and output bits as the in-process layer with those thresholds.
  const std::vector<float> bias(set.bias().begin(), set.bias().end());
  struct Case {
    int32_t cap, served;
  };
  for (const Case c : {Case{0, 4}, Case{2, 2}, Case{7, 4}, Case{4, 4}}) {
    SCOPED_TRACE(absl::StrCat("cap ", c.cap));
    const int64_t tokens = 200;
    const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, tokens, 900 + c.cap);
    client::ForwardOptions fo;
    fo.return_routing = true;
    fo.reply_mode = v1::REPLY_MODE_PER_PAIR;
    fo.expert_budget = c.cap;
    auto got = user->Forward(layer, x, tokens, cfg.hidden, fo);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->bias_version, set.version());
    EXPECT_EQ(got->expert_budget, c.served);
    const numerics::BudgetRule rule{1, numerics::BudgetRow(table, c.served, e)};
    auto want = local->Forward(x, tokens, cfg.hidden, bias.data(), nullptr,
                               numerics::Precision::kW4A16, &rule);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got->expert_ids, want->routing.expert_ids);
    EXPECT_EQ(got->weights, want->routing.weights);
    EXPECT_TRUE(SameBits(got->out, want->out));
    EXPECT_EQ(got->routed_pairs, Kept(want->routing.expert_ids));
    const double per_token = static_cast<double>(got->routed_pairs) / tokens;
    std::printf("[dynamic k] cap %d: served budget %d, %.2f experts per token\n", c.cap,
                got->expert_budget, per_token);
    EXPECT_GT(per_token, 0.6 * c.served);  // thresholds from 1024 other tokens
    EXPECT_LT(per_token, 1.4 * c.served);
  }
  // A cap outside [0, k] is the caller's error.
  client::ForwardOptions bad;
  bad.expert_budget = static_cast<int32_t>(k) + 1;
  EXPECT_EQ(user->Forward(layer, probe, 4, cfg.hidden, bad).status().code(),
            absl::StatusCode::kInvalidArgument);

  // Reversible: back to the version before the budget, every token keeps k again, bit for bit
  // the layer without any budget.
  auto back = admin->RollbackBias(layer, set.version() - 1);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->budget().k_avg(), k);
  const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, 64, 77);
  for (int i = 0; i < 100; ++i) {
    auto r = user->Forward(layer, x, 64, cfg.hidden);
    ASSERT_TRUE(r.ok()) << r.status();
    if (r->bias_version != back->version()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    EXPECT_EQ(r->expert_budget, k);
    EXPECT_EQ(r->routed_pairs, 64 * k);
    const std::vector<float> b(back->bias().begin(), back->bias().end());
    EXPECT_TRUE(SameBits(r->out, local->Forward(x, 64, cfg.hidden, b.data())->out));
    break;
  }
  // The router exports the layer's budget.
  EXPECT_EQ(moe::testing::ScrapeSum((*cluster)->router_metrics(), "moe_expert_budget",
                                    {absl::StrCat("layer=\"", layer, "\"")}),
            static_cast<double>(k));
}

}  // namespace
}  // namespace moe
