// The cluster on the out-of-band UCX data plane under failure (docs/data-plane.md): a shard
// killed mid-transfer, auto's fallback to gRPC and ucx's refusal, with real processes on
// loopback. (The equivalence over UCX is in cluster_test.cc with the in-band cases.)
#include "services/dataplane/data_plane.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "inference/grpc_inference.grpc.pb.h"
#include "moe/v1/attention.grpc.pb.h"
#include "moe/v1/expert.grpc.pb.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/moe_client.h"
#include "services/dataplane/payload_mac.h"
#include "services/dataplane/ucx_worker.h"
#include "services/tools/local_cluster.h"
#include "services/transport/grpc_server.h"
#include "services/transport/tensor_codec.h"
#include "tests/common/metrics_text.h"
#include "tests/services/cluster_fixtures.h"
#include "tests/services/hostile_fixtures.h"

namespace moe {
namespace {

using tensor::Bf16;
using testing::CheckpointFor;
using testing::ClientFor;
using testing::Concat;
using testing::InProcessLayer;
using testing::kGrpc;
using testing::SameBits;
using testing::TestCluster;
using testing::UcxArgs;
using tools::LocalCluster;
using tools::LocalClusterOptions;

// The UCX data plane under a kill -9: requests in flight while shard-1 dies come back OK and
// bit-exact, or UNAVAILABLE / DEADLINE_EXCEEDED naming shard-1 within their deadline (never OK
// on a partial transfer, never hung); after the restart the channel opens the data plane again
// and answers are bit-exact, still on UCX.
TEST(ClusterDataPlane, KillingAShardMidTransferIsNamedAndRecovered) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  const std::string& dir = CheckpointFor("mid");
  ModelConfig cfg;
  auto local = InProcessLayer(dir, &cfg);
  LocalClusterOptions o = TestCluster(dir, {{0, 40}, {40, 128}});
  o.router_args = {"--heartbeat_interval_ms=200"};
  o.expert_args = UcxArgs("posix");
  o.attention_args = UcxArgs("posix");
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);

  // What the shards say of their data plane.
  for (int i = 0; i < 2; ++i) {
    auto stub = v1::ExpertService::NewStub(transport::MakeChannel((*cluster)->shard_endpoint(i)));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ExpertServerInfo info;
    ASSERT_TRUE(stub->GetInfo(&ctx, v1::GetExpertInfoRequest(), &info).ok());
    EXPECT_EQ(info.data_plane(), "ucx");
    EXPECT_EQ(info.ucx_tls(), "posix");
    EXPECT_TRUE(info.ucx_address().empty());  // not to a caller without the token
  }

  constexpr int kClients = 3;
  constexpr int64_t kTokens = 64;
  std::vector<std::vector<Bf16>> xs, wants;
  for (int c = 0; c < kClients; ++c) {
    xs.push_back(checkpoint::SyntheticHiddenStates(cfg, kTokens, 300 + c));
    wants.push_back(local->Forward(xs.back(), kTokens, cfg.hidden)->out);
  }
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, wrong{0}, named{0}, unnamed{0}, hung{0};
  std::mutex first_mu;
  std::string first_unnamed;
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      auto client = ClientFor(**cluster);
      client::ForwardOptions fo;
      fo.timeout = absl::Seconds(3);
      for (int i = 0; i < 400 && !stop.load(); ++i) {  // bounded in count and (below) time
        const absl::Time t0 = absl::Now();
        auto r = client->Forward(layer, xs[c], kTokens, cfg.hidden, fo);
        if (absl::Now() - t0 > fo.timeout + absl::Seconds(1)) hung.fetch_add(1);
        if (r.ok()) {
          (SameBits(r->out, wants[c]) ? ok : wrong).fetch_add(1);
          continue;
        }
        const bool code_ok = r.status().code() == absl::StatusCode::kUnavailable ||
                             r.status().code() == absl::StatusCode::kDeadlineExceeded;
        if (code_ok && r.status().message().find("shard-1") != absl::string_view::npos) {
          named.fetch_add(1);
        } else {
          unnamed.fetch_add(1);
          std::lock_guard<std::mutex> lock(first_mu);
          if (first_unnamed.empty()) first_unnamed = r.status().ToString();
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  const int ok_before = ok.load();
  ASSERT_TRUE((*cluster)->SignalShard(1, SIGKILL).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  stop.store(true);
  for (auto& t : threads) t.join();
  std::printf(
      "[ucx kill] ok %d (before the kill %d), wrong %d, failed naming shard-1 %d, "
      "other failures %d, hung %d\n",
      ok.load(), ok_before, wrong.load(), named.load(), unnamed.load(), hung.load());
  EXPECT_GT(ok_before, 0);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(hung.load(), 0);
  EXPECT_GT(named.load(), 0) << "the kill must have been in the path";
  EXPECT_EQ(unnamed.load(), 0) << first_unnamed;

  ASSERT_TRUE((*cluster)->RestartShard(1).ok());
  auto client = ClientFor(**cluster);
  absl::StatusOr<client::ForwardResult> back = absl::UnknownError("not tried");
  for (int i = 0; i < 100 && !back.ok(); ++i) {  // bounded: 100 x 100 ms
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    back = client->Forward(layer, xs[0], kTokens, cfg.hidden);
  }
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(SameBits(back->out, wants[0]));
  EXPECT_GT(moe::testing::ScrapeSum((*cluster)->shard_metrics(1), "moe_wire_bytes_total",
                                    {"direction=\"received\"", "transport=\"ucx\""}),
            0)
      << "the restarted shard must be on UCX again";
  EXPECT_EQ(moe::testing::ScrapeSum((*cluster)->attention_metrics(), "moe_wire_bytes_total",
                                    {"peer=\"expert\"", "transport=\"grpc\""}),
            0);
  EXPECT_GE(moe::testing::ScrapeSum((*cluster)->attention_metrics(), "moe_data_plane_events_total",
                                    {"shard=\"shard-1\"", "event=\"connected\""}),
            2);
}

// auto falls back to in-band gRPC where a shard offers no UCX (counted), and stays exact;
// --data_plane=ucx refuses to: the batch fails UNAVAILABLE naming the shard.
TEST(ClusterDataPlane, AutoFallsBackToGrpcWhereAShardHasNoUcx) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  const std::string& dir = CheckpointFor("tiny");
  ModelConfig cfg;
  auto local = InProcessLayer(dir, &cfg);
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);
  const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, 16, 21);
  const std::vector<Bf16> want = local->Forward(x, 16, cfg.hidden)->out;
  {
    LocalClusterOptions o = TestCluster(dir, {{0, 8}, {8, 16}});
    o.expert_args = kGrpc;  // attention-svc keeps its default, auto
    auto cluster = LocalCluster::Start(o);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    auto got = ClientFor(**cluster)->Forward(layer, x, 16, cfg.hidden);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(SameBits(got->out, want));
    const std::string m = (*cluster)->attention_metrics();
    EXPECT_GT(moe::testing::ScrapeSum(m, "moe_wire_bytes_total",
                                      {"peer=\"expert\"", "transport=\"grpc\""}),
              0);
    EXPECT_EQ(moe::testing::ScrapeSum(m, "moe_wire_bytes_total",
                                      {"peer=\"expert\"", "transport=\"ucx\""}),
              0);
    EXPECT_GE(moe::testing::ScrapeSum(m, "moe_data_plane_events_total", {"event=\"fallback\""}), 1);
  }
  {
    LocalClusterOptions o = TestCluster(dir, {{0, 8}, {8, 16}});
    o.expert_args = kGrpc;
    o.attention_args = {"--data_plane=ucx"};
    auto cluster = LocalCluster::Start(o);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    client::ForwardOptions fo;
    fo.timeout = absl::Seconds(5);
    const absl::Time t0 = absl::Now();
    auto got = ClientFor(**cluster)->Forward(layer, x, 16, cfg.hidden, fo);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
    EXPECT_NE(got.status().message().find("no out-of-band data plane"), absl::string_view::npos)
        << got.status();
    EXPECT_NE(got.status().message().find("shard-"), absl::string_view::npos) << got.status();
    EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  }
}

// A hostile UCX peer that holds the shard's worker address (leaked: a stranger is not handed
// it) but no secret: it sprays tagged payloads on random tags and on the tags the first data
// plane made predictable (client id << 40 | sequence), batch messages of the guessable client
// ids with MACs it cannot compute, replies and frames that are none, and sends hellos that are
// malformed, of unknown clients, with wrong secrets, oversized. Meanwhile a canary's answers stay
// bit-exact, every process stays up, and the shard counts the hellos it refused.
TEST(ClusterDataPlane, AHostileUcxPeerCannotChangeAnAnswer) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  testing::AttackedCluster a = testing::StartAttackedCluster("posix", 77);
  ASSERT_NE(a.cluster, nullptr);

  // The leak: the address, read with the token (what a stranger does not get).
  const std::string address = testing::ShardUcxAddress(*a.cluster, 0);
  ASSERT_FALSE(address.empty());
  testing::Canary canary(*a.cluster, a.layer, a.x, a.kTokens, a.cfg.hidden, a.want, 2000);

  dataplane::UcxOptions uo;
  uo.tls = "posix";
  auto hostile = dataplane::UcxWorker::Create(uo);
  ASSERT_TRUE(hostile.ok()) << hostile.status();
  auto ep = (*hostile)->Connect(address, nullptr);
  ASSERT_TRUE(ep.ok()) << ep.status();
  const int d = static_cast<int>(a.cfg.latent);
  std::vector<std::shared_ptr<dataplane::UcxBuffer>> payloads;
  for (int64_t rows : {1, 3, 16, 48}) {  // sizes a batch of the canary can have
    auto b = (*hostile)->Buffer(static_cast<size_t>(rows * d * 2));
    ASSERT_TRUE(b.ok());
    for (int64_t i = 0; i < rows * d * 2; ++i) (*b)->data()[i] = static_cast<uint8_t>(i * 31 + 7);
    payloads.push_back(*b);
  }
  int sprayed = 0, hellos = 0, forged = 0;
  const absl::Time until = absl::Now() + absl::Seconds(4);
  std::vector<std::shared_ptr<dataplane::UcxTransfer>> pending;
  for (uint64_t i = 0; absl::Now() < until && i < 200000; ++i) {
    const absl::Time deadline = absl::Now() + absl::Milliseconds(200);
    // The old predictable tags (client 1..3, sequences near the canary's) and random ones.
    const uint64_t tag = i % 2 == 0 ? ((1 + i % 3) << 40) | (i / 2 % 4096) : dataplane::RandomU64();
    const auto& b = payloads[i % payloads.size()];
    pending.push_back((*hostile)->Send(*ep, tag, b, b->capacity() / 2, deadline));
    ++sprayed;
    // Batch messages as the shard takes them now: well-formed frames of the guessable client
    // ids and sequences near the canary's, under MACs the peer cannot compute; replies sent to
    // the shard; and frames that are not frames.
    {
      dataplane::BatchFrame f;
      f.token = dataplane::RandomU64();
      f.kind = dataplane::BatchKind::kRequest;
      f.client_id = 1 + i % 3;
      f.sequence = 1 + i / 3 % 4096;
      f.header_bytes = static_cast<uint32_t>(i % 64);
      f.mac = dataplane::RandomBytes(16);
      std::string frame = dataplane::EncodeBatchFrame(f);
      auto kind = dataplane::UcxWorker::Message::kRequest;
      if (i % 16 == 5) kind = dataplane::UcxWorker::Message::kReply;
      if (i % 16 == 9) frame = dataplane::RandomBytes(1 + i % 200);
      pending.push_back((*hostile)->SendMessage(*ep, kind, frame, b, b->capacity() / 2, deadline));
      ++forged;
    }
    if (i % 8 == 0) {
      std::string hello;
      switch (i / 8 % 4) {
        case 0:
          hello = dataplane::RandomBytes(1 + i % 255);  // malformed
          break;
        case 1:
          hello = dataplane::EncodeHello({1 + i % 5, dataplane::RandomBytes(16)});  // wrong secret
          break;
        case 2:
          hello = dataplane::EncodeHello({1000000 + i, dataplane::RandomBytes(16)});  // unknown
          break;
        default:
          hello = std::string(4096, 'h');  // oversized: dropped by the worker
      }
      pending.push_back((*hostile)->SendHello(*ep, hello, deadline));
      ++hellos;
    }
    if (pending.size() > 256) {
      for (auto& t : pending) (void)t->Wait(absl::Now() + absl::Seconds(1));
      pending.clear();
    }
  }
  for (auto& t : pending) (void)t->Wait(absl::Now() + absl::Seconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  canary.Stop();
  std::printf(
      "[hostile ucx peer] %d payloads, %d forged batch messages and %d hellos sprayed; canary "
      "%d bit-exact, %d wrong, %d failed\n",
      sprayed, forged, hellos, canary.ok(), canary.wrong(), canary.failed());
  EXPECT_GT(canary.ok(), 10);
  EXPECT_EQ(canary.wrong(), 0) << "an injected payload changed an answer";
  EXPECT_EQ(canary.failed(), 0);
  // Every process is still there and serving.
  for (const auto& [name, pid] : a.cluster->Processes()) {
    EXPECT_EQ(kill(pid, 0), 0) << name << " died";
  }
  auto after = ClientFor(*a.cluster)->Forward(a.layer, a.x, a.kTokens, a.cfg.hidden);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(SameBits(after->out, a.want));
  EXPECT_GT(
      moe::testing::ScrapeSum(a.cluster->shard_metrics(0), "moe_expert_data_plane_events_total",
                              {"event=\"hello_rejected\""}),
      0);
  // The forged batch messages were refused by kind: no bound client or no frame, and the MAC.
  const std::string m = a.cluster->shard_metrics(0);
  EXPECT_GT(moe::testing::ScrapeSum(m, "moe_expert_data_plane_events_total",
                                    {"event=\"message_rejected\""}),
            0);
  EXPECT_GT(moe::testing::ScrapeSum(m, "moe_expert_data_plane_events_total",
                                    {"event=\"integrity_failed\""}),
            0);
}

}  // namespace
}  // namespace moe
