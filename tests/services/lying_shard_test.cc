// A lying member is caught (docs/survive.md): 4 shards, 2 replicas per range; under traffic,
// shard-3 restarts (a valid identity, its own token) serving the experts of another checkpoint.
// Two clients send Forward requests and check every answer against the in-process oracle; the
// attention node's twin audits (--audit_share, MOE_AUDIT_SHARE, 16 here) compare a sampled share of
// messages between replicas. Measured: the answers shard-3 got wrong before it was caught, the time
// from its first wrong answer to the router's quarantine, and that nothing is wrong after it. Then:
// the quarantine holds across shard-3's heartbeats, only an attention member may report one
// (an expert's token and no token are refused), only the admin may lift it.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/v1/router.grpc.pb.h"
#include "services/checkpoint/synthetic.h"
#include "services/transport/channel.h"
#include "services/transport/security.h"
#include "tests/services/cluster_fixtures.h"
#include "tests/services/cluster_test_base.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;
using tensor::Bf16;

// The tiny preset's checkpoint with other weights (seed 6, not the cluster's 5).
const std::string& OtherCheckpoint() {
  static const std::string* dir = [] {
    auto* d = new std::string(testing::MakeTempDir("ckpt_tiny_other"));
    checkpoint::SyntheticOptions so;
    so.seed = 6;
    so.router_skew = 1.0;
    so.single_file = true;
    EXPECT_TRUE(checkpoint::WriteSyntheticCheckpoint(*PresetConfig("tiny"), *d, so).ok());
    return d;
  }();
  return *dir;
}

std::string ReadWord(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  f >> s;
  return s;
}

grpc::Status Report(const tools::LocalCluster& c, const std::string& token,
                    const std::string& shard) {
  auto router = v1::RouterService::NewStub(transport::MakeChannel(
      c.router_endpoint(), transport::kDefaultMaxMessageBytes, grpc::InsecureChannelCredentials()));
  v1::QuarantineShardRequest r;
  r.set_shard(shard);
  r.set_evidence("forged");
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (!token.empty()) ctx.AddMetadata(transport::kClusterTokenMetadata, token);
  v1::QuarantineShardResponse resp;
  return router->QuarantineShard(&ctx, r, &resp);
}

class LyingShard : public testing::ClusterTest {};

TEST_F(LyingShard, IsQuarantinedAndNothingIsWrongAfter) {
  UsePreset("tiny", {{0, 8}, {8, 16}, {0, 8}, {8, 16}});
  const char* env = std::getenv("MOE_AUDIT_SHARE");
  const int share = env != nullptr && *env != '\0' ? std::atoi(env) : 16;
  options().admin_token = "admin-secret";
  options().router_args = {"--heartbeat_interval_ms=200"};
  options().attention_args = {"--audit_share=" + std::to_string(share)};
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  tools::LocalCluster& c = cluster();
  const std::vector<Bf16> x = Hidden(4, 61), want = Want(x, 4);
  testing::Traffic a, b;
  a.record = b.record = true;
  a.Start(c, layer(), x, 4, hidden(), want, absl::Seconds(3));
  b.Start(c, layer(), x, 4, hidden(), want, absl::Seconds(3));
  std::this_thread::sleep_for(std::chrono::seconds(1));  // honest traffic first
  // shard-3 restarted under its own name and token, serving other weights.
  ASSERT_TRUE(c.StopShard(3).ok());
  ASSERT_TRUE(c.RestartShard(3, {"--checkpoint=" + OtherCheckpoint()}).ok());
  // Until the router quarantines it (bounded: 60 s).
  Clock::time_point quarantined_at{};
  const Clock::time_point until = Clock::now() + std::chrono::seconds(60);
  while (Clock::now() < until) {
    if (RouterMetric("moe_expert_shards", {"health=\"quarantined\""}) == 1) {
      quarantined_at = Clock::now();
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_NE(quarantined_at, Clock::time_point{}) << "the lying shard was not caught in 60 s";
  std::this_thread::sleep_for(std::chrono::seconds(3));  // traffic after the quarantine
  a.Stop();
  b.Stop();
  std::vector<testing::Traffic::Sample> samples = a.samples;
  samples.insert(samples.end(), b.samples.begin(), b.samples.end());
  Clock::time_point first_wrong = Clock::time_point::max();
  int64_t wrong_before = 0, wrong_after = 0, right_after = 0;
  // A request that started 100 ms after the quarantine was published meets a placement
  // without the liar (the watch delivers it in milliseconds; this node stopped at once anyway).
  const Clock::time_point settled = quarantined_at + std::chrono::milliseconds(100);
  for (const auto& s : samples) {
    if (s.wrong) first_wrong = std::min(first_wrong, s.start);
    if (s.start < settled) {
      wrong_before += s.wrong ? 1 : 0;
    } else {
      wrong_after += s.wrong ? 1 : 0;
      right_after += s.ok ? 1 : 0;
    }
  }
  const double to_quarantine =
      first_wrong == Clock::time_point::max()
          ? 0
          : std::chrono::duration<double>(quarantined_at - first_wrong).count();
  std::printf(
      "[liar] audit share 1/%d: %zu requests, %lld wrong before the quarantine, %lld after "
      "(%lld right after); quarantined %.2f s after its first wrong answer; this node counted "
      "%.0f suspect answers of it and audits agree %.0f, caught %.0f, skipped %.0f\n",
      share, samples.size(), static_cast<long long>(wrong_before),
      static_cast<long long>(wrong_after), static_cast<long long>(right_after), to_quarantine,
      AttentionMetric("moe_suspect_answers_total"),
      AttentionMetric("moe_twin_audits_total", {"outcome=\"agree\""}),
      AttentionMetric("moe_twin_audits_total", {"outcome=\"caught\""}),
      AttentionMetric("moe_twin_audits_total", {"outcome=\"skipped\""}));
  EXPECT_EQ(wrong_after, 0);
  EXPECT_GT(right_after, 20);
  EXPECT_EQ(a.failed.load() + b.failed.load(), 0) << (a.errors.empty() ? "" : a.errors[0]);
  EXPECT_GE(AttentionMetric("moe_quarantines_total", {"shard=\"shard-3\""}), 1);
  EXPECT_LE(to_quarantine, 10.0);  // 2 s and less measured; loaded CI machines get margin

  // The placement says so, and keeps saying so while shard-3 heartbeats.
  std::this_thread::sleep_for(std::chrono::seconds(1));
  auto placement = admin().GetPlacement();
  ASSERT_TRUE(placement.ok()) << placement.status();
  for (const v1::ShardInfo& s : placement->shards()) {
    EXPECT_EQ(s.quarantined(), s.shard() == "shard-3") << s.shard();
    EXPECT_EQ(s.healthy(), s.shard() != "shard-3") << s.shard();
    if (s.shard() == "shard-3") {
      EXPECT_THAT(s.quarantine_reason(), ::testing::HasSubstr("wrong answers")) << s.shard();
      EXPECT_LT(s.last_seen_ms(), 1000);  // alive, heartbeating
    }
  }
  // Only an attention member reports, and never takes a range's last replica.
  EXPECT_EQ(Report(c, "", "shard-0").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Report(c, ReadWord(c.work_dir() + "/shard-0.token"), "shard-1").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);  // an expert's token is no attention member's
  const std::string attention = ReadWord(c.work_dir() + "/attention_token");
  EXPECT_EQ(Report(c, attention, "shard-1").error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);  // the last healthy one of [8, 16)
  EXPECT_EQ(RouterMetric("moe_expert_shards", {"health=\"healthy\""}), 3);
  // Only the admin lifts it.
  EXPECT_EQ(user().ReleaseShard("shard-3").status().code(), absl::StatusCode::kPermissionDenied);
  auto released = admin().ReleaseShard("shard-3");
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_TRUE(*released);
  for (int i = 0; i < 100 && RouterMetric("moe_expert_shards", {"health=\"healthy\""}) != 4; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(RouterMetric("moe_expert_shards", {"health=\"healthy\""}), 4);
  // This node keeps it out by its own judgement: still right.
  ExpectOracleAnswer(4, 62);
  for (const auto& [name, pid] : c.Processes()) EXPECT_EQ(::kill(pid, 0), 0) << name;
}

}  // namespace
}  // namespace moe
