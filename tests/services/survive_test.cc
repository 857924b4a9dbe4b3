// The control plane survives router-svc's death (docs/design.md "Control plane"): with
// --state_db, a kill -9 of router-svc under load and its restart cost no failed and no wrong
// answer, the bias version and its history come back, and a shard that was stopped through the
// restart comes back by itself under its old lease. Real processes on loopback.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "services/numerics/combine.h"
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
using testing::Traffic;
using tools::LocalCluster;
using tools::LocalClusterOptions;

TEST(ClusterSurvive, RouterKilledUnderLoadLosesNothing) {
  const std::string& dir = CheckpointFor("tiny");
  ModelConfig cfg;
  auto local = InProcessLayer(dir, &cfg);
  LocalClusterOptions o = TestCluster(dir, {{0, 8}, {8, 16}});
  o.work_dir = moe::testing::MakeTempDir("survive");
  o.admin_token = "survive-admin";
  // The state in <work_dir>/router.db (LocalCluster's default, made with --initialize).
  o.router_args = {"--heartbeat_interval_ms=200"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);
  auto admin = ClientFor(**cluster, o.admin_token);
  // A bias version worth keeping: version 1 (the checkpoint's bias again, so the in-process
  // layer stays the oracle).
  auto v1 = admin->RollbackBias(layer, 0);
  ASSERT_TRUE(v1.ok()) << v1.status();
  ASSERT_EQ(v1->version(), 1u);
  const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, 4, 31);
  const std::vector<Bf16> want = local->Forward(x, 4, cfg.hidden)->out;

  Traffic traffic;
  traffic.Start(**cluster, layer, x, 4, cfg.hidden, want);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ASSERT_TRUE((*cluster)->SignalRouter(SIGKILL).ok());
  // And the WAL is lost with it (what a copy of only the db file loses): every commit is in
  // the db file already.
  for (const char* f : {"/router.db-wal", "/router.db-shm"}) ::unlink((o.work_dir + f).c_str());
  std::this_thread::sleep_for(std::chrono::milliseconds(700));  // served without a router
  ASSERT_TRUE((*cluster)->RestartRouter().ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  traffic.Stop();
  std::printf("[router kill -9 under load] %lld ok, %lld failed, %lld wrong\n",
              static_cast<long long>(traffic.ok.load()),
              static_cast<long long>(traffic.failed.load()),
              static_cast<long long>(traffic.wrong.load()));
  EXPECT_GT(traffic.ok.load(), 10);
  EXPECT_EQ(traffic.failed.load(), 0) << (traffic.errors.empty() ? "" : traffic.errors[0]);
  EXPECT_EQ(traffic.wrong.load(), 0);
  auto bias = admin->GetBias(layer);
  ASSERT_TRUE(bias.ok()) << bias.status();
  EXPECT_EQ(bias->version(), 1u);
  EXPECT_EQ(bias->reason(), "rollback to 0");
  auto stats = admin->GetLoadStats(layer);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->history_size(), 2);

  // A lost db: the restarted router refuses to start as a new cluster, with the reason in its
  // log (the members serve on from their last placement and bias meanwhile).
  ASSERT_TRUE((*cluster)->SignalRouter(SIGKILL).ok());
  const std::string db = o.work_dir + "/router.db";
  ASSERT_EQ(::rename(db.c_str(), (db + ".saved").c_str()), 0);
  absl::Status refused = (*cluster)->RestartRouter();
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.ToString().find("does not exist"), std::string::npos) << refused;
  // Restored from the backup, it starts and serves version 1.
  ASSERT_EQ(::rename((db + ".saved").c_str(), db.c_str()), 0);
  absl::Status again = (*cluster)->RestartRouter();
  ASSERT_TRUE(again.ok()) << again;
  // The client's channel to the old router may fail its first call (the socket it held).
  auto restored = admin->GetBias(layer);
  for (int i = 0; i < 50 && !restored.ok(); ++i) {  // bounded: 5 s
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    restored = admin->GetBias(layer);
  }
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->version(), 1u);

  // A shard stopped through a router restart comes back by itself: its heartbeats carry the
  // lease the new router restored.
  ASSERT_TRUE((*cluster)->SignalShard(1, SIGSTOP).ok());
  ASSERT_TRUE((*cluster)->SignalRouter(SIGKILL).ok());
  ASSERT_TRUE((*cluster)->RestartRouter().ok());
  ASSERT_TRUE((*cluster)->SignalShard(1, SIGCONT).ok());
  absl::Status ready = (*cluster)->WaitReady(absl::Seconds(20));
  ASSERT_TRUE(ready.ok()) << ready;
  absl::StatusOr<client::ForwardResult> r = absl::UnavailableError("not yet");
  for (int i = 0; i < 100 && !r.ok(); ++i) {  // bounded: 10 s
    r = admin->Forward(layer, x, 4, cfg.hidden);
    if (!r.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(SameBits(r->out, want));
  auto placement = admin->GetBias(layer);
  ASSERT_TRUE(placement.ok());
  EXPECT_EQ(placement->version(), 1u);
}

// Two replicas per range: the attention node spreads batches over both, and a kill -9 of one
// under load fails no request (its messages go to the other replica within their deadline).
TEST(ClusterReplicas, KillingAReplicaUnderLoadFailsNoRequest) {
  const std::string& dir = CheckpointFor("tiny");
  ModelConfig cfg;
  auto local = InProcessLayer(dir, &cfg);
  // shard-2 and shard-3 are replicas of shard-0 and shard-1.
  LocalClusterOptions o = TestCluster(dir, {{0, 8}, {8, 16}, {0, 8}, {8, 16}});
  o.router_args = {"--heartbeat_interval_ms=200"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);
  const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, 4, 33);
  const std::vector<Bf16> want = local->Forward(x, 4, cfg.hidden)->out;
  Traffic a, b;
  a.Start(**cluster, layer, x, 4, cfg.hidden, want);
  b.Start(**cluster, layer, x, 4, cfg.hidden, want);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  auto batches = [&](int shard) {
    return moe::testing::ScrapeSum((*cluster)->shard_metrics(shard), "moe_requests_succeeded_total",
                                   {"method=\"Dispatch\""});
  };
  const double to_0 = batches(0), to_2 = batches(2);
  ASSERT_TRUE((*cluster)->SignalShard(2, SIGKILL).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(2000));
  a.Stop();
  b.Stop();
  const double failovers = moe::testing::ScrapeSum((*cluster)->attention_metrics(),
                                                   "moe_failovers_total", {"shard=\"shard-2\""});
  const int64_t ok = a.ok + b.ok, failed = a.failed + b.failed, wrong = a.wrong + b.wrong;
  std::printf(
      "[replica kill -9 under load] batches before the kill: shard-0 %.0f, shard-2 %.0f; "
      "%lld ok, %lld failed, %lld wrong, %.0f failed over\n",
      to_0, to_2, static_cast<long long>(ok), static_cast<long long>(failed),
      static_cast<long long>(wrong), failovers);
  EXPECT_GT(to_0, 0);
  EXPECT_GT(to_2, 0) << "the replicas did not share the load";
  EXPECT_GT(ok, 20);
  EXPECT_EQ(failed, 0) << (a.errors.empty() ? (b.errors.empty() ? "" : b.errors[0]) : a.errors[0]);
  EXPECT_EQ(wrong, 0);
}

// An expert range with no replica left: by default (FAIL) the request is UNAVAILABLE naming
// the shard; with DEGRADE the missing experts are skipped, the token's other weights scaled to
// the sum all k had, and the response says which experts and how many pairs. Oracle: the
// in-process layer's stages on a routing degraded here, by the rule of attention.proto.
// What DEGRADE must answer when experts [gone_from, E) are left out: the same routing, those
// slots' weights 0 and each token's others scaled by all / kept (fp32 sums in slot order), the
// kept experts computed in process, combined and finished.
struct DegradeWant {
  numerics::Routing routing;
  std::vector<int32_t> missing;
  int64_t pairs = 0;
  std::vector<Bf16> out;
};
DegradeWant DegradeOracle(numerics::cpu::CpuMoeLayer& local, const ModelConfig& cfg,
                          const std::vector<Bf16>& x, int64_t tokens, int32_t gone_from) {
  const int64_t d = cfg.latent, k = cfg.top_k;
  DegradeWant w;
  auto batch = local.RouteAndProject(x, tokens, cfg.hidden, nullptr, nullptr);
  EXPECT_TRUE(batch.ok());
  numerics::Routing routing = batch->routing;
  for (int64_t t = 0; t < tokens; ++t) {
    float all = 0, kept = 0;
    for (int64_t j = 0; j < k; ++j) {
      all += routing.weights[t * k + j];
      if (routing.expert_ids[t * k + j] < gone_from) kept += routing.weights[t * k + j];
    }
    for (int64_t j = 0; j < k; ++j) {
      float& wt = routing.weights[t * k + j];
      const int32_t e = routing.expert_ids[t * k + j];
      if (e >= gone_from) {
        wt = 0;
        ++w.pairs;
        w.missing.push_back(e);
      } else if (kept < all) {
        wt = kept > 0 ? wt * (all / kept) : 0.0f;
      }
    }
  }
  std::sort(w.missing.begin(), w.missing.end());
  w.missing.erase(std::unique(w.missing.begin(), w.missing.end()), w.missing.end());
  std::vector<Bf16> y = local.RunLocalExperts(routing, batch->z.data());
  for (int64_t p = 0; p < tokens * k; ++p) {
    if (routing.expert_ids[p] >= gone_from) std::fill_n(y.begin() + p * d, d, Bf16());
  }
  std::vector<Bf16> r(static_cast<size_t>(tokens * d));
  numerics::ref::Combine(routing, y.data(), d, r.data());
  w.out = local.Finish(*batch, r.data(), nullptr);
  w.routing = std::move(routing);
  return w;
}

TEST(ClusterDegrade, MissingExpertsFailByDefaultOrAreSkippedAndSaid) {
  const std::string& dir = CheckpointFor("tiny");
  ModelConfig cfg;
  auto local = InProcessLayer(dir, &cfg);
  LocalClusterOptions o = TestCluster(dir, {{0, 8}, {8, 16}});
  o.router_args = {"--heartbeat_interval_ms=200"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);
  const int64_t tokens = 16, k = cfg.top_k;
  const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, tokens, 41);
  auto client = ClientFor(**cluster);
  ASSERT_TRUE((*cluster)->SignalShard(1, SIGKILL).ok());

  client::ForwardOptions fail;
  auto failed = client->Forward(layer, x, tokens, cfg.hidden, fail);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  EXPECT_NE(failed.status().message().find("shard-1"), absl::string_view::npos) << failed.status();

  client::ForwardOptions degrade;
  degrade.missing_experts = v1::MISSING_EXPERTS_DEGRADE;
  degrade.return_routing = true;
  absl::StatusOr<client::ForwardResult> got = absl::UnavailableError("not yet");
  for (int i = 0; i < 100 && !got.ok(); ++i) {  // until the router has marked shard-1 (10 s)
    got = client->Forward(layer, x, tokens, cfg.hidden, degrade);
    if (!got.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(got.ok()) << got.status();

  // The oracle: the same routing, experts [8, 16) left out by the rule.
  const DegradeWant w = DegradeOracle(*local, cfg, x, tokens, /*gone_from=*/8);
  const std::vector<int32_t>& want_missing = w.missing;
  const int64_t want_pairs = w.pairs;
  const numerics::Routing& routing = w.routing;
  const std::vector<Bf16>& want = w.out;

  EXPECT_EQ(got->missing_experts, want_missing);
  EXPECT_EQ(got->degraded_pairs, want_pairs);
  EXPECT_GT(want_pairs, 0);
  EXPECT_EQ(got->weights, routing.weights) << "the response carries the weights it used";
  EXPECT_TRUE(SameBits(got->out, want)) << "DEGRADE differs from the rule";
  EXPECT_EQ(
      moe::testing::ScrapeSum((*cluster)->attention_metrics(), "moe_degraded_pairs_total", {}),
      static_cast<double>(want_pairs));
  std::printf("[degrade] %lld of %lld pairs skipped (experts %zu), output as the rule says\n",
              static_cast<long long>(want_pairs), static_cast<long long>(tokens * k),
              want_missing.size());
}

}  // namespace
// A replica that stalls past the deadline (SIGSTOP, still listed healthy by the router) does
// not fail the requests sent to it: after --hedge_share (0.5) of the time to the deadline the
// message goes to its twin too, the first answer wins, and nothing is counted twice (the
// response's received bytes are one reply's). --hedge_share=0 shows what it saves.
TEST(ClusterReplicas, AStalledReplicaIsHedgedToItsTwin) {
  const std::string& dir = CheckpointFor("tiny");
  ModelConfig cfg;
  auto local = InProcessLayer(dir, &cfg);
  const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, 4, 33);
  const std::vector<Bf16> want = local->Forward(x, 4, cfg.hidden)->out;
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);
  for (const char* hedge : {"0.5", "0"}) {
    SCOPED_TRACE(hedge);
    LocalClusterOptions o = TestCluster(dir, {{0, 8}, {8, 16}, {0, 8}, {8, 16}});
    o.router_args = {"--heartbeat_interval_ms=3000"};  // the router notices only after 9 s
    o.attention_args = {std::string("--hedge_share=") + hedge};
    auto cluster = LocalCluster::Start(o);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    auto client = ClientFor(**cluster);
    client::ForwardOptions fo;
    fo.timeout = absl::Seconds(1);
    auto calm = client->Forward(layer, x, 4, cfg.hidden, fo);
    ASSERT_TRUE(calm.ok()) << calm.status();
    Traffic a, b;
    a.Start(**cluster, layer, x, 4, cfg.hidden, want, absl::Seconds(1));
    b.Start(**cluster, layer, x, 4, cfg.hidden, want, absl::Seconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    ASSERT_TRUE((*cluster)->SignalShard(3, SIGSTOP).ok());  // a replica of [8, 16)
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    auto during = client->Forward(layer, x, 4, cfg.hidden, fo);
    std::this_thread::sleep_for(std::chrono::milliseconds(2000));
    a.Stop();
    b.Stop();
    ASSERT_TRUE((*cluster)->SignalShard(3, SIGCONT).ok());
    const double twin = moe::testing::ScrapeSum((*cluster)->attention_metrics(), "moe_hedges_total",
                                                {"shard=\"shard-3\"", "winner=\"twin\""});
    const int64_t ok = a.ok + b.ok, failed = a.failed + b.failed, wrong = a.wrong + b.wrong;
    std::printf(
        "[replica stalled 3 s, hedge_share %s] %lld ok, %lld failed, %lld wrong, %.0f "
        "answered by the twin\n",
        hedge, static_cast<long long>(ok), static_cast<long long>(failed),
        static_cast<long long>(wrong), twin);
    EXPECT_EQ(wrong, 0);
    if (std::string(hedge) == "0.5") {
      EXPECT_GT(ok, 10);
      EXPECT_EQ(failed, 0) << (a.errors.empty() ? "" : a.errors[0]);
      EXPECT_GT(twin, 0);
      ASSERT_TRUE(during.ok()) << during.status();
      EXPECT_TRUE(SameBits(during->out, want));
      EXPECT_EQ(during->dispatch_bytes_received, calm->dispatch_bytes_received)
          << "a hedged answer counted twice";
    } else {
      EXPECT_GT(failed, 0) << "without hedging the stall should cost requests";
      EXPECT_EQ(twin, 0);
    }
  }
}

// DEGRADE also covers a shard that stalls or dies after its messages went out (the router
// still lists it healthy): with no replica to answer, its experts are left out by the same
// rule when the expert deadline passes (a stall) or the stream breaks (a kill); FAIL answers
// DEADLINE_EXCEEDED / UNAVAILABLE naming the shard.
TEST(ClusterDegrade, AShardLostMidRequestIsLeftOutUnderDegrade) {
  const std::string& dir = CheckpointFor("tiny");
  ModelConfig cfg;
  auto local = InProcessLayer(dir, &cfg);
  LocalClusterOptions o = TestCluster(dir, {{0, 8}, {8, 16}});
  o.router_args = {"--heartbeat_interval_ms=2000"};  // the router notices only after 6 s
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);
  const int64_t tokens = 16;
  const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, tokens, 41);
  const DegradeWant w = DegradeOracle(*local, cfg, x, tokens, /*gone_from=*/8);
  client::ClientOptions co = (*cluster)->client_options();
  co.timeout = absl::Seconds(2);
  auto client = client::MoeClient::Create(co);
  ASSERT_TRUE(client.ok());
  client::ForwardOptions degrade;
  degrade.missing_experts = v1::MISSING_EXPERTS_DEGRADE;
  degrade.return_routing = true;

  // Warm: every shard's stream is open (a stall then meets a live connection, not a new one).
  auto warm = (*client)->Forward(layer, x, tokens, cfg.hidden, degrade);
  ASSERT_TRUE(warm.ok()) << warm.status();
  ASSERT_EQ(warm->degraded_pairs, 0);
  // A stall: shard-1 stopped just before the request; its message waits to the expert deadline.
  ASSERT_TRUE((*cluster)->SignalShard(1, SIGSTOP).ok());
  const absl::Time t0 = absl::Now();
  auto stalled = (*client)->Forward(layer, x, tokens, cfg.hidden, degrade);
  const absl::Duration took = absl::Now() - t0;
  ASSERT_TRUE(stalled.ok()) << stalled.status();
  EXPECT_EQ(stalled->missing_experts, w.missing);
  EXPECT_EQ(stalled->degraded_pairs, w.pairs);
  EXPECT_EQ(stalled->weights, w.routing.weights);
  EXPECT_TRUE(SameBits(stalled->out, w.out)) << "DEGRADE after a stall differs from the rule";
  EXPECT_LT(took, absl::Seconds(2));  // within the caller's deadline
  // FAIL (the default) on the same stall: DEADLINE_EXCEEDED (or UNAVAILABLE once gRPC gives
  // the connection up) naming the shard.
  auto failed = (*client)->Forward(layer, x, tokens, cfg.hidden);
  ASSERT_FALSE(failed.ok());
  EXPECT_TRUE(failed.status().code() == absl::StatusCode::kDeadlineExceeded ||
              failed.status().code() == absl::StatusCode::kUnavailable)
      << failed.status();
  EXPECT_NE(failed.status().message().find("shard-1"), absl::string_view::npos) << failed.status();
  ASSERT_TRUE((*cluster)->SignalShard(1, SIGCONT).ok());

  // A kill while a request is in flight: its stream breaks; DEGRADE answers by the rule.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ASSERT_TRUE((*cluster)->SignalShard(1, SIGSTOP).ok());
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    (void)(*cluster)->SignalShard(1, SIGKILL);
  });
  auto killed = (*client)->Forward(layer, x, tokens, cfg.hidden, degrade);
  killer.join();
  ASSERT_TRUE(killed.ok()) << killed.status();
  EXPECT_EQ(killed->missing_experts, w.missing);
  EXPECT_TRUE(SameBits(killed->out, w.out)) << "DEGRADE after a kill differs from the rule";
  std::printf(
      "[degrade mid-request] stall answered in %.0f ms, kill answered, %lld pairs left out\n",
      absl::ToDoubleMilliseconds(took), static_cast<long long>(w.pairs));
}

}  // namespace moe
