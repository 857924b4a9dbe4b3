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

TEST(RouterServer, WindowsRebalanceModesRollbackAndAdminToken) {
  RouterServerOptions o;
  o.admin_token = "t0k";
  Router r(o);
  const std::string tok = "t0k";
  v1::GetBiasRequest gb;
  gb.set_layer(1);
  v1::LayerBias b0;
  ASSERT_TRUE(r->GetBias(r.Ctx().get(), gb, &b0).ok());
  EXPECT_EQ(b0.version(), 0u);
  EXPECT_EQ(b0.reason(), "checkpoint");
  auto ckpt = checkpoint::Checkpoint::Open(TinyCheckpoint());
  const std::vector<float> ckpt_bias =
      checkpoint::LoadMoeLayer(**ckpt, *PresetConfig("tiny"), 1, {})->bias;
  const std::vector<float> bias0(b0.bias().begin(), b0.bias().end());
  EXPECT_EQ(bias0, ckpt_bias);
  gb.set_layer(7);
  EXPECT_EQ(r->GetBias(r.Ctx().get(), gb, &b0).error_code(), grpc::StatusCode::NOT_FOUND);

  v1::RebalanceRequest rb;
  rb.set_layer(1);
  v1::RebalanceResponse rr;
  EXPECT_EQ(r->Rebalance(r.Ctx(tok).get(), rb, &rr).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);  // no traffic yet

  auto bias_ctx = r.Ctx();
  v1::WatchBiasRequest wb;
  wb.add_layers(1);
  auto bias_watch = r->WatchBias(bias_ctx.get(), wb);
  v1::LayerBias seen;
  ASSERT_TRUE(bias_watch->Read(&seen));
  EXPECT_EQ(seen.version(), 0u);

  // Two nodes' reports of version 0.
  const numerics::QbHistogram h1 = Histogram(0, bias0, 1500, 1);
  const numerics::QbHistogram h2 = Histogram(0, bias0, 900, 2);
  v1::ReportStatsResponse ack;
  ASSERT_TRUE(r->ReportStats(r.Attention().get(), Report(h1), &ack).ok());
  EXPECT_TRUE(ack.accepted_for_window());
  ASSERT_TRUE(r->ReportStats(r.Attention().get(), Report(h2), &ack).ok());
  // Bad reports are refused and change nothing.
  v1::ReportStatsRequest bad = Report(h1);
  bad.mutable_loads()->RemoveLast();
  EXPECT_EQ(r->ReportStats(r.Attention().get(), bad, &ack).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  bad = Report(h1);
  bad.set_tokens(h1.tokens() + 1);
  EXPECT_EQ(r->ReportStats(r.Attention().get(), bad, &ack).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  bad = Report(h1);
  bad.set_qb_histogram("garbage");
  EXPECT_NE(r->ReportStats(r.Attention().get(), bad, &ack).error_code(), grpc::StatusCode::OK);
  bad = Report(Histogram(0, bias0, 100, 3, /*layer=*/2));
  bad.set_layer(1);
  EXPECT_EQ(r->ReportStats(r.Attention().get(), bad, &ack).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);

  numerics::QbHistogram pooled = h1;
  ASSERT_TRUE(pooled.Merge(h2).ok());
  v1::GetLoadStatsRequest gs;
  gs.set_layer(1);
  v1::LoadStats stats;
  ASSERT_TRUE(r->GetLoadStats(r.Ctx().get(), gs, &stats).ok());
  EXPECT_EQ(stats.window_tokens(), 2400);
  EXPECT_EQ(std::vector<int64_t>(stats.window_loads().begin(), stats.window_loads().end()),
            pooled.loads());
  EXPECT_DOUBLE_EQ(stats.window_balance().max_vio(),
                   numerics::ComputeBalance(pooled.loads()).max_vio);

  // Dry run: no token needed, the bias is exactly QB on the pooled histograms, nothing applied.
  rb.set_dry_run(true);
  ASSERT_TRUE(r->Rebalance(r.Ctx().get(), rb, &rr).ok());
  EXPECT_FALSE(rr.applied());
  const std::vector<float> solved = pooled.Solve();
  EXPECT_EQ(std::vector<float>(rr.new_bias().bias().begin(), rr.new_bias().bias().end()), solved);
  EXPECT_GT(rr.before().max_vio(), 0.3);
  EXPECT_LT(rr.predicted_after().max_vio(), 0.05);
  // Applying needs the token.
  rb.set_dry_run(false);
  EXPECT_EQ(r->Rebalance(r.Ctx().get(), rb, &rr).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(r->Rebalance(r.Ctx("wrong").get(), rb, &rr).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  ASSERT_TRUE(r->Rebalance(r.Ctx(tok).get(), rb, &rr).ok());
  EXPECT_TRUE(rr.applied());
  EXPECT_EQ(rr.new_bias().version(), 1u);
  ASSERT_TRUE(bias_watch->Read(&seen));
  EXPECT_EQ(seen.version(), 1u);
  EXPECT_EQ(std::vector<float>(seen.bias().begin(), seen.bias().end()), solved);

  // A report routed with version 0 now counts in the totals only.
  ASSERT_TRUE(r->ReportStats(r.Attention().get(), Report(h1), &ack).ok());
  EXPECT_FALSE(ack.accepted_for_window());
  EXPECT_EQ(ack.current_bias_version(), 1u);
  ASSERT_TRUE(r->GetLoadStats(r.Ctx().get(), gs, &stats).ok());
  EXPECT_EQ(stats.window_tokens(), 0);
  EXPECT_EQ(stats.total_tokens(), 3900);

  // Continuous mode: an automatic step once the window holds continuous_tokens.
  v1::SetBiasModeRequest sm;
  sm.set_layer(1);
  sm.set_mode(v1::BIAS_MODE_CONTINUOUS);
  sm.set_continuous_tokens(2000);
  v1::LayerBias mode_ack;
  EXPECT_EQ(r->SetBiasMode(r.Ctx().get(), sm, &mode_ack).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  ASSERT_TRUE(r->SetBiasMode(r.Ctx(tok).get(), sm, &mode_ack).ok());
  EXPECT_EQ(mode_ack.mode(), v1::BIAS_MODE_CONTINUOUS);
  ASSERT_TRUE(bias_watch->Read(&seen));  // the mode change
  EXPECT_EQ(seen.mode(), v1::BIAS_MODE_CONTINUOUS);
  ASSERT_TRUE(
      r->ReportStats(r.Attention().get(), Report(Histogram(1, solved, 1200, 4)), &ack).ok());
  ASSERT_TRUE(r->GetBias(
                   r.Ctx().get(),
                   [] {
                     v1::GetBiasRequest g;
                     g.set_layer(1);
                     return g;
                   }(),
                   &seen)
                  .ok());
  EXPECT_EQ(seen.version(), 1u);
  ASSERT_TRUE(
      r->ReportStats(r.Attention().get(), Report(Histogram(1, solved, 1200, 5)), &ack).ok());
  ASSERT_TRUE(bias_watch->Read(&seen));
  EXPECT_EQ(seen.version(), 2u);
  EXPECT_EQ(seen.reason(), "continuous from 2400 tokens");

  // Frozen: back to the checkpoint's bias as a new version; rebalancing is refused.
  sm.set_mode(v1::BIAS_MODE_FROZEN);
  ASSERT_TRUE(r->SetBiasMode(r.Ctx(tok).get(), sm, &mode_ack).ok());
  EXPECT_EQ(mode_ack.version(), 3u);
  EXPECT_EQ(std::vector<float>(mode_ack.bias().begin(), mode_ack.bias().end()), bias0);
  ASSERT_TRUE(r->ReportStats(r.Attention().get(), Report(Histogram(3, bias0, 500, 6)), &ack).ok());
  EXPECT_EQ(r->Rebalance(r.Ctx(tok).get(), rb, &rr).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  v1::RollbackBiasRequest rbk;
  rbk.set_layer(1);
  rbk.set_to_version(1);
  v1::LayerBias rolled;
  EXPECT_EQ(r->RollbackBias(r.Ctx(tok).get(), rbk, &rolled).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);

  // Rollback (in rebalance mode) makes version 1's bias current as version 4.
  sm.set_mode(v1::BIAS_MODE_REBALANCE);
  ASSERT_TRUE(r->SetBiasMode(r.Ctx(tok).get(), sm, &mode_ack).ok());
  EXPECT_EQ(r->RollbackBias(r.Ctx().get(), rbk, &rolled).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  ASSERT_TRUE(r->RollbackBias(r.Ctx(tok).get(), rbk, &rolled).ok());
  EXPECT_EQ(rolled.version(), 4u);
  EXPECT_EQ(rolled.reason(), "rollback to 1");
  EXPECT_EQ(std::vector<float>(rolled.bias().begin(), rolled.bias().end()), solved);
  rbk.set_to_version(99);
  EXPECT_EQ(r->RollbackBias(r.Ctx(tok).get(), rbk, &rolled).error_code(),
            grpc::StatusCode::NOT_FOUND);
  ASSERT_TRUE(r->GetLoadStats(r.Ctx().get(), gs, &stats).ok());
  EXPECT_EQ(stats.history_size(), 5);
  EXPECT_EQ(stats.rebalances(), 2);
  bias_ctx->TryCancel();
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

// Registers n shards over experts [0, 16) of layer 1, each with a name and an endpoint near
// their bounds (about 400 bytes of placement each).
void RegisterBigShards(Router& r, int n) {
  for (int i = 0; i < n; ++i) {
    v1::RegisterExpertServerRequest reg;
    reg.set_shard("shard-" + std::to_string(i) + std::string(110, 'x'));
    reg.set_endpoint("127.0.0.1:1/" + std::string(240, 'e'));
    v1::ExpertRange* range = reg.add_ranges();
    range->set_layer(1);
    range->set_expert_lo(0);
    range->set_expert_hi(16);
    v1::RegisterExpertServerResponse lease;
    ASSERT_TRUE(r->RegisterExpertServer(r.As(reg.shard()).get(), reg, &lease).ok()) << i;
  }
}

// Watchers hold states, not events: one that does not read while the placement changes 300
// times then reads the latest placement after far fewer messages; watch streams are bounded.
TEST(RouterServer, WatchersGetTheLatestStateAndAreBounded) {
  RouterServerOptions o;
  o.max_watchers = 2;
  Router r(o);
  grpc::ClientContext slow_ctx;
  slow_ctx.AddMetadata("x-moe-cluster-token", kMember);
  auto slow = r->WatchPlacement(&slow_ctx, v1::GetPlacementRequest());
  v1::Placement first;
  ASSERT_TRUE(slow->Read(&first));
  constexpr int kChanges = 300;
  // Big placements (names and endpoints near their bounds): 300 of them pass the 16 MB window.
  ASSERT_NO_FATAL_FAILURE(RegisterBigShards(r, kChanges));
  v1::Placement latest;
  ASSERT_TRUE(r->GetPlacement(r.Ctx().get(), v1::GetPlacementRequest(), &latest).ok());
  ASSERT_EQ(latest.shards_size(), kChanges);
  int messages = 0;
  v1::Placement p;
  while (messages < kChanges && slow->Read(&p)) {  // bounded: at most one message per change
    ++messages;
    if (p.version() == latest.version()) break;
  }
  EXPECT_EQ(p.version(), latest.version());
  EXPECT_EQ(p.shards_size(), kChanges);
  std::printf("[slow watcher] %d placement changes, %d messages read\n", kChanges, messages);
  EXPECT_LT(messages, kChanges / 2);
  // A second watch is allowed, a third refused (max_watchers = 2).
  grpc::ClientContext second_ctx, third_ctx;
  auto second = r->WatchPlacement(&second_ctx, v1::GetPlacementRequest());
  ASSERT_TRUE(second->Read(&p));
  auto third = r->WatchPlacement(&third_ctx, v1::GetPlacementRequest());
  EXPECT_FALSE(third->Read(&p));
  EXPECT_EQ(third->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  slow_ctx.TryCancel();
  second_ctx.TryCancel();
  (void)slow->Finish();
  (void)second->Finish();
}

// The bytes watchers hold unread are bounded together (--max_watch_bytes): while placements
// grow past it, a watcher that is pushed to over the budget is ended (its call cancelled, so
// what gRPC holds for it goes too); the router serves on, and a new watcher gets the latest.
TEST(RouterServer, WatchersArePastTheByteBudgetEnded) {
  RouterServerOptions o;
  o.max_watch_bytes = 256 << 10;  // 256 KiB for every watcher together
  Router r(o);
  grpc::ClientContext idle_ctx;
  idle_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto idle = r->WatchPlacement(&idle_ctx, v1::GetPlacementRequest());
  v1::Placement p;
  ASSERT_TRUE(idle->Read(&p));  // then not again until the registrations are done
  // 600 shards of ~400 bytes: placements of up to ~240 KB, ~70 MB over all versions.
  ASSERT_NO_FATAL_FAILURE(RegisterBigShards(r, 600));
  // The stream was ended: what it reads now ends in an error before its deadline, at most
  // one message per change.
  int idle_read = 0;
  while (idle_read < 600 && idle->Read(&p)) ++idle_read;
  const grpc::Status s = idle->Finish();
  EXPECT_TRUE(s.error_code() == grpc::StatusCode::CANCELLED ||
              s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED)
      << s.error_code() << " " << s.error_message();
  std::printf("[over the watch budget] ended after %d messages\n", idle_read);
  // A new watcher: the latest placement.
  v1::Placement latest;
  ASSERT_TRUE(r->GetPlacement(r.Ctx().get(), v1::GetPlacementRequest(), &latest).ok());
  ASSERT_EQ(latest.shards_size(), 600);
  grpc::ClientContext fresh_ctx;
  fresh_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto fresh = r->WatchPlacement(&fresh_ctx, v1::GetPlacementRequest());
  ASSERT_TRUE(fresh->Read(&p));
  EXPECT_EQ(p.version(), latest.version());
  fresh_ctx.TryCancel();
  (void)fresh->Finish();
}

// Membership is authenticated: registrations, heartbeats and reports need the cluster token,
// and a router without one accepts none; a forged report changes nothing.
TEST(RouterServer, OnlyMembersRegisterHeartbeatAndReport) {
  Router r(RouterServerOptions{});
  v1::RegisterExpertServerRequest reg;
  reg.set_shard("rogue");
  reg.set_endpoint("127.0.0.1:1");
  v1::ExpertRange* range = reg.add_ranges();
  range->set_layer(1);
  range->set_expert_lo(0);
  range->set_expert_hi(16);
  v1::RegisterExpertServerResponse lease;
  auto bare = std::make_unique<grpc::ClientContext>();
  bare->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status s = r->RegisterExpertServer(bare.get(), reg, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  auto wrong = std::make_unique<grpc::ClientContext>();
  wrong->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  wrong->AddMetadata("x-moe-cluster-token", "member-tokeN");
  EXPECT_EQ(r->RegisterExpertServer(wrong.get(), reg, &lease).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  v1::Placement p;
  ASSERT_TRUE(r->GetPlacement(r.Ctx().get(), v1::GetPlacementRequest(), &p).ok());
  EXPECT_EQ(p.shards_size(), 0) << "a refused registration must not join the placement";
  v1::ReportStatsRequest forged;
  forged.set_node("rogue");
  forged.set_layer(1);
  forged.set_tokens(1000);
  for (int e = 0; e < 16; ++e) forged.add_loads(e == 0 ? 4000 : 0);
  v1::ReportStatsResponse ack;
  auto bare2 = std::make_unique<grpc::ClientContext>();
  bare2->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  EXPECT_EQ(r->ReportStats(bare2.get(), forged, &ack).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  v1::GetLoadStatsRequest lr;
  lr.set_layer(1);
  v1::LoadStats stats;
  ASSERT_TRUE(r->GetLoadStats(r.Ctx().get(), lr, &stats).ok());
  EXPECT_EQ(stats.total_tokens(), 0);
  // A member's token names it: shard-a's token does not register "rogue" (no member has
  // presented that token yet: a stranger's, UNAUTHENTICATED) ...
  s = r->RegisterExpertServer(r.Ctx().get(), reg, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  EXPECT_NE(s.error_message().find("that shard's own"), std::string::npos) << s.error_message();
  // The member registers under its own name; its lease is a random 64-bit number, not 1, 2 ...
  ASSERT_TRUE(r->RegisterExpertServer(r.As("rogue").get(), reg, &lease).ok());
  EXPECT_GT(lease.lease_id(), uint64_t{1} << 32);
  v1::HeartbeatRequest hb;
  hb.set_lease_id(lease.lease_id());
  v1::HeartbeatResponse hr;
  auto bare3 = std::make_unique<grpc::ClientContext>();
  bare3->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  EXPECT_EQ(r->Heartbeat(bare3.get(), hb, &hr).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(r->Heartbeat(r.As("rogue").get(), hb, &hr).ok());
  // ... and once it has, its token under another name is a member acting as someone else:
  // PERMISSION_DENIED naming whose token it is, for registrations and for another's lease.
  v1::RegisterExpertServerRequest other = reg;
  other.set_shard("victim");
  s = r->RegisterExpertServer(r.As("rogue").get(), other, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("with the member token of shard rogue"), std::string::npos)
      << s.error_message();
  v1::RegisterExpertServerResponse victim;
  ASSERT_TRUE(r->RegisterExpertServer(r.As("victim").get(), other, &victim).ok());
  v1::HeartbeatRequest vhb;
  vhb.set_lease_id(victim.lease_id());
  EXPECT_EQ(r->Heartbeat(r.As("rogue").get(), vhb, &hr).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // A lease nobody holds: NOT_FOUND for any member (it registers again).
  vhb.set_lease_id(victim.lease_id() ^ 1);
  EXPECT_EQ(r->Heartbeat(r.As("rogue").get(), vhb, &hr).error_code(), grpc::StatusCode::NOT_FOUND);
  // Each role's token for its own calls only: an attention node cannot register or heartbeat,
  // an expert cannot report, and the cluster secret itself is no member's token.
  EXPECT_EQ(r->RegisterExpertServer(r.Attention().get(), reg, &lease).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(r->Heartbeat(r.Attention().get(), hb, &hr).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(r->ReportStats(r.As("rogue").get(), forged, &ack).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  auto secret = std::make_unique<grpc::ClientContext>();
  secret->AddMetadata("x-moe-cluster-token", kMember);
  s = r->RegisterExpertServer(secret.get(), reg, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_NE(s.error_message().find("needs the cluster token of an expert member"),
            std::string::npos)
      << s.error_message();

  Router closed(RouterServerOptions{}, /*member=*/false);  // no cluster token at all
  s = closed->RegisterExpertServer(closed.Ctx().get(), reg, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(s.error_message().find("membership is closed"), std::string::npos) << s.error_message();
}

// Secure by default: without an admin token every call that changes the bias is refused (a
// dry run changes nothing and stays open); the token comes from a file only its owner (and
// group) can read.
TEST(RouterServer, AdminCallsAreRefusedWithoutATokenAndTheTokenComesFromAFile) {
  {
    Router open(RouterServerOptions{});
    v1::RebalanceRequest rb;
    rb.set_layer(1);
    v1::RebalanceResponse rr;
    grpc::Status s = open->Rebalance(open.Ctx("anything").get(), rb, &rr);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_NE(s.error_message().find("admin calls are disabled"), std::string::npos);
    v1::SetBiasModeRequest sm;
    sm.set_layer(1);
    sm.set_mode(v1::BIAS_MODE_FROZEN);
    v1::LayerBias ack;
    EXPECT_EQ(open->SetBiasMode(open.Ctx().get(), sm, &ack).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
    v1::RollbackBiasRequest rbk;
    rbk.set_layer(1);
    EXPECT_EQ(open->RollbackBias(open.Ctx().get(), rbk, &ack).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
    rb.set_dry_run(true);  // no traffic yet: refused for that reason, not for the token
    EXPECT_EQ(open->Rebalance(open.Ctx().get(), rb, &rr).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  const std::string dir = ::testing::TempDir();
  auto write = [&](const std::string& name, const std::string& text, mode_t mode) {
    const std::string path = dir + "/" + name;
    std::ofstream(path) << text;
    ::chmod(path.c_str(), mode);
    return path;
  };
  RouterServerOptions o;
  o.checkpoint = TinyCheckpoint();
  o.admin_token_file = write("world_readable_token", "s3cret\n", 0644);
  auto refused = RouterServer::Start(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  o.admin_token_file = write("empty_token", " \n", 0600);
  EXPECT_EQ(RouterServer::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.admin_token_file = dir + "/no_such_token";
  EXPECT_EQ(RouterServer::Start(o).status().code(), absl::StatusCode::kNotFound);
  o.admin_token_file = write("good_token", "  s3cret\n", 0640);
  o.bias_mode = BiasMode::kFrozen;
  o.admin_token = "ignored-when-a-file-is-given";
  Router r(o);
  v1::SetBiasModeRequest sm;
  sm.set_layer(1);
  sm.set_mode(v1::BIAS_MODE_REBALANCE);
  v1::LayerBias ack;
  EXPECT_EQ(r->SetBiasMode(r.Ctx("ignored-when-a-file-is-given").get(), sm, &ack).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(r->SetBiasMode(r.Ctx("s3cre").get(), sm, &ack).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(r->SetBiasMode(r.Ctx("s3cret").get(), sm, &ack).ok());
  EXPECT_EQ(ack.mode(), v1::BIAS_MODE_REBALANCE);
}

// Members are bounded too: a shard registers only the range the deployment's table gives its
// name, one range per managed layer, under a bounded name; and a registration whose lease is
// long expired leaves the placement (and the store) by itself.
TEST(RouterServer, RegistrationsAreBoundedByTheDeploymentAndExpire) {
  std::string tmpl = ::testing::TempDir() + "/moe_ranges_XXXXXX";
  const std::string dir = ::mkdtemp(tmpl.data());
  {
    std::ofstream f(dir + "/ranges.json");
    f << R"({"shards": {"shard-a": [0, 8], "shard-b": [8, 16]}})";
  }
  RouterServerOptions o;
  o.ranges_file = dir + "/ranges.json";
  o.heartbeat_interval_ms = 100;
  o.shard_expiry_seconds = 1;
  o.max_shards = 2;
  Router r(o);
  auto reg = [&](const std::string& shard, std::vector<std::array<int, 3>> ranges) {
    v1::RegisterExpertServerRequest req;
    req.set_shard(shard);
    req.set_endpoint("127.0.0.1:7");
    for (const auto& [layer, lo, hi] : ranges) {
      auto* x = req.add_ranges();
      x->set_layer(layer);
      x->set_expert_lo(lo);
      x->set_expert_hi(hi);
    }
    v1::RegisterExpertServerResponse resp;
    return r->RegisterExpertServer(r.As(shard).get(), req, &resp);
  };
  struct Case {
    std::string shard;
    std::vector<std::array<int, 3>> ranges;
    grpc::StatusCode code;
    const char* message;
  };
  for (const Case& c : {
           Case{"a-evil",
                {{1, 0, 16}},
                grpc::StatusCode::PERMISSION_DENIED,
                "shard a-evil may serve no experts"},
           Case{"shard-a",
                {{1, 0, 16}},
                grpc::StatusCode::PERMISSION_DENIED,
                "shard shard-a may serve experts [0, 8) (the deployment's ranges file), not the "
                "range [0, 16) it registered for layer 1"},
           Case{"shard-a",
                {{7, 0, 8}},
                grpc::StatusCode::INVALID_ARGUMENT,
                "layer 7 is not managed by this router"},
           Case{"shard-a",
                {{1, 0, 4}, {1, 4, 8}},
                grpc::StatusCode::INVALID_ARGUMENT,
                "two ranges for layer 1"},
           Case{std::string(210, 'x'),
                {{1, 0, 8}},
                grpc::StatusCode::INVALID_ARGUMENT,
                "a shard name of 210 bytes"},
           Case{"shard a",
                {{1, 0, 8}},
                grpc::StatusCode::INVALID_ARGUMENT,
                "letters, digits, '-', '.' and '_' only"},
       }) {
    SCOPED_TRACE(c.shard.substr(0, 20));
    const grpc::Status s = reg(c.shard, c.ranges);
    EXPECT_EQ(s.error_code(), c.code) << s.error_message();
    EXPECT_NE(s.error_message().find(c.message), std::string::npos) << s.error_message();
  }
  // Within its range: accepted (a narrower range too).
  ASSERT_TRUE(reg("shard-a", {{1, 0, 8}}).ok());
  ASSERT_TRUE(reg("shard-b", {{1, 8, 12}}).ok());
  v1::Placement p;
  ASSERT_TRUE(r->GetPlacement(r.Ctx().get(), v1::GetPlacementRequest(), &p).ok());
  ASSERT_EQ(p.shards_size(), 2);
  // Silent past shard_expiry_seconds: removed by the health loop (bounded wait: 5 s).
  for (int i = 0; i < 50 && p.shards_size() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_TRUE(r->GetPlacement(r.Ctx().get(), v1::GetPlacementRequest(), &p).ok());
  }
  EXPECT_EQ(p.shards_size(), 0) << "expired registrations stay in the placement";
}

}  // namespace
}  // namespace moe::router_svc
