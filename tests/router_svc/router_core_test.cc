// router-svc's core on its own (router_core.h), no gRPC server: its operations called as the
// gRPC adapter and the page call them, what it publishes read from its sinks. Registrations,
// leases and expiry; the attention core's own reports (attention-svc/node_stats.h, from routing
// a skewed synthetic layer) taken into the window, a Rebalance that lowers the window's
// predicted MaxVio, a report of the old version kept out of the new window, and a rollback that
// publishes the checkpoint's bias again.
#include "router-svc/router_core.h"

#include <gtest/gtest.h>

#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "attention-svc/node_stats.h"
#include "router-svc/router_server.h"
#include "services/checkpoint/synthetic.h"
#include "services/numerics/cpu/moe_layer.h"
#include "tests/common/tiny_checkpoint.h"

namespace moe::router_svc {
namespace {

class RouterCoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    RouterServerOptions o;
    o.checkpoint = moe::testing::TinyCheckpoint();
    o.heartbeat_interval_ms = 100;
    auto core = RouterCore::Load(o);
    ASSERT_TRUE(core.ok()) << core.status();
    core_ = std::move(*core);
    core_->SetSinks({[this](const v1::Placement& p) {
                       std::lock_guard<std::mutex> lock(mu_);
                       placements_.push_back(p);
                     },
                     [this](const v1::LayerBias& b) {
                       std::lock_guard<std::mutex> lock(mu_);
                       biases_.push_back(b);
                     }});
  }

  v1::Placement LastPlacement() {
    std::lock_guard<std::mutex> lock(mu_);
    return placements_.empty() ? v1::Placement() : placements_.back();
  }

  static v1::RegisterExpertServerRequest Shard(const std::string& name, const std::string& ep) {
    v1::RegisterExpertServerRequest reg;
    reg.set_shard(name);
    reg.set_endpoint(ep);
    v1::ExpertRange* r = reg.add_ranges();
    r->set_layer(1);
    r->set_expert_lo(0);
    r->set_expert_hi(16);
    return reg;
  }

  std::unique_ptr<RouterCore> core_;
  std::mutex mu_;
  std::vector<v1::Placement> placements_;
  std::vector<v1::LayerBias> biases_;
};

TEST_F(RouterCoreTest, LeasesLiveByHeartbeatsAndAreNeverTakenWhileTheyLive) {
  v1::RegisterExpertServerResponse lease;
  ASSERT_TRUE(core_->Register(Shard("shard-a", "127.0.0.1:1"), &lease).ok());
  EXPECT_EQ(core_->LeaseOwner(lease.lease_id()), "shard-a");
  v1::Placement p = LastPlacement();
  ASSERT_EQ(p.shards_size(), 1);
  EXPECT_TRUE(p.shards(0).healthy());
  v1::RegisterExpertServerResponse again;
  EXPECT_EQ(core_->Register(Shard("shard-a", "127.0.0.1:2"), &again).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(core_->Register(Shard("../etc", "127.0.0.1:3"), &again).code(),
            absl::StatusCode::kInvalidArgument);
  v1::HeartbeatRequest hb;
  hb.set_lease_id(lease.lease_id() + 99);
  EXPECT_EQ(core_->Heartbeat(hb).code(), absl::StatusCode::kNotFound);
  // Silent longer than the bound: published unhealthy; a heartbeat revives it.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  core_->ExpireStale(std::chrono::milliseconds(10));
  p = LastPlacement();
  ASSERT_EQ(p.shards_size(), 1);
  EXPECT_FALSE(p.shards(0).healthy());
  hb.set_lease_id(lease.lease_id());
  ASSERT_TRUE(core_->Heartbeat(hb).ok());
  EXPECT_TRUE(core_->Placement().shards(0).healthy());
  // Subscribe sees the same state the sinks published.
  int seen = 0;
  core_->Subscribe([&](const v1::Placement& now, const std::vector<v1::LayerBias>& biases) {
    seen = now.shards_size();
    EXPECT_FALSE(biases.empty());
  });
  EXPECT_EQ(seen, 1);
}

TEST_F(RouterCoreTest, TheAttentionCoresReportsRebalanceAndARollbackRestoresTheCheckpoint) {
  const ModelConfig cfg = *PresetConfig("tiny");
  auto v0 = core_->Bias(1);
  ASSERT_TRUE(v0.ok()) << v0.status();
  EXPECT_EQ(v0->version(), 0u);
  const std::vector<float> bias0(v0->bias().begin(), v0->bias().end());
  // An attention node routing a skewed layer under version 0, its statistics as it reports them.
  checkpoint::SyntheticOptions so;
  so.seed = 3;
  so.router_skew = 4.0;
  auto layer = numerics::cpu::CpuMoeLayer::Create(cfg, checkpoint::SyntheticLayer(cfg, 1, so), {});
  ASSERT_TRUE(layer.ok());
  attention_svc::NodeStats stats({cfg.num_experts, cfg.top_k, 1000, 512});
  attention_svc::BiasEntry entry;
  entry.bias = bias0;
  entry.k_avg = static_cast<int32_t>(cfg.top_k);
  const int64_t tokens = 2048;
  const std::vector<tensor::Bf16> x = checkpoint::SyntheticHiddenStates(cfg, tokens, 11);
  auto batch = (*layer)->RouteAndProject(x, tokens, cfg.hidden, bias0.data(), nullptr);
  ASSERT_TRUE(batch.ok()) << batch.status();
  stats.Accumulate(1, entry, batch->scores, batch->tokens, batch->routing);
  std::vector<v1::ReportStatsRequest> reports = stats.TakeReports("attention-0", 0);
  ASSERT_EQ(reports.size(), 1u);
  v1::ReportStatsResponse accepted;
  ASSERT_TRUE(core_->ReportStats(reports[0], &accepted).ok());
  EXPECT_TRUE(accepted.accepted_for_window());
  v1::LoadStats load;
  ASSERT_TRUE(core_->LoadStats(1, &load).ok());
  EXPECT_EQ(load.window_tokens(), tokens);
  v1::RebalanceResponse rebalance;
  ASSERT_TRUE(core_->Rebalance(1, /*dry_run=*/false, "test", &rebalance).ok());
  EXPECT_TRUE(rebalance.applied());
  EXPECT_EQ(rebalance.new_bias().version(), 1u);
  EXPECT_GT(rebalance.before().max_vio(), 2 * rebalance.noise_floor_max_vio())
      << "the layer was meant to be skewed past the window's noise";
  std::printf("MaxVio before %.3f, predicted after %.3f (noise floor %.3f)\n",
              rebalance.before().max_vio(), rebalance.predicted_after().max_vio(),
              rebalance.noise_floor_max_vio());
  EXPECT_LT(rebalance.predicted_after().max_vio(), rebalance.before().max_vio() / 2);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ASSERT_FALSE(biases_.empty());
    EXPECT_EQ(biases_.back().version(), 1u);
  }
  // A report routed with version 0 now is stale: taken, not counted in the new window.
  ASSERT_TRUE(core_->ReportStats(reports[0], &accepted).ok());
  EXPECT_FALSE(accepted.accepted_for_window());
  EXPECT_EQ(accepted.current_bias_version(), 1u);
  // Rolled back to version 0: a new version carrying the checkpoint's bias again.
  v1::LayerBias rolled;
  ASSERT_TRUE(core_->Rollback(1, 0, &rolled).ok());
  EXPECT_EQ(rolled.version(), 2u);
  ASSERT_EQ(rolled.bias_size(), static_cast<int>(bias0.size()));
  for (size_t e = 0; e < bias0.size(); ++e) EXPECT_EQ(rolled.bias(static_cast<int>(e)), bias0[e]);
  EXPECT_EQ(core_->Rollback(1, 99, &rolled).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(core_->Rebalance(7, true, "test", &rebalance).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace moe::router_svc

namespace moe::router_svc {
namespace {

// The attention nodes' own state on the page: what a node reported, and nothing malformed.
TEST_F(RouterCoreTest, NodeReportsReachThePageAndMalformedOnesAreRefused) {
  v1::ReportNodeRequest r;
  r.set_node("attention-0");
  r.set_canary_outcome("match");
  r.set_canary_ready(true);
  r.set_canary_age_ms(1200);
  r.set_audits_agree(5);
  r.set_audits_caught(1);
  r.add_quarantined("shard-3");
  ASSERT_TRUE(core_->ReportNode(r).ok());
  auto state = core_->PageApi().state(1);
  ASSERT_TRUE(state.ok()) << state.status();
  const nlohmann::json& nodes = (*state)["nodes"];
  ASSERT_EQ(nodes.size(), 1u);
  EXPECT_EQ(nodes[0]["node"], "attention-0");
  EXPECT_EQ(nodes[0]["canary"], "match");
  EXPECT_EQ(nodes[0]["canary_ready"], true);
  EXPECT_EQ(nodes[0]["audits"]["agree"], 5);
  EXPECT_EQ(nodes[0]["audits"]["caught"], 1);
  EXPECT_EQ(nodes[0]["quarantined"][0], "shard-3");
  // Every outcome a node's canary has (readiness_canary.h), "busy" too.
  for (const char* outcome : {"mismatch", "timeout", "error", "skipped", "busy", "off"}) {
    v1::ReportNodeRequest o = r;
    o.set_canary_outcome(outcome);
    EXPECT_TRUE(core_->ReportNode(o).ok()) << outcome;
  }

  auto refused = [&](v1::ReportNodeRequest bad) {
    return core_->ReportNode(bad).code() == absl::StatusCode::kInvalidArgument;
  };
  v1::ReportNodeRequest bad = r;
  bad.set_node("<script>");
  EXPECT_TRUE(refused(bad));
  bad = r;
  bad.set_canary_outcome("<b>ok</b>");
  EXPECT_TRUE(refused(bad));
  bad = r;
  bad.set_audits_skipped(-1);
  EXPECT_TRUE(refused(bad));
  bad = r;
  bad.add_quarantined("a b");
  EXPECT_TRUE(refused(bad));
  bad = r;
  for (int i = 0; i < 65; ++i) bad.add_quarantined("shard-" + std::to_string(i));
  EXPECT_TRUE(refused(bad));
  // At most 64 nodes at once.
  for (int i = 1; i < 64; ++i) {
    r.set_node("attention-" + std::to_string(i));
    ASSERT_TRUE(core_->ReportNode(r).ok()) << i;
  }
  r.set_node("attention-64");
  EXPECT_EQ(core_->ReportNode(r).code(), absl::StatusCode::kResourceExhausted);
  r.set_node("attention-0");  // a known one still reports
  EXPECT_TRUE(core_->ReportNode(r).ok());
  EXPECT_EQ((*core_->PageApi().state(1))["nodes"].size(), 64u);
}

}  // namespace
}  // namespace moe::router_svc
