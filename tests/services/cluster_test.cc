// Multi-process tests of the disaggregated layer: real router-svc, expert-svc and attention-svc
// processes on loopback (port 0), started by LocalCluster, driven through the client SDK.
// Oracles: the in-process CpuMoeLayer on the same checkpoint (bit-exact with per-pair replies),
// cpu::RunExperts for single dispatched batches, and the balance metrics of the router.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "inference/grpc_inference.grpc.pb.h"
#include "moe/v1/attention.grpc.pb.h"
#include "moe/v1/expert.grpc.pb.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/moe_client.h"
#include "services/common/cpus.h"
#include "services/dataplane/data_plane.h"
#include "services/dataplane/payload_mac.h"
#include "services/dataplane/ucx_worker.h"
#include "services/numerics/cpu/expert_ffn.h"
#include "services/numerics/cpu/kernel_choice.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/tools/load_generator.h"
#include "services/tools/local_cluster.h"
#include "services/tools/tensor_file.h"
#include "services/transport/expert_stream.h"
#include "services/transport/grpc_server.h"
#include "services/transport/health_check.h"
#include "services/transport/tensor_codec.h"
#include "tests/common/metrics_text.h"
#include "tests/services/cluster_fixtures.h"
#include "tests/services/cluster_test_base.h"

namespace moe {
namespace {

using tensor::Bf16;
using testing::Concat;
using testing::kGrpc;
using testing::MakeTempDir;
using testing::SameBits;
using testing::UcxArgs;
using tools::LocalCluster;

struct ClusterCase {
  std::string name;
  std::string preset;
  std::vector<std::pair<int64_t, int64_t>> shards;  // unequal on purpose
  std::vector<std::string> attention_args;
  std::vector<std::string> expert_args;
  // The data plane every expert payload must have taken ("grpc" or "ucx"; moe_wire_bytes_total
  // of attention-svc by transport).
  std::string transport = "grpc";
  // attention-svc's --micro_batches: the oracle is the in-process layer run on the same
  // micro-batches (the shards then see other per-expert batch sizes, which may pick the other
  // expert kernel: decode and panel agree within kExpertFfnTolerance, not bit for bit).
  int64_t micro_batches = 1;
  // "tls": every channel TLS, servers verified (clients need no certificate); "mtls": both
  // sides verified; "": plaintext.
  std::string tls = "";
};

// The in-process layer over the micro-batches attention-svc makes of T tokens (ceil(T / n)
// tokens each), outputs and routing concatenated.
absl::StatusOr<numerics::LayerOutput> ForwardInMicroBatches(numerics::cpu::CpuMoeLayer& layer,
                                                            const ModelConfig& cfg,
                                                            const std::vector<Bf16>& x,
                                                            int64_t tokens, int64_t n) {
  const int64_t per = (tokens + std::min(n, tokens) - 1) / std::min(n, tokens);
  numerics::LayerOutput all;
  for (int64_t lo = 0; lo < tokens; lo += per) {
    const int64_t rows = std::min(per, tokens - lo);
    auto part = layer.Forward(absl::MakeConstSpan(x).subspan(lo * cfg.hidden, rows * cfg.hidden),
                              rows, cfg.hidden);
    if (!part.ok()) return part.status();
    all.out.insert(all.out.end(), part->out.begin(), part->out.end());
    all.routing.expert_ids.insert(all.routing.expert_ids.end(), part->routing.expert_ids.begin(),
                                  part->routing.expert_ids.end());
    all.routing.weights.insert(all.routing.weights.end(), part->routing.weights.begin(),
                               part->routing.weights.end());
  }
  return all;
}

// ctest names the instances by this, not by a dump of the struct's bytes.
void PrintTo(const ClusterCase& c, std::ostream* os) { *os << c.name; }

class ClusterEquivalence : public testing::ClusterTestWithParam<ClusterCase> {
 protected:
  void StartCase() {
    const ClusterCase& p = GetParam();
    UsePreset(p.preset, p.shards);
    options().attention_args = p.attention_args;
    options().expert_args = p.expert_args;
    if (!p.tls.empty()) {
      const std::string pki = testing::MakeTestPki(testing::MakeTempDir("pki"));
      ASSERT_FALSE(pki.empty());
      options().tls = testing::MemberTls(pki, "{name}");  // each process its own identity
      options().tls.require_client_cert = p.tls == "mtls";
    }
    ASSERT_NO_FATAL_FAILURE(StartCluster());
  }

  absl::StatusOr<numerics::LayerOutput> Oracle(const std::vector<Bf16>& x, int64_t tokens) {
    return ForwardInMicroBatches(oracle(), cfg(), x, tokens, GetParam().micro_batches);
  }

  // Per-pair replies bit-exact with their routing, partial sums within their bounds, fp32 input
  // rounded to bf16 on arrival (RNE): the same result.
  void CheckForwards(int64_t tokens) {
    SCOPED_TRACE(absl::StrCat(GetParam().preset, " T=", tokens));
    const std::vector<Bf16> x = Hidden(tokens, 100 + tokens);
    auto want = Oracle(x, tokens);
    ASSERT_TRUE(want.ok());
    client::ForwardOptions per_pair;
    per_pair.return_routing = true;
    per_pair.reply_mode = v1::REPLY_MODE_PER_PAIR;
    auto got = Forward(x, tokens, per_pair);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->bias_version, 0u);
    EXPECT_EQ(got->expert_ids, want->routing.expert_ids);
    EXPECT_EQ(got->weights, want->routing.weights);
    EXPECT_TRUE(SameBits(got->out, want->out)) << "per-pair replies must be bit-exact";

    client::ForwardOptions partial;
    partial.reply_mode = v1::REPLY_MODE_PARTIAL_SUM;
    auto sum = Forward(x, tokens, partial);
    ASSERT_TRUE(sum.ok()) << sum.status();
    const auto [fraction, worst] =
        testing::ExpectWithinPartialSumBounds(sum->out, want->out, tokens, hidden());
    std::printf(
        "[partial sums %s T=%lld] %.4f of %zu outputs differ, worst %.2e of the row scale\n",
        GetParam().preset.c_str(), static_cast<long long>(tokens), fraction, sum->out.size(),
        worst);

    std::vector<float> xf(x.size());
    for (size_t i = 0; i < x.size(); ++i) xf[i] = x[i].ToFloat();
    auto from_f32 = user().ForwardF32(layer(), xf, tokens, hidden(), per_pair);
    ASSERT_TRUE(from_f32.ok()) << from_f32.status();
    EXPECT_TRUE(SameBits(from_f32->out, want->out));
  }

  // The streaming RPC: several batches on one stream, each with its own result; a bad batch in
  // the middle gets its own error and the stream goes on.
  void CheckStream() {
    auto stream = user().OpenForwardStream(absl::Seconds(60));
    ASSERT_TRUE(stream.ok());
    std::map<uint64_t, std::vector<Bf16>> expected;
    for (int64_t tokens : {3, 9}) {
      const std::vector<Bf16> x = Hidden(tokens, 7 + tokens);
      auto id = (*stream)->Send(layer(), x, tokens, hidden());
      ASSERT_TRUE(id.ok());
      expected[*id] = Oracle(x, tokens)->out;
    }
    auto bad = (*stream)->Send(layer() + 100, Hidden(2, 1), 2, hidden());
    ASSERT_TRUE(bad.ok());
    ASSERT_TRUE((*stream)->CloseSend().ok());
    int received = 0;
    for (int i = 0; i < 10; ++i) {
      auto r = (*stream)->Receive();
      if (!r.ok()) {
        EXPECT_EQ(r.status().code(), absl::StatusCode::kOutOfRange) << r.status();
        break;
      }
      ++received;
      if (r->first == *bad) {
        EXPECT_EQ(r->second.status().code(), absl::StatusCode::kNotFound);
      } else {
        ASSERT_TRUE(r->second.ok()) << r->second.status();
        EXPECT_TRUE(SameBits(r->second->out, expected.at(r->first)));
      }
    }
    EXPECT_EQ(received, 3);
  }

  // Every expert payload took the case's data plane, both ways; on UCX, the lanes UCX really
  // selected (read from UCX, both sides): shared memory where the case says so, TCP where it
  // says so (a "shared memory" case on TCP fails here), and the shards took their payloads from
  // UCX too.
  void CheckLanes() {
    const ClusterCase& p = GetParam();
    const std::string other = p.transport == "ucx" ? "grpc" : "ucx";
    for (const char* direction : {"sent", "received"}) {
      SCOPED_TRACE(direction);
      const std::vector<std::string> labels = {absl::StrCat("direction=\"", direction, "\""),
                                               "peer=\"expert\""};
      EXPECT_GT(AttentionMetric("moe_wire_bytes_total",
                                Concat(labels, {absl::StrCat("transport=\"", p.transport, "\"")})),
                0);
      EXPECT_EQ(AttentionMetric("moe_wire_bytes_total",
                                Concat(labels, {absl::StrCat("transport=\"", other, "\"")})),
                0);
    }
    if (p.transport != "ucx") return;
    const std::string kind = p.name.find("_tcp") != std::string::npos ? "tcp" : "shm";
    const std::string theirs =
        kind == "tcp" ? "shard_lanes=\"tcp\"" : "shard_lanes=\"shm (posix)\"";
    for (int i = 0; i < cluster().num_shards(); ++i) {
      const std::string shard = absl::StrCat("shard=\"shard-", i, "\"");
      EXPECT_EQ(
          AttentionMetric("moe_data_plane_lane_info", {shard, absl::StrCat("kind=\"", kind, "\"")}),
          1)
          << "shard-" << i << " is not on " << kind;
      EXPECT_EQ(AttentionMetric("moe_data_plane_lane_info", {shard, theirs}), 1);
      EXPECT_GT(
          ShardMetric(i, "moe_wire_bytes_total", {"direction=\"received\"", "transport=\"ucx\""}),
          0);
    }
  }
};

TEST_P(ClusterEquivalence, MatchesTheInProcessLayer) {
  if (GetParam().transport == "ucx" && !dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  ASSERT_NO_FATAL_FAILURE(StartCase());
  // 1 and 5 tokens take the decode kernels; 64 tokens gives hot experts >= 16 tokens (the
  // prefill kernel), so both expert paths cross the wire.
  for (int64_t tokens : {1, 5, 64, 256}) ASSERT_NO_FATAL_FAILURE(CheckForwards(tokens));
  ASSERT_NO_FATAL_FAILURE(CheckStream());
  CheckLanes();
}

// mid_chunked: 64 KiB dispatch messages, so each shard's batch goes out in many messages split
// at expert boundaries (as K3 batches of thousands of tokens do at the 64 MiB default).
INSTANTIATE_TEST_SUITE_P(
    Presets, ClusterEquivalence,
    ::testing::Values(
        ClusterCase{"tiny", "tiny", {{0, 5}, {5, 16}}, kGrpc, kGrpc},
        ClusterCase{"mid", "mid", {{0, 40}, {40, 128}}, kGrpc, kGrpc},
        ClusterCase{"mid_chunked",
                    "mid",
                    {{0, 40}, {40, 128}},
                    Concat(kGrpc, {"--max_dispatch_bytes=65536"}),
                    kGrpc},
        // The out-of-band data plane over shared memory and over TCP.
        ClusterCase{
            "tiny_ucx_shm", "tiny", {{0, 5}, {5, 16}}, UcxArgs("posix"), UcxArgs("posix"), "ucx"},
        ClusterCase{
            "mid_ucx_shm", "mid", {{0, 40}, {40, 128}}, UcxArgs("posix"), UcxArgs("posix"), "ucx"},
        ClusterCase{
            "mid_ucx_tcp", "mid", {{0, 40}, {40, 128}}, UcxArgs("tcp"), UcxArgs("tcp"), "ucx"},
        ClusterCase{
            "tiny_ucx_tcp", "tiny", {{0, 5}, {5, 16}}, UcxArgs("tcp"), UcxArgs("tcp"), "ucx"},
        // Three micro-batches, two in flight: the same bits.
        ClusterCase{"mid_ucx_micro_batches",
                    "mid",
                    {{0, 40}, {40, 128}},
                    Concat(UcxArgs("posix"), {"--micro_batches=3"}),
                    UcxArgs("posix"),
                    "ucx",
                    3},
        ClusterCase{"mid_chunked_ucx_shm",
                    "mid",
                    {{0, 40}, {40, 128}},
                    Concat(UcxArgs("posix"), {"--max_dispatch_bytes=65536"}),
                    UcxArgs("posix"),
                    "ucx"},
        // TLS on every channel: servers verified only, and mutual (the data plane is opened
        // through the mutually authenticated channel, docs/security.md).
        ClusterCase{"tiny_tls", "tiny", {{0, 5}, {5, 16}}, kGrpc, kGrpc, "grpc", 1, "tls"},
        ClusterCase{"mid_mtls_ucx_shm",
                    "mid",
                    {{0, 40}, {40, 128}},
                    UcxArgs("posix"),
                    UcxArgs("posix"),
                    "ucx",
                    1,
                    "mtls"}),
    [](const auto& info) { return info.param.name; });

// A killed shard gives UNAVAILABLE naming it within the deadline; after it restarts (new port)
// and registers again, requests succeed. A stalled shard gives DEADLINE_EXCEEDED naming it.
class ClusterFailures : public testing::ClusterTest {
 protected:
  void SetUp() override {
    UsePreset("tiny", {{0, 8}, {8, 16}});
    options().router_args = {"--heartbeat_interval_ms=200"};
    ASSERT_NO_FATAL_FAILURE(StartCluster());
    x_ = Hidden(kTokens, 11);
    auto in_process = oracle().Forward(x_, kTokens, hidden());
    ASSERT_TRUE(in_process.ok());
    want_ = in_process->out;
    // The batch needs both shards (else a stalled or dead shard would go unnoticed).
    const auto& ids = in_process->routing.expert_ids;
    ASSERT_TRUE(std::any_of(ids.begin(), ids.end(), [](int32_t e) { return e < 8; }));
    ASSERT_TRUE(std::any_of(ids.begin(), ids.end(), [](int32_t e) { return e >= 8; }));
    ASSERT_TRUE(Forward(x_, kTokens).ok());
  }

  // The batch fails with `code` naming `shard` within `bound`.
  void ExpectNamedFailure(absl::StatusCode code, const std::string& shard, absl::Duration timeout,
                          absl::Duration bound) {
    client::ForwardOptions fo;
    fo.timeout = timeout;
    const absl::Time t0 = absl::Now();
    auto r = Forward(x_, kTokens, fo);
    const absl::Duration took = absl::Now() - t0;
    ASSERT_FALSE(r.ok()) << "bias version " << r->bias_version << ", dispatch bytes "
                         << r->dispatch_bytes_sent;
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_NE(r.status().message().find(shard), absl::string_view::npos) << r.status();
    EXPECT_LT(took, bound);
  }

  static constexpr int64_t kTokens = 32;  // with 16 experts and k = 4, both shards are needed
  std::vector<Bf16> x_, want_;
};

TEST_F(ClusterFailures, DeadAndStalledShardsAreNamedAndRecovered) {
  ASSERT_TRUE(cluster().SignalShard(1, SIGKILL).ok());
  ExpectNamedFailure(absl::StatusCode::kUnavailable, "shard-1", absl::Seconds(5), absl::Seconds(5));
  // Once the heartbeats are missed the router marks it unhealthy; still named.
  std::this_thread::sleep_for(std::chrono::milliseconds(900));
  ExpectNamedFailure(absl::StatusCode::kUnavailable, "shard-1", absl::Seconds(5), absl::Seconds(5));
  ASSERT_TRUE(cluster().RestartShard(1).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectServedAgain(x_, kTokens, want_));

  // Stalled (SIGSTOP): the deadline fires and names the shard; after SIGCONT it serves again.
  ASSERT_TRUE(cluster().SignalShard(0, SIGSTOP).ok());
  ExpectNamedFailure(absl::StatusCode::kDeadlineExceeded, "shard-0", absl::Milliseconds(800),
                     absl::Seconds(2));
  ASSERT_TRUE(cluster().SignalShard(0, SIGCONT).ok());
  ExpectServedAgain(x_, kTokens, want_);
}

// Skewed traffic, Rebalance, fresh traffic: MaxVio over the next window falls. Admin calls need
// the token; rollback restores the checkpoint's bias.
class ClusterRebalance : public testing::ClusterTest {
 protected:
  void SetUp() override {
    UsePreset("mid", {{0, 40}, {40, 128}});
    options().threads = 0;  // the default share: 400 requests of mid traffic
    options().admin_token = "s3cret";
    options().attention_args = {"--report_interval_ms=100"};
    ASSERT_NO_FATAL_FAILURE(StartCluster());
  }

  // 200 requests of 64 tokens (12800 tokens: q = 800 per expert, noise floor MaxVio ~0.11),
  // then the router's window once it holds them all.
  absl::StatusOr<v1::LoadStats> TrafficAndItsWindow(uint64_t seed) {
    tools::LoadOptions lo = Load(2, 64, absl::Seconds(60), 200);
    lo.distinct_batches = 200;
    lo.seed = seed;
    auto r = tools::RunLoad(admin(), lo);
    if (!r.ok()) return r.status();
    EXPECT_EQ(r->ok, 200) << r->Format();
    for (int i = 0; i < 100; ++i) {  // bounded: reports arrive every 100 ms
      auto s = admin().GetLoadStats(layer());
      if (!s.ok() || s->window_tokens() >= 200 * 64) return s;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return absl::DeadlineExceededError("statistics did not arrive");
  }

  // Without the token: refused; a dry run needs none and changes nothing.
  void ExpectAnonymousRebalanceOnlyDryRuns() {
    auto refused = user().Rebalance(layer(), false);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
    auto dry = user().Rebalance(layer(), true);
    ASSERT_TRUE(dry.ok()) << dry.status();
    EXPECT_FALSE(dry->applied());
    EXPECT_EQ(admin().GetBias(layer())->version(), 0u);
  }

  // A rollback to version 0 is version 2 in the history and serves the checkpoint's bias.
  void ExpectRollbackToTheCheckpoint() {
    auto rolled = admin().RollbackBias(layer(), 0);
    ASSERT_TRUE(rolled.ok()) << rolled.status();
    EXPECT_EQ(rolled->version(), 2u);
    auto v0 = admin().GetLoadStats(layer());
    ASSERT_TRUE(v0.ok());
    EXPECT_EQ(v0->history_size(), 3);
    EXPECT_EQ(v0->history(2).reason(), "rollback to 0");
    auto bias = admin().GetBias(layer());
    ASSERT_TRUE(bias.ok());
    EXPECT_EQ(std::vector<float>(bias->bias().begin(), bias->bias().end()),
              oracle().weights().bias);
  }
};

// Threads of `pid` whose name (/proc/<pid>/task/<tid>/comm) is `name`.
int ThreadsNamed(pid_t pid, const std::string& name) {
  int n = 0;
  const std::string dir = absl::StrCat("/proc/", pid, "/task");
  for (const auto& task : std::filesystem::directory_iterator(dir)) {
    std::ifstream comm(task.path() / "comm");
    std::string line;
    if (std::getline(comm, line) && line == name) ++n;
  }
  return n;
}

// With --threads 0 the shards share the CPUs with the attention node (each its share of the
// three processes) and the attention node, whose dense phases run while the shards wait, gets
// all of them: read from the processes' own pool workers (a pool of n runs n - 1 workers and
// the caller).
TEST_F(ClusterRebalance, TheDefaultGivesEachShardItsShareAndTheAttentionNodeEveryCpu) {
  const int cpus = UsableCpus();
  const int share = std::max(1, cpus / (cluster().num_shards() + 1));
  int shards = 0;
  for (const auto& [name, pid] : cluster().Processes()) {
    if (name == "attention-svc") {
      EXPECT_EQ(ThreadsNamed(pid, "layer-compute"), cpus - 1) << cpus << " CPUs";
    } else if (absl::StartsWith(name, "shard-")) {
      ++shards;
      EXPECT_EQ(ThreadsNamed(pid, "expert-pool"), share - 1) << name << ", " << cpus << " CPUs";
      EXPECT_EQ(ThreadsNamed(pid, "expert-compute"), 1) << name;
    }
  }
  EXPECT_EQ(shards, 2);
}

TEST_F(ClusterRebalance, LowersMaxVioOnTheNextWindow) {
  auto before = TrafficAndItsWindow(1);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->window_tokens(), 200 * 64);
  int64_t sum = 0;
  for (int64_t v : before->window_loads()) sum += v;
  EXPECT_EQ(sum, 200 * 64 * cfg().top_k);  // every routed pair counted once
  const double vio_before = before->window_balance().max_vio();
  // The router exports the shards' balancedness of the same window (mean / max, vLLM's form).
  ASSERT_GT(before->window_balance().shard_max_over_mean(), 1.0);
  EXPECT_NEAR(RouterMetric("moe_balancedness", {absl::StrCat("layer=\"", layer(), "\"")}),
              1.0 / before->window_balance().shard_max_over_mean(), 1e-6);
  ASSERT_NO_FATAL_FAILURE(ExpectAnonymousRebalanceOnlyDryRuns());

  auto rb = admin().Rebalance(layer(), false);
  ASSERT_TRUE(rb.ok()) << rb.status();
  EXPECT_TRUE(rb->applied());
  EXPECT_EQ(rb->new_bias().version(), 1u);
  EXPECT_NEAR(rb->before().max_vio(), vio_before, 1e-12);
  EXPECT_LT(rb->predicted_after().max_vio(), 0.05);

  // Once the attention node routes with version 1, fresh inputs.
  ASSERT_TRUE(AwaitBiasVersion(1));
  auto after = TrafficAndItsWindow(2);
  ASSERT_TRUE(after.ok()) << after.status();
  const double vio_after = after->window_balance().max_vio();
  std::printf(
      "[rebalance] MaxVio %.3f before, predicted %.3f, measured %.3f after (noise floor "
      "%.3f)\n",
      vio_before, rb->predicted_after().max_vio(), vio_after, rb->noise_floor_max_vio());
  EXPECT_GT(vio_before, 1.0);  // the skewed checkpoint is far from balanced
  EXPECT_LT(vio_after, 0.5);
  EXPECT_LT(vio_after, vio_before / 3);
  ExpectRollbackToTheCheckpoint();
}

}  // namespace
}  // namespace moe
