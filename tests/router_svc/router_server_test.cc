// router-svc as a library in this process, driven through its gRPC stub: placement with
// heartbeats and health, the watch streams, statistics windows, Quantile Balancing on
// Rebalance (oracle: QbHistogram::Solve on the same reports), modes, rollback, the admin token.
#include "router-svc/router_server.h"

#include <grpcpp/grpcpp.h>
#include <sys/stat.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <memory>
#include <optional>
#include <thread>

#include "gtest/gtest.h"
#include "moe/v1/router.grpc.pb.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/synthetic.h"
#include "services/common/random.h"
#include "services/numerics/qb.h"
#include "services/transport/grpc_server.h"
#include "services/transport/security.h"
#include "tests/common/tiny_checkpoint.h"
#include "tests/router_svc/router_fixture.h"

namespace moe::router_svc {
namespace {

using moe::testing::TinyCheckpoint;

TEST(RouterServer, PlacementHealthFromHeartbeatsAndTheWatchStream) {
  RouterServerOptions o;
  o.heartbeat_interval_ms = 100;
  Router r(o);
  auto watch_ctx = r.Ctx();
  auto watch = r->WatchPlacement(watch_ctx.get(), v1::GetPlacementRequest());
  v1::Placement p;
  ASSERT_TRUE(watch->Read(&p));
  EXPECT_EQ(p.shards_size(), 0);

  v1::RegisterExpertServerRequest reg;
  reg.set_shard("shard-a");
  reg.set_endpoint("127.0.0.1:1");
  auto* range = reg.add_ranges();
  range->set_layer(1);
  range->set_expert_lo(0);
  range->set_expert_hi(16);
  v1::RegisterExpertServerResponse lease;
  ASSERT_TRUE(r->RegisterExpertServer(r.Ctx().get(), reg, &lease).ok());
  EXPECT_EQ(lease.heartbeat_interval_ms(), 100);
  ASSERT_TRUE(watch->Read(&p));
  ASSERT_EQ(p.shards_size(), 1);
  EXPECT_EQ(p.shards(0).shard(), "shard-a");
  EXPECT_TRUE(p.shards(0).healthy());

  v1::HeartbeatRequest hb;
  hb.set_lease_id(lease.lease_id());
  v1::HeartbeatResponse hr;
  EXPECT_TRUE(r->Heartbeat(r.Ctx().get(), hb, &hr).ok());
  v1::HeartbeatRequest unknown;
  unknown.set_lease_id(lease.lease_id() + 100);
  EXPECT_EQ(r->Heartbeat(r.Ctx().get(), unknown, &hr).error_code(), grpc::StatusCode::NOT_FOUND);

  // No heartbeats for 3 intervals: the watch reports it unhealthy; one heartbeat revives it.
  ASSERT_TRUE(watch->Read(&p));
  EXPECT_FALSE(p.shards(0).healthy());
  EXPECT_GE(p.shards(0).last_seen_ms(), 300);
  EXPECT_TRUE(r->Heartbeat(r.Ctx().get(), hb, &hr).ok());
  ASSERT_TRUE(watch->Read(&p));
  EXPECT_TRUE(p.shards(0).healthy());

  // While its lease lives, no other registration takes its name, even with its own token (a
  // second process under a live shard's name); once its heartbeats stop for 3 intervals, a
  // registration under the name replaces the entry (a restarted pod).
  reg.set_endpoint("127.0.0.1:2");
  v1::RegisterExpertServerResponse lease2;
  grpc::Status taken = r->RegisterExpertServer(r.Ctx().get(), reg, &lease2);
  EXPECT_EQ(taken.error_code(), grpc::StatusCode::ALREADY_EXISTS) << taken.error_message();
  EXPECT_NE(taken.error_message().find("shard shard-a is registered at 127.0.0.1:1 under a live "
                                       "lease"),
            std::string::npos)
      << taken.error_message();
  std::this_thread::sleep_for(std::chrono::milliseconds(350));
  ASSERT_TRUE(r->RegisterExpertServer(r.Ctx().get(), reg, &lease2).ok());
  EXPECT_NE(lease2.lease_id(), lease.lease_id());
  EXPECT_EQ(r->Heartbeat(r.Ctx().get(), hb, &hr).error_code(), grpc::StatusCode::NOT_FOUND);
  v1::Placement now;
  ASSERT_TRUE(r->GetPlacement(r.Ctx().get(), v1::GetPlacementRequest(), &now).ok());
  ASSERT_EQ(now.shards_size(), 1);
  EXPECT_EQ(now.shards(0).endpoint(), "127.0.0.1:2");

  range->set_expert_hi(99);
  EXPECT_EQ(r->RegisterExpertServer(r.Ctx().get(), reg, &lease2).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  watch_ctx->TryCancel();
}

// Skewed sigmoid scores [m, n] (expert j's logits shifted by 2 * (j / n)^3).
std::vector<float> Scores(int64_t m, int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> s(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double off = 2.0 * std::pow(static_cast<double>(j) / n, 3.0);
      s[i * n + j] = static_cast<float>(1.0 / (1.0 + std::exp(-(rng.Normal() + off))));
    }
  }
  return s;
}

numerics::QbHistogram Histogram(uint64_t version, const std::vector<float>& bias, int64_t m,
                                uint64_t seed, int32_t layer = 1) {
  numerics::QbWindow w;
  w.window_id = version;
  w.bias_version = version;
  w.layer = layer;
  w.top_k = 4;
  w.bins = 200;
  auto h = numerics::QbHistogram::Create(w, bias);
  EXPECT_TRUE(h.ok());
  EXPECT_TRUE(h->Accumulate(Scores(m, 16, seed), m).ok());
  return std::move(*h);
}

v1::ReportStatsRequest Report(const numerics::QbHistogram& h) {
  v1::ReportStatsRequest r;
  r.set_node("test");
  r.set_layer(h.window().layer);
  r.set_bias_version(h.window().bias_version);
  r.set_tokens(h.tokens());
  *r.mutable_loads() = {h.loads().begin(), h.loads().end()};
  r.set_qb_histogram(h.Serialize());
  return r;
}

// One router with the admin token "t0k" and a WatchBias stream on layer 1, through windows,
// Rebalance, the modes and rollback, one step per method.
class RouterWindows : public ::testing::Test {
 protected:
  RouterWindows()
      : r_([] {
          RouterServerOptions o;
          o.admin_token = "t0k";
          return o;
        }()) {
    gs_.set_layer(1);
    rb_.set_layer(1);
    sm_.set_layer(1);
  }
  void TearDown() override {
    if (bias_ctx_ != nullptr) bias_ctx_->TryCancel();
  }

  // Version 0 is the checkpoint's bias; a layer not hosted is NOT_FOUND; Rebalance before any
  // traffic is refused; the watch starts at version 0.
  void ExpectTheCheckpointsBias() {
    v1::GetBiasRequest gb;
    gb.set_layer(1);
    v1::LayerBias b0;
    ASSERT_TRUE(r_->GetBias(r_.Ctx().get(), gb, &b0).ok());
    EXPECT_EQ(b0.version(), 0u);
    EXPECT_EQ(b0.reason(), "checkpoint");
    auto ckpt = checkpoint::Checkpoint::Open(TinyCheckpoint());
    bias0_ = checkpoint::LoadMoeLayer(**ckpt, *PresetConfig("tiny"), 1, {})->bias;
    EXPECT_EQ(std::vector<float>(b0.bias().begin(), b0.bias().end()), bias0_);
    gb.set_layer(7);
    EXPECT_EQ(r_->GetBias(r_.Ctx().get(), gb, &b0).error_code(), grpc::StatusCode::NOT_FOUND);
    v1::RebalanceResponse rr;
    EXPECT_EQ(r_->Rebalance(r_.Ctx(kTok).get(), rb_, &rr).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);  // no traffic yet
    bias_ctx_ = r_.Ctx();
    v1::WatchBiasRequest wb;
    wb.add_layers(1);
    bias_watch_ = r_->WatchBias(bias_ctx_.get(), wb);
    ASSERT_TRUE(bias_watch_->Read(&seen_));
    EXPECT_EQ(seen_.version(), 0u);
  }

  grpc::StatusCode ReportCode(const v1::ReportStatsRequest& req) {
    v1::ReportStatsResponse ack;
    return r_->ReportStats(r_.Attention().get(), req, &ack).error_code();
  }

  // Two nodes' reports of version 0 pooled in the window (bad reports refused, changing
  // nothing): loads and MaxVio of the merged histograms.
  void ReportTwoNodes() {
    h1_.emplace(Histogram(0, bias0_, 1500, 1));
    const numerics::QbHistogram h2 = Histogram(0, bias0_, 900, 2);
    v1::ReportStatsResponse ack;
    ASSERT_TRUE(r_->ReportStats(r_.Attention().get(), Report(*h1_), &ack).ok());
    EXPECT_TRUE(ack.accepted_for_window());
    ASSERT_TRUE(r_->ReportStats(r_.Attention().get(), Report(h2), &ack).ok());
    v1::ReportStatsRequest bad = Report(*h1_);
    bad.mutable_loads()->RemoveLast();
    EXPECT_EQ(ReportCode(bad), grpc::StatusCode::INVALID_ARGUMENT);
    bad = Report(*h1_);
    bad.set_tokens(h1_->tokens() + 1);
    EXPECT_EQ(ReportCode(bad), grpc::StatusCode::INVALID_ARGUMENT);
    bad = Report(*h1_);
    bad.set_qb_histogram("garbage");
    EXPECT_NE(ReportCode(bad), grpc::StatusCode::OK);
    bad = Report(Histogram(0, bias0_, 100, 3, /*layer=*/2));
    bad.set_layer(1);
    EXPECT_EQ(ReportCode(bad), grpc::StatusCode::INVALID_ARGUMENT);
    numerics::QbHistogram pooled = *h1_;
    ASSERT_TRUE(pooled.Merge(h2).ok());
    v1::LoadStats stats;
    ASSERT_TRUE(r_->GetLoadStats(r_.Ctx().get(), gs_, &stats).ok());
    EXPECT_EQ(stats.window_tokens(), 2400);
    EXPECT_EQ(std::vector<int64_t>(stats.window_loads().begin(), stats.window_loads().end()),
              pooled.loads());
    EXPECT_DOUBLE_EQ(stats.window_balance().max_vio(),
                     numerics::ComputeBalance(pooled.loads()).max_vio);
    solved_ = pooled.Solve();
  }

  // Dry run: no token needed, the bias is exactly QB on the pooled histograms, nothing applied.
  // Applying needs the token, and the watch sees version 1.
  void Rebalance() {
    v1::RebalanceResponse rr;
    rb_.set_dry_run(true);
    ASSERT_TRUE(r_->Rebalance(r_.Ctx().get(), rb_, &rr).ok());
    EXPECT_FALSE(rr.applied());
    EXPECT_EQ(std::vector<float>(rr.new_bias().bias().begin(), rr.new_bias().bias().end()),
              solved_);
    EXPECT_GT(rr.before().max_vio(), 0.3);
    EXPECT_LT(rr.predicted_after().max_vio(), 0.05);
    rb_.set_dry_run(false);
    EXPECT_EQ(r_->Rebalance(r_.Ctx().get(), rb_, &rr).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_EQ(r_->Rebalance(r_.Ctx("wrong").get(), rb_, &rr).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
    ASSERT_TRUE(r_->Rebalance(r_.Ctx(kTok).get(), rb_, &rr).ok());
    EXPECT_TRUE(rr.applied());
    EXPECT_EQ(rr.new_bias().version(), 1u);
    ASSERT_TRUE(bias_watch_->Read(&seen_));
    EXPECT_EQ(seen_.version(), 1u);
    EXPECT_EQ(std::vector<float>(seen_.bias().begin(), seen_.bias().end()), solved_);
  }

  // Continuous mode: an automatic step once the window holds continuous_tokens (2000).
  void ContinuousMode() {
    sm_.set_mode(v1::BIAS_MODE_CONTINUOUS);
    sm_.set_continuous_tokens(2000);
    v1::LayerBias mode_ack;
    EXPECT_EQ(r_->SetBiasMode(r_.Ctx().get(), sm_, &mode_ack).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
    ASSERT_TRUE(r_->SetBiasMode(r_.Ctx(kTok).get(), sm_, &mode_ack).ok());
    EXPECT_EQ(mode_ack.mode(), v1::BIAS_MODE_CONTINUOUS);
    ASSERT_TRUE(bias_watch_->Read(&seen_));  // the mode change
    EXPECT_EQ(seen_.mode(), v1::BIAS_MODE_CONTINUOUS);
    ASSERT_EQ(ReportCode(Report(Histogram(1, solved_, 1200, 4))), grpc::StatusCode::OK);
    v1::GetBiasRequest g;
    g.set_layer(1);
    ASSERT_TRUE(r_->GetBias(r_.Ctx().get(), g, &seen_).ok());
    EXPECT_EQ(seen_.version(), 1u);
    ASSERT_EQ(ReportCode(Report(Histogram(1, solved_, 1200, 5))), grpc::StatusCode::OK);
    ASSERT_TRUE(bias_watch_->Read(&seen_));
    EXPECT_EQ(seen_.version(), 2u);
    EXPECT_EQ(seen_.reason(), "continuous from 2400 tokens");
  }

  // Frozen: back to the checkpoint's bias as a new version; rebalancing and rollback refused.
  void Frozen() {
    sm_.set_mode(v1::BIAS_MODE_FROZEN);
    v1::LayerBias mode_ack;
    ASSERT_TRUE(r_->SetBiasMode(r_.Ctx(kTok).get(), sm_, &mode_ack).ok());
    EXPECT_EQ(mode_ack.version(), 3u);
    EXPECT_EQ(std::vector<float>(mode_ack.bias().begin(), mode_ack.bias().end()), bias0_);
    ASSERT_EQ(ReportCode(Report(Histogram(3, bias0_, 500, 6))), grpc::StatusCode::OK);
    v1::RebalanceResponse rr;
    EXPECT_EQ(r_->Rebalance(r_.Ctx(kTok).get(), rb_, &rr).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
    v1::RollbackBiasRequest rbk;
    rbk.set_layer(1);
    rbk.set_to_version(1);
    v1::LayerBias rolled;
    EXPECT_EQ(r_->RollbackBias(r_.Ctx(kTok).get(), rbk, &rolled).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }

  static constexpr const char* kTok = "t0k";
  Router r_;
  v1::GetLoadStatsRequest gs_;
  v1::RebalanceRequest rb_;
  v1::SetBiasModeRequest sm_;
  std::unique_ptr<grpc::ClientContext> bias_ctx_;
  std::unique_ptr<grpc::ClientReader<v1::LayerBias>> bias_watch_;
  v1::LayerBias seen_;
  std::vector<float> bias0_, solved_;
  std::optional<numerics::QbHistogram> h1_;  // node 1's report of version 0
};

TEST_F(RouterWindows, WindowsRebalanceModesRollbackAndAdminToken) {
  ASSERT_NO_FATAL_FAILURE(ExpectTheCheckpointsBias());
  ASSERT_NO_FATAL_FAILURE(ReportTwoNodes());
  ASSERT_NO_FATAL_FAILURE(Rebalance());
  // A report routed with version 0 now counts in the totals only.
  v1::ReportStatsResponse ack;
  ASSERT_TRUE(r_->ReportStats(r_.Attention().get(), Report(*h1_), &ack).ok());
  EXPECT_FALSE(ack.accepted_for_window());
  EXPECT_EQ(ack.current_bias_version(), 1u);
  v1::LoadStats stats;
  ASSERT_TRUE(r_->GetLoadStats(r_.Ctx().get(), gs_, &stats).ok());
  EXPECT_EQ(stats.window_tokens(), 0);
  EXPECT_EQ(stats.total_tokens(), 3900);
  ASSERT_NO_FATAL_FAILURE(ContinuousMode());
  ASSERT_NO_FATAL_FAILURE(Frozen());

  // Rollback (in rebalance mode) makes version 1's bias current as version 4.
  sm_.set_mode(v1::BIAS_MODE_REBALANCE);
  v1::LayerBias mode_ack;
  ASSERT_TRUE(r_->SetBiasMode(r_.Ctx(kTok).get(), sm_, &mode_ack).ok());
  v1::RollbackBiasRequest rbk;
  rbk.set_layer(1);
  rbk.set_to_version(1);
  v1::LayerBias rolled;
  EXPECT_EQ(r_->RollbackBias(r_.Ctx().get(), rbk, &rolled).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  ASSERT_TRUE(r_->RollbackBias(r_.Ctx(kTok).get(), rbk, &rolled).ok());
  EXPECT_EQ(rolled.version(), 4u);
  EXPECT_EQ(rolled.reason(), "rollback to 1");
  EXPECT_EQ(std::vector<float>(rolled.bias().begin(), rolled.bias().end()), solved_);
  rbk.set_to_version(99);
  EXPECT_EQ(r_->RollbackBias(r_.Ctx(kTok).get(), rbk, &rolled).error_code(),
            grpc::StatusCode::NOT_FOUND);
  ASSERT_TRUE(r_->GetLoadStats(r_.Ctx().get(), gs_, &stats).ok());
  EXPECT_EQ(stats.history_size(), 5);
  EXPECT_EQ(stats.rebalances(), 2);
}

// The mode is typed (bias_ledger.h); a bad name is refused by the flag (ctest
// flags.router-svc_bad_mode). Every layer starts in the mode given.
TEST(RouterServer, StartsEveryLayerInTheGivenMode) {
  RouterServerOptions o;
  o.bias_mode = BiasMode::kFrozen;
  o.admin_token = "t";
  Router router(o);
  v1::GetBiasRequest req;
  req.set_layer(1);
  v1::LayerBias b;
  ASSERT_TRUE(router->GetBias(router.Ctx().get(), req, &b).ok());
  EXPECT_EQ(b.mode(), v1::BIAS_MODE_FROZEN);
  EXPECT_EQ(b.version(), 0u);
  v1::RebalanceRequest rb;
  rb.set_layer(1);
  v1::RebalanceResponse resp;
  const grpc::Status s = router->Rebalance(router.Ctx("t").get(), rb, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
}

}  // namespace
}  // namespace moe::router_svc
