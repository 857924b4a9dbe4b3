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
#include "services/tools/load_generator.h"
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

// A mid cluster over these expert ranges with the admin token "s3cret" and the attention node
// reporting every 100 ms.
absl::StatusOr<std::unique_ptr<LocalCluster>> StartBudgetCluster(
    std::vector<std::pair<int64_t, int64_t>> ranges) {
  LocalClusterOptions o = TestCluster(CheckpointFor("mid"), std::move(ranges));
  o.admin_token = "s3cret";
  o.attention_args = {"--report_interval_ms=100"};
  return LocalCluster::Start(o);
}

TEST(ClusterDynamicK, ServesThePublishedBudgetAsTheInProcessLayerDoes) {
  ModelConfig cfg;
  auto local = InProcessLayer(CheckpointFor("mid"), &cfg);
  const int64_t k = cfg.top_k, e = cfg.num_experts;
  auto cluster = StartBudgetCluster({{0, 40}, {40, 128}});
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
  {  // No thresholds yet: a cap below k is refused naming the layer; a cap of k is the layer.
    const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, 4, 499);
    client::ForwardOptions capped;
    capped.expert_budget = 4;
    auto refused = user->Forward(layer, x, 4, cfg.hidden, capped);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_NE(refused.status().message().find(absl::StrCat("layer ", layer, " has no solved")),
              std::string::npos)
        << refused.status();
    capped.expert_budget = static_cast<int32_t>(k);
    auto full = user->Forward(layer, x, 4, cfg.hidden, capped);
    ASSERT_TRUE(full.ok()) << full.status();
    EXPECT_EQ(full->expert_budget, k);
  }
  v1::LayerBias set;
  for (int i = 0; i < 100; ++i) {  // bounded: reports every 100 ms
    auto s = admin->GetLoadStats(layer);
    ASSERT_TRUE(s.ok()) << s.status();
    if (s->window_tokens() >= 1024 + 4) break;  // the calibration and the k-cap request
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  auto applied = admin->SetExpertBudget(layer, 4);
  ASSERT_TRUE(applied.ok()) << applied.status();
  set = *applied;
  EXPECT_EQ(set.budget().k_avg(), 4);
  EXPECT_EQ(set.budget().k_min(), 1);
  ASSERT_EQ(set.budget().thresholds_size(), (k - 1) * e);
  EXPECT_EQ(set.budget().solved_from_tokens(), 1024 + 4);
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
  // The second mode per request: top-p by routing weight, bit for bit the in-process layer with
  // the same rule, no thresholds needed; outside [0, 1] or together with a cap, refused.
  for (double p : {0.3, 0.7}) {
    const int64_t tokens = 64;
    const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, tokens, 950);
    client::ForwardOptions fo;
    fo.return_routing = true;
    fo.expert_top_p = p;
    auto got = user->Forward(layer, x, tokens, cfg.hidden, fo);
    ASSERT_TRUE(got.ok()) << got.status();
    numerics::BudgetRule rule;
    rule.k_min = 1;
    rule.top_p = p;
    auto want = local->Forward(x, tokens, cfg.hidden, bias.data(), nullptr,
                               numerics::Precision::kW4A16, &rule);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got->expert_ids, want->routing.expert_ids) << p;
    EXPECT_TRUE(SameBits(got->out, want->out)) << p;
    EXPECT_EQ(got->routed_pairs, Kept(want->routing.expert_ids)) << p;
    EXPECT_LT(got->routed_pairs, tokens * k) << p;
    EXPECT_GT(got->routing_mass_kept, p - 1e-9) << p;  // every token's kept share reaches p
    std::printf("[dynamic k] top-p %.1f: %.2f experts per token, weight kept %.3f\n", p,
                static_cast<double>(got->routed_pairs) / tokens, got->routing_mass_kept);
  }
  for (auto [p, cap] : {std::pair<double, int32_t>{1.5, 0}, {-0.1, 0}, {0.5, 2}}) {
    client::ForwardOptions fo;
    fo.expert_top_p = p;
    fo.expert_budget = cap;
    EXPECT_EQ(user->Forward(layer, probe, 4, cfg.hidden, fo).status().code(),
              absl::StatusCode::kInvalidArgument)
        << p << " " << cap;
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

// A QB step that moves the bias past --budget_stale_bias leaves the thresholds stale: the layer
// serves its full top-k, bit for bit the layer under the new bias without a budget, and a
// request's cap below k is refused saying why; the router solves them again from the next
// window by itself, and the budget is served again (through the real attention node's reports).
TEST(ClusterDynamicK, StaleThresholdsServeTheFullLayerUntilSolvedAgain) {
  ModelConfig cfg;
  auto local = InProcessLayer(CheckpointFor("mid"), &cfg);
  const int64_t k = cfg.top_k;
  auto cluster = StartBudgetCluster({{0, 64}, {64, 128}});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto admin = ClientFor(**cluster, "s3cret");
  auto user = ClientFor(**cluster);
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);
  // Traffic until the router's window under the current version holds `tokens`.
  auto traffic = [&](int64_t tokens, uint64_t seed) {
    for (int i = 0; i < 8; ++i) {
      const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, tokens / 8, seed + i);
      ASSERT_TRUE(user->Forward(layer, x, tokens / 8, cfg.hidden).ok());
    }
  };
  auto window_holds = [&](int64_t tokens) {
    for (int i = 0; i < 100; ++i) {
      auto st = admin->GetLoadStats(layer);
      if (st.ok() && st->window_tokens() >= tokens) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  };
  // Until the attention node routes with version v (its watch may lag a published version:
  // traffic routed with the one before does not count in the new window).
  auto routes_with = [&](uint64_t v) {
    const std::vector<Bf16> one = checkpoint::SyntheticHiddenStates(cfg, 1, 9);
    for (int i = 0; i < 100; ++i) {
      auto r = user->Forward(layer, one, 1, cfg.hidden);
      if (r.ok() && r->bias_version == v) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  };
  traffic(1024, 300);
  ASSERT_TRUE(window_holds(1024));
  auto set = admin->SetExpertBudget(layer, 4);
  ASSERT_TRUE(set.ok()) << set.status();
  ASSERT_FALSE(set->budget().stale());
  ASSERT_TRUE(routes_with(set->version()));
  traffic(1024, 400);
  ASSERT_TRUE(window_holds(1024));
  auto step = admin->Rebalance(layer, /*dry_run=*/false);
  ASSERT_TRUE(step.ok()) << step.status();
  auto stale = admin->GetBias(layer);
  ASSERT_TRUE(stale.ok());
  ASSERT_TRUE(stale->budget().stale()) << stale->reason();
  const std::vector<float> bias(stale->bias().begin(), stale->bias().end());

  const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, 32, 77);
  bool seen = false;
  for (int i = 0; i < 100 && !seen; ++i) {
    auto r = user->Forward(layer, x, 32, cfg.hidden);
    ASSERT_TRUE(r.ok()) << r.status();
    if (r->bias_version != stale->version()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    seen = true;
    EXPECT_EQ(r->expert_budget, k);
    EXPECT_EQ(r->routed_pairs, 32 * k);
    EXPECT_TRUE(SameBits(r->out, local->Forward(x, 32, cfg.hidden, bias.data())->out));
    client::ForwardOptions capped;
    capped.expert_budget = 2;
    auto refused = user->Forward(layer, x, 32, cfg.hidden, capped);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_NE(refused.status().message().find("stale"), std::string::npos) << refused.status();
  }
  ASSERT_TRUE(seen) << "the attention node never served the stale version";
  EXPECT_EQ(moe::testing::ScrapeSum((*cluster)->router_metrics(), "moe_budget_thresholds_stale",
                                    {absl::StrCat("layer=\"", layer, "\"")}),
            1.0);

  // The next window (as many tokens as the stale thresholds came from) solves them again.
  uint64_t fresh = 0;
  for (int round = 0; round < 6 && fresh == 0; ++round) {
    traffic(512, 500 + 10 * round);
    for (int i = 0; i < 20 && fresh == 0; ++i) {
      auto b = admin->GetBias(layer);
      ASSERT_TRUE(b.ok());
      if (b->version() > stale->version()) {
        EXPECT_FALSE(b->budget().stale());
        EXPECT_EQ(b->budget().k_avg(), 4);
        EXPECT_EQ(std::vector<float>(b->bias().begin(), b->bias().end()), bias);
        fresh = b->version();
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ASSERT_NE(fresh, 0u) << "the router never solved the stale thresholds again";
  for (int i = 0; i < 100; ++i) {
    auto r = user->Forward(layer, x, 32, cfg.hidden);
    ASSERT_TRUE(r.ok()) << r.status();
    if (r->bias_version != fresh) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    EXPECT_EQ(r->expert_budget, 4);
    EXPECT_LT(r->routed_pairs, 32 * k);
    break;
  }
  EXPECT_EQ(moe::testing::ScrapeSum((*cluster)->router_metrics(), "moe_budget_thresholds_stale",
                                    {absl::StrCat("layer=\"", layer, "\"")}),
            0.0);
}

// The automatic mode: one worker, eight requests in flight overload the node; its cap steps down
// toward the floor (responses say the lower budget), and back to the full top-k once the load
// stops; no request fails. The sampled full-k checks measure what the budget cost.
TEST(ClusterDynamicK, TheAutomaticModeStepsDownUnderOverloadAndBackUp) {
  const std::string& dir = CheckpointFor("mid");
  ModelConfig cfg = *PresetConfig("mid");
  const int64_t k = cfg.top_k;
  LocalClusterOptions o = TestCluster(dir, {{0, 64}, {64, 128}});
  o.admin_token = "s3cret";
  o.attention_args = {"--report_interval_ms=100",      "--workers=1",
                      "--budget_auto_floor=3",         "--budget_auto_queue=2",
                      "--budget_auto_interval_ms=100", "--budget_check_every=2"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto admin = ClientFor(**cluster, "s3cret");
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);
  for (int i = 0; i < 4; ++i) {
    const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, 128, 700 + i);
    ASSERT_TRUE(admin->Forward(layer, x, 128, cfg.hidden).ok());
  }
  // Thresholds solved, the layer's own budget the full top-k: only the automatic mode limits.
  absl::StatusOr<v1::LayerBias> set = absl::UnknownError("not set");
  for (int i = 0; i < 100 && !set.ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    set = admin->SetExpertBudget(layer, static_cast<int32_t>(k));
  }
  ASSERT_TRUE(set.ok()) << set.status();
  ASSERT_EQ(set->budget().thresholds_size(), (k - 1) * cfg.num_experts);
  auto gauge = [&] {
    return moe::testing::ScrapeSum((*cluster)->attention_metrics(), "moe_auto_expert_budget", {});
  };
  EXPECT_EQ(gauge(), static_cast<double>(k));

  tools::LoadOptions lo;
  lo.layer = layer;
  lo.hidden = cfg.hidden;
  lo.concurrency = 8;
  lo.tokens = 32;
  lo.duration = absl::Seconds(4);
  lo.max_requests = 2000;
  auto load = tools::RunLoad(*admin, lo);
  ASSERT_TRUE(load.ok()) << load.status();
  std::printf("[dynamic k auto] overload: %s\n", load->Format().c_str());
  EXPECT_GT(load->ok, 0);
  EXPECT_EQ(load->ok, load->requests) << "no request fails while the budget steps";
  const std::string during = (*cluster)->attention_metrics();
  const double down =
      moe::testing::ScrapeSum(during, "moe_budget_steps_total", {"direction=\"down\""});
  EXPECT_GE(down, 1) << "the overload stepped the cap down";
  // Pairs per token over the run fell below k.
  const double tokens =
      moe::testing::ScrapeSum(during, "moe_budget_tokens_total", {"kind=\"tokens\""});
  const double pairs =
      moe::testing::ScrapeSum(during, "moe_budget_tokens_total", {"kind=\"pairs\""});
  std::printf("[dynamic k auto] %.0f steps down, %.2f experts per token over the run\n", down,
              pairs / tokens);
  EXPECT_LT(pairs / tokens, static_cast<double>(k));

  // Quiet again: back up to the full top-k within a bounded wait.
  double cap = gauge();
  for (int i = 0; i < 100 && cap < k; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    cap = gauge();
  }
  EXPECT_EQ(cap, static_cast<double>(k));
  const std::string after = (*cluster)->attention_metrics();
  EXPECT_GE(moe::testing::ScrapeSum(after, "moe_budget_steps_total", {"direction=\"up\""}), 1);
  const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, 8, 3);
  auto quiet = admin->Forward(layer, x, 8, cfg.hidden);
  ASSERT_TRUE(quiet.ok()) << quiet.status();
  EXPECT_EQ(quiet->expert_budget, k);

  // The sampled checks: measured, with a nonzero difference (a budget changes the output).
  const double measured =
      moe::testing::ScrapeSum(after, "moe_budget_checks_total",
                              {absl::StrCat("layer=\"", layer, "\""), "outcome=\"measured\""});
  const double diff_sum = moe::testing::ScrapeSum(after, "moe_budget_output_rel_diff_sum", {});
  const double diff_count = moe::testing::ScrapeSum(after, "moe_budget_output_rel_diff_count", {});
  std::printf("[dynamic k auto] %.0f full-k checks measured, mean relative difference %.4f\n",
              measured, diff_count > 0 ? diff_sum / diff_count : 0.0);
  EXPECT_GE(measured, 1);
  EXPECT_EQ(diff_count, measured);
  EXPECT_GT(diff_sum, 0);
  EXPECT_LT(diff_sum / diff_count, 1.0);
  // In users' terms: the routing weight the kept experts carry, and how often a stand-in LM
  // head's top-1 stays, one observation per measured check, each a share in (0, 1].
  for (const char* family : {"moe_budget_routing_mass_kept", "moe_budget_top1_agreement"}) {
    const double count = moe::testing::ScrapeSum(after, absl::StrCat(family, "_count"), {});
    const double sum = moe::testing::ScrapeSum(after, absl::StrCat(family, "_sum"), {});
    std::printf("[dynamic k auto] %s: mean %.3f over %.0f checks\n", family,
                count > 0 ? sum / count : 0.0, count);
    EXPECT_EQ(count, measured) << family;
    EXPECT_GT(sum, 0) << family;
    EXPECT_LE(sum, count) << family;
  }
  // A budget below k drops experts: less than all of the weight (auto cap at the floor, 4 of 8).
  EXPECT_LT(moe::testing::ScrapeSum(after, "moe_budget_routing_mass_kept_sum", {}),
            moe::testing::ScrapeSum(after, "moe_budget_routing_mass_kept_count", {}));
}

}  // namespace
}  // namespace moe
