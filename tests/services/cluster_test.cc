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
#include <mutex>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "inference/grpc_inference.grpc.pb.h"
#include "moe/v1/attention.grpc.pb.h"
#include "moe/v1/expert.grpc.pb.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/moe_client.h"
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

namespace moe {
namespace {

using tensor::Bf16;
using testing::CheckpointFor;
using testing::ClientFor;
using testing::Concat;
using testing::InProcessLayer;
using testing::kGrpc;
using testing::MakeTempDir;
using testing::SameBits;
using testing::TestCluster;
using testing::UcxArgs;
using tools::LocalCluster;
using tools::LocalClusterOptions;

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

class ClusterEquivalence : public ::testing::TestWithParam<ClusterCase> {};

TEST_P(ClusterEquivalence, MatchesTheInProcessLayer) {
  const ClusterCase& p = GetParam();
  if (p.transport == "ucx" && !dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  const std::string& dir = CheckpointFor(p.preset);
  ModelConfig cfg;
  auto local = InProcessLayer(dir, &cfg);
  LocalClusterOptions o = TestCluster(dir, p.shards);
  o.attention_args = p.attention_args;
  o.expert_args = p.expert_args;
  if (!p.tls.empty()) {
    const std::string pki = moe::testing::MakeTestPki(moe::testing::MakeTempDir("pki"));
    ASSERT_FALSE(pki.empty());
    o.tls = moe::testing::MemberTls(pki, "{name}");  // each process its own identity
    o.tls.require_client_cert = p.tls == "mtls";
  }
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto client = ClientFor(**cluster);
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);
  // 1 and 5 tokens take the decode kernels; 64 tokens gives hot experts >= 16 tokens (the
  // prefill kernel), so both expert paths cross the wire.
  for (int64_t tokens : {1, 5, 64, 256}) {
    SCOPED_TRACE(absl::StrCat(p.preset, " T=", tokens));
    const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, tokens, 100 + tokens);
    auto want = ForwardInMicroBatches(*local, cfg, x, tokens, p.micro_batches);
    ASSERT_TRUE(want.ok());

    client::ForwardOptions per_pair;
    per_pair.return_routing = true;
    per_pair.reply_mode = v1::REPLY_MODE_PER_PAIR;
    auto got = client->Forward(layer, x, tokens, cfg.hidden, per_pair);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->bias_version, 0u);
    EXPECT_EQ(got->expert_ids, want->routing.expert_ids);
    EXPECT_EQ(got->weights, want->routing.weights);
    EXPECT_TRUE(SameBits(got->out, want->out)) << "per-pair replies must be bit-exact";

    client::ForwardOptions partial;
    partial.reply_mode = v1::REPLY_MODE_PARTIAL_SUM;
    auto sum = client->Forward(layer, x, tokens, cfg.hidden, partial);
    ASSERT_TRUE(sum.ok()) << sum.status();
    const auto [fraction, worst] =
        testing::ExpectWithinPartialSumBounds(sum->out, want->out, tokens, cfg.hidden);
    std::printf(
        "[partial sums %s T=%lld] %.4f of %zu outputs differ, worst %.2e of the row scale\n",
        p.preset.c_str(), static_cast<long long>(tokens), fraction, sum->out.size(), worst);

    // fp32 input is accepted and rounded to bf16 on arrival (RNE): same result.
    std::vector<float> xf(x.size());
    for (size_t i = 0; i < x.size(); ++i) xf[i] = x[i].ToFloat();
    auto from_f32 = client->ForwardF32(layer, xf, tokens, cfg.hidden, per_pair);
    ASSERT_TRUE(from_f32.ok()) << from_f32.status();
    EXPECT_TRUE(SameBits(from_f32->out, want->out));
  }

  // The streaming RPC: several batches on one stream, each with its own result.
  auto stream = client->OpenForwardStream(absl::Seconds(60));
  ASSERT_TRUE(stream.ok());
  std::map<uint64_t, std::vector<Bf16>> expected;
  for (int64_t tokens : {3, 9}) {
    const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, tokens, 7 + tokens);
    auto id = (*stream)->Send(layer, x, tokens, cfg.hidden);
    ASSERT_TRUE(id.ok());
    expected[*id] = ForwardInMicroBatches(*local, cfg, x, tokens, p.micro_batches)->out;
  }
  // A bad batch in the middle gets its own error and the stream goes on.
  auto bad =
      (*stream)->Send(layer + 100, checkpoint::SyntheticHiddenStates(cfg, 2, 1), 2, cfg.hidden);
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

  // Every expert payload took the case's data plane, both ways.
  const std::string other = p.transport == "ucx" ? "grpc" : "ucx";
  for (const char* direction : {"sent", "received"}) {
    SCOPED_TRACE(direction);
    const std::vector<std::string> labels = {absl::StrCat("direction=\"", direction, "\""),
                                             "peer=\"expert\""};
    EXPECT_GT(
        moe::testing::ScrapeSum((*cluster)->attention_metrics(), "moe_wire_bytes_total",
                                Concat(labels, {absl::StrCat("transport=\"", p.transport, "\"")})),
        0);
    EXPECT_EQ(moe::testing::ScrapeSum((*cluster)->attention_metrics(), "moe_wire_bytes_total",
                                      Concat(labels, {absl::StrCat("transport=\"", other, "\"")})),
              0);
  }
  if (p.transport == "ucx") {
    // The lanes UCX really selected (read from UCX, both sides): shared memory where the case
    // says so, TCP where it says so; a "shared memory" case on TCP fails here.
    const std::string kind = p.name.find("_tcp") != std::string::npos ? "tcp" : "shm";
    for (int i = 0; i < (*cluster)->num_shards(); ++i) {
      const std::string shard = absl::StrCat("shard=\"shard-", i, "\"");
      EXPECT_EQ(moe::testing::ScrapeSum((*cluster)->attention_metrics(), "moe_data_plane_lane_info",
                                        {shard, absl::StrCat("kind=\"", kind, "\"")}),
                1)
          << "shard-" << i << " is not on " << kind;
      const std::string theirs =
          kind == "tcp" ? "shard_lanes=\"tcp\"" : "shard_lanes=\"shm (posix)\"";
      EXPECT_EQ(moe::testing::ScrapeSum((*cluster)->attention_metrics(), "moe_data_plane_lane_info",
                                        {shard, theirs}),
                1);
    }
  }
  if (p.transport == "ucx") {  // ... and the shards took their payloads from UCX too
    for (int i = 0; i < (*cluster)->num_shards(); ++i) {
      EXPECT_GT(moe::testing::ScrapeSum((*cluster)->shard_metrics(i), "moe_wire_bytes_total",
                                        {"direction=\"received\"", "transport=\"ucx\""}),
                0);
    }
  }
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
TEST(ClusterFailures, DeadAndStalledShardsAreNamedAndRecovered) {
  const std::string& dir = CheckpointFor("tiny");
  ModelConfig cfg;
  auto local = InProcessLayer(dir, &cfg);
  LocalClusterOptions o = TestCluster(dir, {{0, 8}, {8, 16}});
  o.router_args = {"--heartbeat_interval_ms=200"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto client = ClientFor(**cluster);
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);
  const int64_t tokens = 32;  // with 16 experts and k = 4, both shards are needed
  const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, tokens, 11);
  auto in_process = local->Forward(x, tokens, cfg.hidden);
  ASSERT_TRUE(in_process.ok());
  const std::vector<Bf16> want = in_process->out;
  // The batch needs both shards (else a stalled or dead shard would go unnoticed).
  const auto& ids = in_process->routing.expert_ids;
  ASSERT_TRUE(std::any_of(ids.begin(), ids.end(), [](int32_t e) { return e < 8; }));
  ASSERT_TRUE(std::any_of(ids.begin(), ids.end(), [](int32_t e) { return e >= 8; }));
  ASSERT_TRUE(client->Forward(layer, x, tokens, cfg.hidden).ok());

  client::ForwardOptions fo;
  fo.timeout = absl::Seconds(5);
  ASSERT_TRUE((*cluster)->SignalShard(1, SIGKILL).ok());
  auto t0 = absl::Now();
  auto dead = client->Forward(layer, x, tokens, cfg.hidden, fo);
  ASSERT_FALSE(dead.ok());
  EXPECT_EQ(dead.status().code(), absl::StatusCode::kUnavailable) << dead.status();
  EXPECT_NE(dead.status().message().find("shard-1"), absl::string_view::npos) << dead.status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  // Once the heartbeats are missed the router marks it unhealthy; still named.
  std::this_thread::sleep_for(std::chrono::milliseconds(900));
  auto unhealthy = client->Forward(layer, x, tokens, cfg.hidden, fo);
  ASSERT_FALSE(unhealthy.ok());
  EXPECT_EQ(unhealthy.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(unhealthy.status().message().find("shard-1"), absl::string_view::npos)
      << unhealthy.status();

  ASSERT_TRUE((*cluster)->RestartShard(1).ok());
  absl::StatusOr<client::ForwardResult> back = absl::UnknownError("not tried");
  for (int i = 0; i < 100 && !back.ok(); ++i) {  // bounded: 100 x 100 ms
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    back = client->Forward(layer, x, tokens, cfg.hidden, fo);
  }
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(SameBits(back->out, want));

  // Stalled (SIGSTOP): the deadline fires and names the shard; after SIGCONT it serves again.
  fo.timeout = absl::Milliseconds(800);
  ASSERT_TRUE((*cluster)->SignalShard(0, SIGSTOP).ok());
  t0 = absl::Now();
  auto stalled = client->Forward(layer, x, tokens, cfg.hidden, fo);
  const absl::Duration took = absl::Now() - t0;
  ASSERT_TRUE((*cluster)->SignalShard(0, SIGCONT).ok());
  ASSERT_FALSE(stalled.ok()) << "bias version " << stalled->bias_version << ", dispatch bytes "
                             << stalled->dispatch_bytes_sent;
  EXPECT_EQ(stalled.status().code(), absl::StatusCode::kDeadlineExceeded) << stalled.status();
  EXPECT_NE(stalled.status().message().find("shard-0"), absl::string_view::npos)
      << stalled.status();
  EXPECT_LT(took, absl::Seconds(2));
  fo.timeout = absl::Seconds(5);
  back = absl::UnknownError("not tried");
  for (int i = 0; i < 100 && !back.ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    back = client->Forward(layer, x, tokens, cfg.hidden, fo);
  }
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(SameBits(back->out, want));
}

// Skewed traffic, Rebalance, fresh traffic: MaxVio over the next window falls. Admin calls need
// the token; rollback restores the checkpoint's bias.
TEST(ClusterRebalance, LowersMaxVioOnTheNextWindow) {
  const std::string& dir = CheckpointFor("mid");
  ModelConfig cfg = *PresetConfig("mid");
  LocalClusterOptions o = TestCluster(dir, {{0, 40}, {40, 128}});
  o.threads = 0;  // all cores: 400 requests of mid traffic
  o.admin_token = "s3cret";
  o.attention_args = {"--report_interval_ms=100"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto client = ClientFor(**cluster, "s3cret");
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);

  tools::LoadOptions lo;
  lo.layer = layer;
  lo.hidden = cfg.hidden;
  lo.concurrency = 2;
  lo.tokens = 64;
  lo.duration = absl::Seconds(60);
  lo.max_requests = 200;  // 12800 tokens: q = 800 per expert, noise floor MaxVio ~0.11
  lo.distinct_batches = 200;
  auto wait_for_window = [&](int64_t tokens) -> absl::StatusOr<v1::LoadStats> {
    for (int i = 0; i < 100; ++i) {  // bounded: reports arrive every 100 ms
      auto s = client->GetLoadStats(layer);
      if (!s.ok() || s->window_tokens() >= tokens) return s;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return absl::DeadlineExceededError("statistics did not arrive");
  };
  lo.seed = 1;
  auto r1 = tools::RunLoad(*client, lo);
  ASSERT_TRUE(r1.ok());
  ASSERT_EQ(r1->ok, 200) << r1->Format();
  auto before = wait_for_window(200 * 64);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->window_tokens(), 200 * 64);
  int64_t sum = 0;
  for (int64_t v : before->window_loads()) sum += v;
  EXPECT_EQ(sum, 200 * 64 * cfg.top_k);  // every routed pair counted once
  const double vio_before = before->window_balance().max_vio();
  // The router exports the shards' balancedness of the same window (mean / max, vLLM's form).
  ASSERT_GT(before->window_balance().shard_max_over_mean(), 1.0);
  EXPECT_NEAR(moe::testing::ScrapeSum((*cluster)->router_metrics(), "moe_balancedness",
                                      {absl::StrCat("layer=\"", layer, "\"")}),
              1.0 / before->window_balance().shard_max_over_mean(), 1e-6);

  // Without the token: refused; a dry run needs none and changes nothing.
  auto anonymous = ClientFor(**cluster);
  auto refused = anonymous->Rebalance(layer, false);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  auto dry = anonymous->Rebalance(layer, true);
  ASSERT_TRUE(dry.ok()) << dry.status();
  EXPECT_FALSE(dry->applied());
  EXPECT_EQ(client->GetBias(layer)->version(), 0u);

  auto rb = client->Rebalance(layer, false);
  ASSERT_TRUE(rb.ok()) << rb.status();
  EXPECT_TRUE(rb->applied());
  EXPECT_EQ(rb->new_bias().version(), 1u);
  EXPECT_NEAR(rb->before().max_vio(), vio_before, 1e-12);
  EXPECT_LT(rb->predicted_after().max_vio(), 0.05);

  // Wait until the attention node routes with version 1, then fresh inputs.
  lo.seed = 2;
  absl::StatusOr<client::ForwardResult> probe = absl::UnknownError("");
  for (int i = 0; i < 100; ++i) {
    probe = client->Forward(layer, checkpoint::SyntheticHiddenStates(cfg, 1, 1), 1, cfg.hidden);
    if (probe.ok() && probe->bias_version == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(probe.ok());
  ASSERT_EQ(probe->bias_version, 1u);
  auto r2 = tools::RunLoad(*client, lo);
  ASSERT_TRUE(r2.ok());
  ASSERT_EQ(r2->ok, 200) << r2->Format();
  auto after = wait_for_window(200 * 64);
  ASSERT_TRUE(after.ok()) << after.status();
  const double vio_after = after->window_balance().max_vio();
  std::printf(
      "[rebalance] MaxVio %.3f before, predicted %.3f, measured %.3f after (noise floor "
      "%.3f)\n",
      vio_before, rb->predicted_after().max_vio(), vio_after, rb->noise_floor_max_vio());
  EXPECT_GT(vio_before, 1.0);  // the skewed checkpoint is far from balanced
  EXPECT_LT(vio_after, 0.5);
  EXPECT_LT(vio_after, vio_before / 3);

  auto rolled = client->RollbackBias(layer, 0);
  ASSERT_TRUE(rolled.ok()) << rolled.status();
  EXPECT_EQ(rolled->version(), 2u);
  auto v0 = client->GetLoadStats(layer);
  ASSERT_TRUE(v0.ok());
  EXPECT_EQ(v0->history_size(), 3);
  EXPECT_EQ(v0->history(2).reason(), "rollback to 0");
  auto bias = client->GetBias(layer);
  ASSERT_TRUE(bias.ok());
  ModelConfig unused;
  auto ckpt_layer = InProcessLayer(dir, &unused);
  EXPECT_EQ(std::vector<float>(bias->bias().begin(), bias->bias().end()),
            ckpt_layer->weights().bias);
}

}  // namespace
}  // namespace moe
