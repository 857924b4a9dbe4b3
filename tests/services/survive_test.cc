// The control plane survives router-svc's death (docs/design.md "Control plane"): with
// --state_db, a kill -9 of router-svc under load and its restart cost no failed and no wrong
// answer, the bias version and its history come back, and a shard that was stopped through the
// restart comes back by itself under its old lease. Real processes on loopback.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "services/numerics/combine.h"
#include "tests/common/metrics_text.h"
#include "tests/services/cluster_fixtures.h"
#include "tests/services/cluster_test_base.h"

namespace moe {
namespace {

using tensor::Bf16;
using testing::SameBits;
using testing::Traffic;

void Sleep(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// The fixture of this file: a tiny cluster with the given ranges and router heartbeat, one
// request and its oracle answer, and two traffic threads of it.
class SurviveTest : public testing::ClusterTest {
 protected:
  void StartTiny(std::vector<std::pair<int64_t, int64_t>> ranges, int heartbeat_ms, uint64_t seed,
                 int64_t tokens = 4) {
    UsePreset("tiny", std::move(ranges));
    options().router_args = {absl::StrCat("--heartbeat_interval_ms=", heartbeat_ms)};
    tokens_ = tokens;
    x_ = Hidden(tokens, seed);
    want_ = Want(x_, tokens);
  }
  void StartTraffic(absl::Duration timeout = absl::Seconds(10)) {
    a_.Start(cluster(), layer(), x_, tokens_, hidden(), want_, timeout);
    b_.Start(cluster(), layer(), x_, tokens_, hidden(), want_, timeout);
  }
  void StopTraffic() {
    a_.Stop();
    b_.Stop();
  }
  int64_t ok() const { return a_.ok + b_.ok; }
  int64_t failed() const { return a_.failed + b_.failed; }
  int64_t wrong() const { return a_.wrong + b_.wrong; }
  std::string FirstError() const {
    return a_.errors.empty() ? (b_.errors.empty() ? "" : b_.errors[0]) : a_.errors[0];
  }

  int64_t tokens_ = 4;
  std::vector<Bf16> x_, want_;
  Traffic a_, b_;
};

// A kill -9 of router-svc under load, with its WAL lost (what a copy of only the db file
// loses: every commit is in the db file already), costs no failed and no wrong answer, and the
// bias version and its history come back.
class ClusterSurvive : public SurviveTest {
 protected:
  void SetUp() override {
    StartTiny({{0, 8}, {8, 16}}, 200, 31);
    options().work_dir = testing::MakeTempDir("survive");
    options().admin_token = "survive-admin";
    // The state in <work_dir>/router.db (LocalCluster's default, made with --initialize).
    ASSERT_NO_FATAL_FAILURE(StartCluster());
    // A bias version worth keeping: version 1 (the checkpoint's bias again, so the in-process
    // layer stays the oracle).
    auto v1 = admin().RollbackBias(layer(), 0);
    ASSERT_TRUE(v1.ok()) << v1.status();
    ASSERT_EQ(v1->version(), 1u);
  }
  std::string Db() { return options().work_dir + "/router.db"; }

  void KillTheRouterUnderLoad() {
    a_.Start(cluster(), layer(), x_, 4, hidden(), want_);
    Sleep(500);
    ASSERT_TRUE(cluster().SignalRouter(SIGKILL).ok());
    for (const char* f : {"-wal", "-shm"}) ::unlink((Db() + f).c_str());
    Sleep(700);  // served without a router
    ASSERT_TRUE(cluster().RestartRouter().ok());
    Sleep(1500);
    a_.Stop();
    std::printf("[router kill -9 under load] %lld ok, %lld failed, %lld wrong\n",
                static_cast<long long>(a_.ok.load()), static_cast<long long>(a_.failed.load()),
                static_cast<long long>(a_.wrong.load()));
    EXPECT_GT(a_.ok.load(), 10);
    EXPECT_EQ(a_.failed.load(), 0) << FirstError();
    EXPECT_EQ(a_.wrong.load(), 0);
  }

  // A lost db: the restarted router refuses to start as a new cluster, with the reason in its
  // log (the members serve on from their last placement and bias meanwhile); restored from the
  // backup, it starts and serves version 1.
  void LoseTheDbAndRestoreIt() {
    ASSERT_TRUE(cluster().SignalRouter(SIGKILL).ok());
    ASSERT_EQ(::rename(Db().c_str(), (Db() + ".saved").c_str()), 0);
    absl::Status refused = cluster().RestartRouter();
    EXPECT_FALSE(refused.ok());
    EXPECT_NE(refused.ToString().find("does not exist"), std::string::npos) << refused;
    ASSERT_EQ(::rename((Db() + ".saved").c_str(), Db().c_str()), 0);
    absl::Status again = cluster().RestartRouter();
    ASSERT_TRUE(again.ok()) << again;
    // The client's channel to the old router may fail its first call (the socket it held).
    auto restored = admin().GetBias(layer());
    for (int i = 0; i < 50 && !restored.ok(); ++i) {  // bounded: 5 s
      Sleep(100);
      restored = admin().GetBias(layer());
    }
    ASSERT_TRUE(restored.ok()) << restored.status();
    EXPECT_EQ(restored->version(), 1u);
  }
};

TEST_F(ClusterSurvive, RouterKilledUnderLoadLosesNothing) {
  ASSERT_NO_FATAL_FAILURE(KillTheRouterUnderLoad());
  auto bias = admin().GetBias(layer());
  ASSERT_TRUE(bias.ok()) << bias.status();
  EXPECT_EQ(bias->version(), 1u);
  EXPECT_EQ(bias->reason(), "rollback to 0");
  auto stats = admin().GetLoadStats(layer());
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->history_size(), 2);
  ASSERT_NO_FATAL_FAILURE(LoseTheDbAndRestoreIt());

  // A shard stopped through a router restart comes back by itself: its heartbeats carry the
  // lease the new router restored.
  ASSERT_TRUE(cluster().SignalShard(1, SIGSTOP).ok());
  ASSERT_TRUE(cluster().SignalRouter(SIGKILL).ok());
  ASSERT_TRUE(cluster().RestartRouter().ok());
  ASSERT_TRUE(cluster().SignalShard(1, SIGCONT).ok());
  absl::Status ready = cluster().WaitReady(absl::Seconds(20));
  ASSERT_TRUE(ready.ok()) << ready;
  ASSERT_NO_FATAL_FAILURE(ExpectServedAgain(x_, tokens_, want_));
  auto placement = admin().GetBias(layer());
  ASSERT_TRUE(placement.ok());
  EXPECT_EQ(placement->version(), 1u);
}

// Two replicas per range: the attention node spreads batches over both, and a kill -9 of one
// under load fails no request (its messages go to the other replica within their deadline).
class ClusterReplicas : public SurviveTest {};

TEST_F(ClusterReplicas, KillingAReplicaUnderLoadFailsNoRequest) {
  // shard-2 and shard-3 are replicas of shard-0 and shard-1.
  StartTiny({{0, 8}, {8, 16}, {0, 8}, {8, 16}}, 200, 33);
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  StartTraffic();
  Sleep(1500);
  auto batches = [&](int shard) {
    return ShardMetric(shard, "moe_requests_succeeded_total", {"method=\"Dispatch\""});
  };
  const double to_0 = batches(0), to_2 = batches(2);
  ASSERT_TRUE(cluster().SignalShard(2, SIGKILL).ok());
  Sleep(2000);
  StopTraffic();
  const double failovers = AttentionMetric("moe_failovers_total", {"shard=\"shard-2\""});
  std::printf(
      "[replica kill -9 under load] batches before the kill: shard-0 %.0f, shard-2 %.0f; "
      "%lld ok, %lld failed, %lld wrong, %.0f failed over\n",
      to_0, to_2, static_cast<long long>(ok()), static_cast<long long>(failed()),
      static_cast<long long>(wrong()), failovers);
  EXPECT_GT(to_0, 0);
  EXPECT_GT(to_2, 0) << "the replicas did not share the load";
  EXPECT_GT(ok(), 20);
  EXPECT_EQ(failed(), 0) << FirstError();
  EXPECT_EQ(wrong(), 0);
}

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

// A replica that stalls past the deadline (SIGSTOP, still listed healthy by the router) does
// not fail the requests sent to it: after --hedge_share (0.5) of the time to the deadline the
// message goes to its twin too, the first answer wins, and nothing is counted twice (the
// response's received bytes are one reply's). --hedge_share=0 shows what it saves.
class ClusterHedge : public SurviveTest, public ::testing::WithParamInterface<const char*> {};

TEST_P(ClusterHedge, AStalledReplicaIsHedgedToItsTwin) {
  const std::string hedge = GetParam();
  StartTiny({{0, 8}, {8, 16}, {0, 8}, {8, 16}}, 3000, 33);  // the router notices after 9 s
  options().attention_args = {"--hedge_share=" + hedge};
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  client::ForwardOptions fo;
  fo.timeout = absl::Seconds(1);
  auto calm = Forward(x_, 4, fo);
  ASSERT_TRUE(calm.ok()) << calm.status();
  StartTraffic(absl::Seconds(1));
  Sleep(500);
  ASSERT_TRUE(cluster().SignalShard(3, SIGSTOP).ok());  // a replica of [8, 16)
  Sleep(1000);
  auto during = Forward(x_, 4, fo);
  Sleep(2000);
  StopTraffic();
  ASSERT_TRUE(cluster().SignalShard(3, SIGCONT).ok());
  const double twin = AttentionMetric("moe_hedges_total", {"shard=\"shard-3\"", "winner=\"twin\""});
  std::printf(
      "[replica stalled 3 s, hedge_share %s] %lld ok, %lld failed, %lld wrong, %.0f "
      "answered by the twin\n",
      hedge.c_str(), static_cast<long long>(ok()), static_cast<long long>(failed()),
      static_cast<long long>(wrong()), twin);
  EXPECT_EQ(wrong(), 0);
  if (hedge == "0") {
    EXPECT_GT(failed(), 0) << "without hedging the stall should cost requests";
    EXPECT_EQ(twin, 0);
    return;
  }
  EXPECT_GT(ok(), 10);
  EXPECT_EQ(failed(), 0) << FirstError();
  EXPECT_GT(twin, 0);
  ASSERT_TRUE(during.ok()) << during.status();
  EXPECT_TRUE(SameBits(during->out, want_));
  EXPECT_EQ(during->dispatch_bytes_received, calm->dispatch_bytes_received)
      << "a hedged answer counted twice";
}

INSTANTIATE_TEST_SUITE_P(HedgeShare, ClusterHedge, ::testing::Values("0.5", "0"),
                         [](const auto& info) {
                           return std::string(info.param) == "0" ? "off" : "half";
                         });

// DEGRADE also covers a shard that stalls or dies after its messages went out (the router
// still lists it healthy): with no replica to answer, its experts are left out by the same
// rule when the expert deadline passes (a stall) or the stream breaks (a kill); FAIL answers
// DEADLINE_EXCEEDED / UNAVAILABLE naming the shard.
class ClusterDegrade : public SurviveTest {
 protected:
  void StartDegradeCluster(int heartbeat_ms) {
    StartTiny({{0, 8}, {8, 16}}, heartbeat_ms, 41, 16);
    ASSERT_NO_FATAL_FAILURE(StartCluster());
    w_ = DegradeOracle(oracle(), cfg(), x_, tokens_, /*gone_from=*/8);
    client::ClientOptions co = cluster().client_options();
    co.timeout = absl::Seconds(2);
    auto c = client::MoeClient::Create(co);
    ASSERT_TRUE(c.ok());
    client_ = std::move(*c);
    degrade_.missing_experts = v1::MISSING_EXPERTS_DEGRADE;
    degrade_.return_routing = true;
  }
  // FAIL (the default) on a stall: DEADLINE_EXCEEDED (or UNAVAILABLE once gRPC gives the
  // connection up) naming the shard.
  void ExpectFailNamesTheShard() {
    auto failed = client_->Forward(layer(), x_, tokens_, hidden());
    ASSERT_FALSE(failed.ok());
    EXPECT_TRUE(failed.status().code() == absl::StatusCode::kDeadlineExceeded ||
                failed.status().code() == absl::StatusCode::kUnavailable)
        << failed.status();
    EXPECT_NE(failed.status().message().find("shard-1"), absl::string_view::npos)
        << failed.status();
  }

  DegradeWant w_;
  std::unique_ptr<client::MoeClient> client_;
  client::ForwardOptions degrade_;
};

// An expert range with no replica left: by default (FAIL) the request is UNAVAILABLE naming
// the shard; with DEGRADE the missing experts are skipped, the token's other weights scaled to
// the sum all k had, and the response says which experts and how many pairs. Oracle: the
// in-process layer's stages on a routing degraded here, by the rule of attention.proto.
TEST_F(ClusterDegrade, MissingExpertsFailByDefaultOrAreSkippedAndSaid) {
  ASSERT_NO_FATAL_FAILURE(StartDegradeCluster(200));
  ASSERT_TRUE(cluster().SignalShard(1, SIGKILL).ok());
  auto failed = Forward(x_, tokens_);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  EXPECT_NE(failed.status().message().find("shard-1"), absl::string_view::npos) << failed.status();

  client::ForwardOptions degrade;
  degrade.missing_experts = v1::MISSING_EXPERTS_DEGRADE;
  degrade.return_routing = true;
  absl::StatusOr<client::ForwardResult> got = absl::UnavailableError("not yet");
  for (int i = 0; i < 100 && !got.ok(); ++i) {  // until the router has marked shard-1 (10 s)
    got = Forward(x_, tokens_, degrade);
    if (!got.ok()) Sleep(100);
  }
  ASSERT_TRUE(got.ok()) << got.status();
  const DegradeWant& w = w_;  // the same routing, experts [8, 16) left out by the rule
  EXPECT_EQ(got->missing_experts, w.missing);
  EXPECT_EQ(got->degraded_pairs, w.pairs);
  EXPECT_GT(w.pairs, 0);
  EXPECT_EQ(got->weights, w.routing.weights) << "the response carries the weights it used";
  EXPECT_TRUE(SameBits(got->out, w.out)) << "DEGRADE differs from the rule";
  EXPECT_EQ(AttentionMetric("moe_degraded_pairs_total"), static_cast<double>(w.pairs));
  std::printf("[degrade] %lld of %lld pairs skipped (experts %zu), output as the rule says\n",
              static_cast<long long>(w.pairs), static_cast<long long>(tokens_ * cfg().top_k),
              w.missing.size());
}

TEST_F(ClusterDegrade, AShardLostMidRequestIsLeftOutUnderDegrade) {
  ASSERT_NO_FATAL_FAILURE(StartDegradeCluster(2000));  // the router notices only after 6 s
  // Warm: every shard's stream is open (a stall then meets a live connection, not a new one).
  auto warm = client_->Forward(layer(), x_, tokens_, hidden(), degrade_);
  ASSERT_TRUE(warm.ok()) << warm.status();
  ASSERT_EQ(warm->degraded_pairs, 0);
  // A stall: shard-1 stopped just before the request; its message waits to the expert deadline.
  ASSERT_TRUE(cluster().SignalShard(1, SIGSTOP).ok());
  const absl::Time t0 = absl::Now();
  auto stalled = client_->Forward(layer(), x_, tokens_, hidden(), degrade_);
  const absl::Duration took = absl::Now() - t0;
  ASSERT_TRUE(stalled.ok()) << stalled.status();
  EXPECT_EQ(stalled->missing_experts, w_.missing);
  EXPECT_EQ(stalled->degraded_pairs, w_.pairs);
  EXPECT_EQ(stalled->weights, w_.routing.weights);
  EXPECT_TRUE(SameBits(stalled->out, w_.out)) << "DEGRADE after a stall differs from the rule";
  EXPECT_LT(took, absl::Seconds(2));  // within the caller's deadline
  ExpectFailNamesTheShard();
  ASSERT_TRUE(cluster().SignalShard(1, SIGCONT).ok());

  // A kill while a request is in flight: its stream breaks; DEGRADE answers by the rule.
  Sleep(500);
  ASSERT_TRUE(cluster().SignalShard(1, SIGSTOP).ok());
  std::thread killer([&] {
    Sleep(150);
    (void)cluster().SignalShard(1, SIGKILL);
  });
  auto killed = client_->Forward(layer(), x_, tokens_, hidden(), degrade_);
  killer.join();
  ASSERT_TRUE(killed.ok()) << killed.status();
  EXPECT_EQ(killed->missing_experts, w_.missing);
  EXPECT_TRUE(SameBits(killed->out, w_.out)) << "DEGRADE after a kill differs from the rule";
  std::printf(
      "[degrade mid-request] stall answered in %.0f ms, kill answered, %lld pairs left out\n",
      absl::ToDoubleMilliseconds(took), static_cast<long long>(w_.pairs));
}

}  // namespace
}  // namespace moe
