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
#include "tests/services/cluster_test_base.h"

namespace moe {
namespace {

using tensor::Bf16;
using testing::SameBits;

int64_t Kept(const std::vector<int32_t>& ids) {
  int64_t n = 0;
  for (int32_t id : ids) n += id >= 0;
  return n;
}

// A mid cluster over the given expert ranges with the admin token "s3cret" and the attention
// node reporting every 100 ms, and the steps its tests share.
class ClusterDynamicK : public testing::ClusterTest {
 protected:
  void StartBudgetCluster(std::vector<std::pair<int64_t, int64_t>> ranges,
                          std::vector<std::string> attention_args = {}) {
    UsePreset("mid", std::move(ranges));
    options().admin_token = "s3cret";
    options().attention_args = {"--report_interval_ms=100"};
    for (auto& a : attention_args) options().attention_args.push_back(std::move(a));
    ASSERT_NO_FATAL_FAILURE(StartCluster());
  }
  int64_t k() const { return cfg().top_k; }

  // `tokens` tokens in 8 requests.
  void Traffic(int64_t tokens, uint64_t seed) {
    for (int i = 0; i < 8; ++i) ASSERT_TRUE(Forward(Hidden(tokens / 8, seed + i), tokens / 8).ok());
  }
  // Until the router's window under the current version holds `tokens` (bounded: reports
  // arrive every 100 ms).
  bool WindowHolds(int64_t tokens) {
    for (int i = 0; i < 100; ++i) {
      auto st = admin().GetLoadStats(layer());
      if (st.ok() && st->window_tokens() >= tokens) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }
  double StaleGauge() {
    return RouterMetric("moe_budget_thresholds_stale", {absl::StrCat("layer=\"", layer(), "\"")});
  }
  // The first answer to x under bias version `version` (ASSERTs that it comes, bounded).
  void ForwardUnderVersion(uint64_t version, const std::vector<Bf16>& x, int64_t tokens,
                           client::ForwardResult* out) {
    for (int i = 0; i < 100; ++i) {
      auto r = Forward(x, tokens);
      ASSERT_TRUE(r.ok()) << r.status();
      if (r->bias_version == version) {
        *out = std::move(*r);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    FAIL() << "the attention node never served version " << version;
  }

  // Before any traffic there is nothing to solve thresholds from: refused, saying so; out of
  // range and without the admin token, refused too.
  void ExpectNoBudgetBeforeTraffic() {
    auto early = admin().SetExpertBudget(layer(), 4);
    ASSERT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition) << early.status();
    EXPECT_NE(early.status().message().find("send traffic"), std::string::npos) << early.status();
    for (int32_t bad : {0, -1, static_cast<int32_t>(k()) + 1}) {
      EXPECT_EQ(admin().SetExpertBudget(layer(), bad).status().code(),
                absl::StatusCode::kInvalidArgument)
          << bad;
    }
    EXPECT_EQ(user().SetExpertBudget(layer(), 4).status().code(),
              absl::StatusCode::kPermissionDenied);
  }

  // Calibration traffic: 1024 tokens at the full top-k; then, with no thresholds yet, a cap
  // below k is refused naming the layer and a cap of k is the layer (4 tokens more).
  void Calibrate() {
    for (int i = 0; i < 8; ++i) {
      auto r = Forward(Hidden(128, 500 + i), 128);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->expert_budget, k());  // no budget yet: the full top-k
      EXPECT_EQ(r->routed_pairs, 128 * k());
    }
    const std::vector<Bf16> x = Hidden(4, 499);
    client::ForwardOptions capped;
    capped.expert_budget = 4;
    auto refused = Forward(x, 4, capped);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_NE(refused.status().message().find(absl::StrCat("layer ", layer(), " has no solved")),
              std::string::npos)
        << refused.status();
    capped.expert_budget = static_cast<int32_t>(k());
    auto full = Forward(x, 4, capped);
    ASSERT_TRUE(full.ok()) << full.status();
    EXPECT_EQ(full->expert_budget, k());
  }

  // Under a published budget with cap `cap` the node serves `served` experts per token, the
  // same selection, weights and bits as the oracle with those thresholds, on fresh tokens.
  void ExpectBudgetAsTheOracle(const v1::LayerBias& set, int32_t cap, int32_t served) {
    SCOPED_TRACE(absl::StrCat("cap ", cap));
    const int64_t tokens = 200;
    const std::vector<Bf16> x = Hidden(tokens, 900 + cap);
    client::ForwardOptions fo;
    fo.return_routing = true;
    fo.reply_mode = v1::REPLY_MODE_PER_PAIR;
    fo.expert_budget = cap;
    auto got = Forward(x, tokens, fo);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->bias_version, set.version());
    EXPECT_EQ(got->expert_budget, served);
    const std::vector<float> table(set.budget().thresholds().begin(),
                                   set.budget().thresholds().end());
    const std::vector<float> bias(set.bias().begin(), set.bias().end());
    const numerics::BudgetRule rule{1, numerics::BudgetRow(table, served, cfg().num_experts)};
    auto want = oracle().Forward(x, tokens, hidden(), bias.data(), nullptr,
                                 numerics::Precision::kW4A16, &rule);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got->expert_ids, want->routing.expert_ids);
    EXPECT_EQ(got->weights, want->routing.weights);
    EXPECT_TRUE(SameBits(got->out, want->out));
    EXPECT_EQ(got->routed_pairs, Kept(want->routing.expert_ids));
    const double per_token = static_cast<double>(got->routed_pairs) / tokens;
    std::printf("[dynamic k] cap %d: served budget %d, %.2f experts per token\n", cap,
                got->expert_budget, per_token);
    EXPECT_GT(per_token, 0.6 * served);  // thresholds from 1024 other tokens
    EXPECT_LT(per_token, 1.4 * served);
  }

  // Top-p by routing weight per request: bit for bit the oracle with the same rule, no
  // thresholds needed.
  void ExpectTopPAsTheOracle(const v1::LayerBias& set, double p) {
    SCOPED_TRACE(absl::StrCat("top-p ", p));
    const int64_t tokens = 64;
    const std::vector<Bf16> x = Hidden(tokens, 950);
    client::ForwardOptions fo;
    fo.return_routing = true;
    fo.expert_top_p = p;
    auto got = Forward(x, tokens, fo);
    ASSERT_TRUE(got.ok()) << got.status();
    numerics::BudgetRule rule;
    rule.k_min = 1;
    rule.top_p = p;
    const std::vector<float> bias(set.bias().begin(), set.bias().end());
    auto want = oracle().Forward(x, tokens, hidden(), bias.data(), nullptr,
                                 numerics::Precision::kW4A16, &rule);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got->expert_ids, want->routing.expert_ids);
    EXPECT_TRUE(SameBits(got->out, want->out));
    EXPECT_EQ(got->routed_pairs, Kept(want->routing.expert_ids));
    EXPECT_LT(got->routed_pairs, tokens * k());
    EXPECT_GT(got->routing_mass_kept, p - 1e-9);  // every token's kept share reaches p
    std::printf("[dynamic k] top-p %.1f: %.2f experts per token, weight kept %.3f\n", p,
                static_cast<double>(got->routed_pairs) / tokens, got->routing_mass_kept);
  }

  // Top-p outside [0, 1] or together with a cap, and a cap outside [0, k]: the caller's error.
  void ExpectBadRequestBudgetsRefused() {
    const std::vector<Bf16> probe = Hidden(4, 1);
    for (auto [p, cap] : {std::pair<double, int32_t>{1.5, 0}, {-0.1, 0}, {0.5, 2}, {0, 99}}) {
      client::ForwardOptions fo;
      fo.expert_top_p = p;
      fo.expert_budget = cap == 99 ? static_cast<int32_t>(k()) + 1 : cap;
      EXPECT_EQ(Forward(probe, 4, fo).status().code(), absl::StatusCode::kInvalidArgument)
          << p << " " << cap;
    }
  }
};

TEST_F(ClusterDynamicK, ServesThePublishedBudgetAsTheInProcessLayerDoes) {
  ASSERT_NO_FATAL_FAILURE(StartBudgetCluster({{0, 40}, {40, 128}}));
  ASSERT_NO_FATAL_FAILURE(ExpectNoBudgetBeforeTraffic());
  ASSERT_NO_FATAL_FAILURE(Calibrate());
  ASSERT_TRUE(WindowHolds(1024 + 4));  // the calibration and the k-cap request
  auto set = admin().SetExpertBudget(layer(), 4);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->budget().k_avg(), 4);
  EXPECT_EQ(set->budget().k_min(), 1);
  ASSERT_EQ(set->budget().thresholds_size(), (k() - 1) * cfg().num_experts);
  EXPECT_EQ(set->budget().solved_from_tokens(), 1024 + 4);
  EXPECT_NE(set->reason().find("budget 4 of 8"), std::string::npos) << set->reason();
  ASSERT_TRUE(AwaitBiasVersion(set->version()));  // through WatchBias

  // The layer's budget, a lower cap, a cap above the layer's (no effect).
  for (auto [cap, served] : {std::pair{0, 4}, {2, 2}, {7, 4}, {4, 4}}) {
    ExpectBudgetAsTheOracle(*set, cap, served);
  }
  for (double p : {0.3, 0.7}) ExpectTopPAsTheOracle(*set, p);
  ExpectBadRequestBudgetsRefused();

  // Reversible: back to the version before the budget, every token keeps k again, bit for bit
  // the layer without any budget.
  auto back = admin().RollbackBias(layer(), set->version() - 1);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->budget().k_avg(), k());
  const std::vector<Bf16> x = Hidden(64, 77);
  client::ForwardResult r;
  ASSERT_NO_FATAL_FAILURE(ForwardUnderVersion(back->version(), x, 64, &r));
  EXPECT_EQ(r.expert_budget, k());
  EXPECT_EQ(r.routed_pairs, 64 * k());
  const std::vector<float> b(back->bias().begin(), back->bias().end());
  EXPECT_TRUE(SameBits(r.out, Want(x, 64, b.data())));
  // The router exports the layer's budget.
  EXPECT_EQ(RouterMetric("moe_expert_budget", {absl::StrCat("layer=\"", layer(), "\"")}),
            static_cast<double>(k()));
}

// A QB step that moves the bias past --budget_stale_bias leaves the thresholds stale: the layer
// serves its full top-k, bit for bit the layer under the new bias without a budget, and a
// request's cap below k is refused saying why; the router solves them again from the next
// window by itself, and the budget is served again (through the real attention node's reports).
TEST_F(ClusterDynamicK, StaleThresholdsServeTheFullLayerUntilSolvedAgain) {
  ASSERT_NO_FATAL_FAILURE(StartBudgetCluster({{0, 64}, {64, 128}}));
  ASSERT_NO_FATAL_FAILURE(Traffic(1024, 300));
  ASSERT_TRUE(WindowHolds(1024));
  auto set = admin().SetExpertBudget(layer(), 4);
  ASSERT_TRUE(set.ok()) << set.status();
  ASSERT_FALSE(set->budget().stale());
  // The node's watch may lag a published version: traffic routed with the one before does not
  // count in the new window.
  ASSERT_TRUE(AwaitBiasVersion(set->version()));
  ASSERT_NO_FATAL_FAILURE(Traffic(1024, 400));
  ASSERT_TRUE(WindowHolds(1024));
  ASSERT_TRUE(admin().Rebalance(layer(), /*dry_run=*/false).ok());
  auto stale = admin().GetBias(layer());
  ASSERT_TRUE(stale.ok());
  ASSERT_TRUE(stale->budget().stale()) << stale->reason();
  const std::vector<float> bias(stale->bias().begin(), stale->bias().end());

  const std::vector<Bf16> x = Hidden(32, 77);
  client::ForwardResult r;
  ASSERT_NO_FATAL_FAILURE(ForwardUnderVersion(stale->version(), x, 32, &r));
  EXPECT_EQ(r.expert_budget, k());
  EXPECT_EQ(r.routed_pairs, 32 * k());
  EXPECT_TRUE(SameBits(r.out, Want(x, 32, bias.data())));
  client::ForwardOptions capped;
  capped.expert_budget = 2;
  auto refused = Forward(x, 32, capped);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("stale"), std::string::npos) << refused.status();
  EXPECT_EQ(StaleGauge(), 1.0);

  // The next window (as many tokens as the stale thresholds came from) solves them again.
  uint64_t fresh = 0;
  for (int round = 0; round < 6 && fresh == 0; ++round) {
    ASSERT_NO_FATAL_FAILURE(Traffic(512, 500 + 10 * round));
    for (int i = 0; i < 20 && fresh == 0; ++i) {
      auto b = admin().GetBias(layer());
      ASSERT_TRUE(b.ok());
      if (b->version() > stale->version()) {
        EXPECT_FALSE(b->budget().stale());
        EXPECT_EQ(b->budget().k_avg(), 4);
        EXPECT_EQ(std::vector<float>(b->bias().begin(), b->bias().end()), bias);
        fresh = b->version();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ASSERT_NE(fresh, 0u) << "the router never solved the stale thresholds again";
  ASSERT_NO_FATAL_FAILURE(ForwardUnderVersion(fresh, x, 32, &r));
  EXPECT_EQ(r.expert_budget, 4);
  EXPECT_LT(r.routed_pairs, 32 * k());
  EXPECT_EQ(StaleGauge(), 0.0);
}

// The automatic mode: one worker, eight requests in flight overload the node; its cap steps down
// toward the floor (responses say the lower budget), and back to the full top-k once the load
// stops; no request fails. The sampled full-k checks measure what the budget cost.
class ClusterDynamicKAuto : public ClusterDynamicK {
 protected:
  double Cap() { return AttentionMetric("moe_auto_expert_budget"); }

  // Eight requests in flight for 4 s: none fails, the cap steps down, fewer than k pairs per
  // token over the run.
  void Overload() {
    auto load = tools::RunLoad(admin(), Load(8, 32, absl::Seconds(4), 2000));
    ASSERT_TRUE(load.ok()) << load.status();
    std::printf("[dynamic k auto] overload: %s\n", load->Format().c_str());
    EXPECT_GT(load->ok, 0);
    EXPECT_EQ(load->ok, load->requests) << "no request fails while the budget steps";
    const std::string during = cluster().attention_metrics();
    const double down =
        testing::ScrapeSum(during, "moe_budget_steps_total", {"direction=\"down\""});
    EXPECT_GE(down, 1) << "the overload stepped the cap down";
    const double tokens =
        testing::ScrapeSum(during, "moe_budget_tokens_total", {"kind=\"tokens\""});
    const double pairs = testing::ScrapeSum(during, "moe_budget_tokens_total", {"kind=\"pairs\""});
    std::printf("[dynamic k auto] %.0f steps down, %.2f experts per token over the run\n", down,
                pairs / tokens);
    EXPECT_LT(pairs / tokens, static_cast<double>(k()));
  }

  // The sampled checks: measured, with a nonzero difference (a budget changes the output); in
  // users' terms, the routing weight the kept experts carry and how often a stand-in LM head's
  // top-1 stays, one observation per measured check, each a share in (0, 1]; a budget below k
  // drops experts: less than all of the weight (auto cap at the floor, 4 of 8).
  void ExpectTheChecksMeasuredTheCost() {
    const std::string after = cluster().attention_metrics();
    const double measured =
        testing::ScrapeSum(after, "moe_budget_checks_total",
                           {absl::StrCat("layer=\"", layer(), "\""), "outcome=\"measured\""});
    const double diff_sum = testing::ScrapeSum(after, "moe_budget_output_rel_diff_sum", {});
    const double diff_count = testing::ScrapeSum(after, "moe_budget_output_rel_diff_count", {});
    std::printf("[dynamic k auto] %.0f full-k checks measured, mean relative difference %.4f\n",
                measured, diff_count > 0 ? diff_sum / diff_count : 0.0);
    EXPECT_GE(measured, 1);
    EXPECT_EQ(diff_count, measured);
    EXPECT_GT(diff_sum, 0);
    EXPECT_LT(diff_sum / diff_count, 1.0);
    for (const char* family : {"moe_budget_routing_mass_kept", "moe_budget_top1_agreement"}) {
      const double count = testing::ScrapeSum(after, absl::StrCat(family, "_count"), {});
      const double sum = testing::ScrapeSum(after, absl::StrCat(family, "_sum"), {});
      std::printf("[dynamic k auto] %s: mean %.3f over %.0f checks\n", family,
                  count > 0 ? sum / count : 0.0, count);
      EXPECT_EQ(count, measured) << family;
      EXPECT_GT(sum, 0) << family;
      EXPECT_LE(sum, count) << family;
    }
    EXPECT_LT(testing::ScrapeSum(after, "moe_budget_routing_mass_kept_sum", {}),
              testing::ScrapeSum(after, "moe_budget_routing_mass_kept_count", {}));
  }
};

TEST_F(ClusterDynamicKAuto, TheAutomaticModeStepsDownUnderOverloadAndBackUp) {
  ASSERT_NO_FATAL_FAILURE(StartBudgetCluster(
      {{0, 64}, {64, 128}}, {"--workers=1", "--budget_auto_floor=3", "--budget_auto_queue=2",
                             "--budget_auto_interval_ms=100", "--budget_check_every=2"}));
  for (int i = 0; i < 4; ++i)
    ASSERT_TRUE(admin().Forward(layer(), Hidden(128, 700 + i), 128, hidden()).ok());
  // Thresholds solved, the layer's own budget the full top-k: only the automatic mode limits.
  absl::StatusOr<v1::LayerBias> set = absl::UnknownError("not set");
  for (int i = 0; i < 100 && !set.ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    set = admin().SetExpertBudget(layer(), static_cast<int32_t>(k()));
  }
  ASSERT_TRUE(set.ok()) << set.status();
  ASSERT_EQ(set->budget().thresholds_size(), (k() - 1) * cfg().num_experts);
  EXPECT_EQ(Cap(), static_cast<double>(k()));
  ASSERT_NO_FATAL_FAILURE(Overload());

  // Quiet again: back up to the full top-k within a bounded wait.
  double cap = Cap();
  for (int i = 0; i < 100 && cap < k(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    cap = Cap();
  }
  EXPECT_EQ(cap, static_cast<double>(k()));
  EXPECT_GE(AttentionMetric("moe_budget_steps_total", {"direction=\"up\""}), 1);
  auto quiet = admin().Forward(layer(), Hidden(8, 3), 8, hidden());
  ASSERT_TRUE(quiet.ok()) << quiet.status();
  EXPECT_EQ(quiet->expert_budget, k());
  ExpectTheChecksMeasuredTheCost();
}

}  // namespace
}  // namespace moe
