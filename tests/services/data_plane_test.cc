// The cluster on the out-of-band UCX data plane under failure (docs/data-plane.md): a shard
// killed mid-transfer, auto's fallback to gRPC and ucx's refusal, with real processes on
// loopback. (The equivalence over UCX is in cluster_test.cc with the in-band cases.)
#include "services/dataplane/data_plane.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
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
#include "tests/services/cluster_test_base.h"
#include "tests/services/hostile_fixtures.h"

namespace moe {
namespace {

using tensor::Bf16;
using testing::kGrpc;
using testing::SameBits;
using testing::UcxArgs;

// Clients sending Forwards until stopped, each answer counted: bit-exact, wrong, failed naming
// `shard` (UNAVAILABLE or DEADLINE_EXCEEDED), failed otherwise, or hung past its deadline.
class ShardFailureTraffic {
 public:
  ShardFailureTraffic(testing::ClusterTest& f, std::string shard, int clients, int64_t tokens)
      : shard_(std::move(shard)) {
    for (int c = 0; c < clients; ++c) {
      xs_.push_back(f.Hidden(tokens, 300 + c));
      wants_.push_back(f.Want(xs_.back(), tokens));
    }
    for (int c = 0; c < clients; ++c) {
      threads_.emplace_back([this, &f, c, tokens] {
        auto client = testing::ClientFor(f.cluster());
        client::ForwardOptions fo;
        fo.timeout = absl::Seconds(3);
        for (int i = 0; i < 400 && !stop_.load(); ++i) {  // bounded in count and by Stop
          const absl::Time t0 = absl::Now();
          auto r = client->Forward(f.layer(), xs_[c], tokens, f.hidden(), fo);
          if (absl::Now() - t0 > fo.timeout + absl::Seconds(1)) hung.fetch_add(1);
          if (r.ok()) {
            (SameBits(r->out, wants_[c]) ? ok : wrong).fetch_add(1);
            continue;
          }
          Count(r.status());
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
      });
    }
  }
  ~ShardFailureTraffic() { Stop(); }
  void Stop() {
    stop_.store(true);
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  const std::vector<Bf16>& x(int c) const { return xs_[c]; }
  const std::vector<Bf16>& want(int c) const { return wants_[c]; }

  std::atomic<int> ok{0}, wrong{0}, named{0}, unnamed{0}, hung{0};
  std::string first_unnamed;

 private:
  void Count(const absl::Status& s) {
    const bool code_ok = s.code() == absl::StatusCode::kUnavailable ||
                         s.code() == absl::StatusCode::kDeadlineExceeded;
    if (code_ok && s.message().find(shard_) != absl::string_view::npos) {
      named.fetch_add(1);
      return;
    }
    unnamed.fetch_add(1);
    std::lock_guard<std::mutex> lock(mu_);
    if (first_unnamed.empty()) first_unnamed = s.ToString();
  }

  const std::string shard_;
  std::vector<std::vector<Bf16>> xs_, wants_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<std::thread> threads_;
};

class ClusterDataPlane : public testing::AttackedClusterTest {
 protected:
  // Requests in flight while shard-1 is killed (-9) come back OK and bit-exact, or UNAVAILABLE /
  // DEADLINE_EXCEEDED naming shard-1 within their deadline (never OK on a partial transfer,
  // never hung); after its restart answers are bit-exact again.
  void KillShard1UnderTrafficAndRestart(const char* lane) {
    constexpr int64_t kRows = 64;
    ShardFailureTraffic t(*this, "shard-1", 3, kRows);
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    const int ok_before = t.ok.load();
    ASSERT_TRUE(cluster().SignalShard(1, SIGKILL).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    t.Stop();
    std::printf(
        "[%s kill] ok %d (before the kill %d), wrong %d, failed naming shard-1 %d, "
        "other failures %d, hung %d\n",
        lane, t.ok.load(), ok_before, t.wrong.load(), t.named.load(), t.unnamed.load(),
        t.hung.load());
    EXPECT_GT(ok_before, 0);
    EXPECT_EQ(t.wrong.load(), 0);
    EXPECT_EQ(t.hung.load(), 0);
    EXPECT_GT(t.named.load(), 0) << "the kill must have been in the path";
    EXPECT_EQ(t.unnamed.load(), 0) << t.first_unnamed;
    ASSERT_TRUE(cluster().RestartShard(1).ok());
    ASSERT_NO_FATAL_FAILURE(ExpectServedAgain(t.x(0), kRows, t.want(0)));
  }

  // What the shards say of their data plane: UCX on posix, and no address to a caller without
  // the token.
  void ExpectShardsOfferUcxToMembersOnly() {
    for (int i = 0; i < cluster().num_shards(); ++i) {
      auto stub = v1::ExpertService::NewStub(transport::MakeChannel(cluster().shard_endpoint(i)));
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      v1::ExpertServerInfo info;
      ASSERT_TRUE(stub->GetInfo(&ctx, v1::GetExpertInfoRequest(), &info).ok());
      EXPECT_EQ(info.data_plane(), "ucx");
      EXPECT_EQ(info.ucx_tls(), "posix");
      EXPECT_TRUE(info.ucx_address().empty());
    }
  }
};

// The UCX data plane under a kill -9: requests in flight while shard-1 dies come back OK and
// bit-exact, or UNAVAILABLE / DEADLINE_EXCEEDED naming shard-1 within their deadline (never OK
// on a partial transfer, never hung); after the restart the channel opens the data plane again
// and answers are bit-exact, still on UCX.
TEST_F(ClusterDataPlane, KillingAShardMidTransferIsNamedAndRecovered) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  UsePreset("mid", {{0, 40}, {40, 128}});
  options().router_args = {"--heartbeat_interval_ms=200"};
  options().expert_args = UcxArgs("posix");
  options().attention_args = UcxArgs("posix");
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  ASSERT_NO_FATAL_FAILURE(ExpectShardsOfferUcxToMembersOnly());

  ASSERT_NO_FATAL_FAILURE(KillShard1UnderTrafficAndRestart("ucx"));
  EXPECT_GT(ShardMetric(1, "moe_wire_bytes_total", {"direction=\"received\"", "transport=\"ucx\""}),
            0)
      << "the restarted shard must be on UCX again";
  EXPECT_EQ(AttentionMetric("moe_wire_bytes_total", {"peer=\"expert\"", "transport=\"grpc\""}), 0);
  EXPECT_GE(
      AttentionMetric("moe_data_plane_events_total", {"shard=\"shard-1\"", "event=\"connected\""}),
      2);
}

// The project's shared-memory lane (--data_plane=shm on every service, docs/data-plane.md "The
// shm data plane") in a real cluster: answers bit-exact with the in-process layer, every byte on
// shm (none in band); under a kill -9 of a shard, answers bit-exact or failed naming it, none
// hung; after the restart the node opens the lane again (a second "connected").
TEST_F(ClusterDataPlane, TheShmLaneServesBitExactAndRecoversFromAKill) {
  UsePreset("mid", {{0, 40}, {40, 128}});
  options().router_args = {"--heartbeat_interval_ms=200"};
  options().expert_args = {"--data_plane=shm"};
  options().attention_args = {"--data_plane=shm"};
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  ASSERT_NO_FATAL_FAILURE(KillShard1UnderTrafficAndRestart("shm"));
  for (int i = 0; i < 2; ++i) {
    EXPECT_GT(
        ShardMetric(i, "moe_wire_bytes_total", {"direction=\"received\"", "transport=\"shm\""}), 0)
        << "shard-" << i << " on shm";
  }
  EXPECT_GT(AttentionMetric("moe_wire_bytes_total", {"peer=\"expert\"", "transport=\"shm\""}), 0);
  EXPECT_EQ(AttentionMetric("moe_wire_bytes_total", {"peer=\"expert\"", "transport=\"grpc\""}), 0);
  EXPECT_GE(
      AttentionMetric("moe_data_plane_events_total", {"shard=\"shard-1\"", "event=\"connected\""}),
      2);
}

// A shard that is only slow keeps its data plane: a short-deadline request queued behind a
// long one (as a readiness canary behind a K3 prefill) fails at its deadline naming the shard,
// and the long one, still on its way, is answered bit-exact on the same connection; the node
// does not open the data plane again (which makes the shard drop the old client with every
// reply it still owes). The shard is stalled with SIGSTOP while both are in flight.
TEST_F(ClusterDataPlane, ABatchTimedOutBehindALongOneKeepsTheConnection) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  UsePreset("tiny", {{0, 8}, {8, 16}});
  options().expert_args = UcxArgs("posix");
  // No readiness canary: the test counts the node's connections and batches itself.
  options().attention_args = testing::Concat(UcxArgs("posix"), {"--canary_interval_ms=0"});
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  const std::vector<Bf16> x = Hidden(4, 21), want = Want(x, 4);
  client::ForwardOptions slow, quick;
  slow.timeout = absl::Seconds(20);
  quick.timeout = absl::Milliseconds(700);
  auto first = user().Forward(layer(), x, 4, hidden(), slow);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::vector<std::string> connected = {"shard=\"shard-0\"", "event=\"connected\""};
  const double connections = AttentionMetric("moe_data_plane_events_total", connected);
  EXPECT_EQ(connections, 1);

  ASSERT_TRUE(cluster().SignalShard(0, SIGSTOP).ok());
  absl::StatusOr<client::ForwardResult> long_one = absl::UnknownError("not run");
  std::thread waiting([&] {
    auto c = testing::ClientFor(cluster());
    long_one = c->Forward(layer(), x, 4, hidden(), slow);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // its batch is out first
  auto c = testing::ClientFor(cluster());
  auto short_one = c->Forward(layer(), x, 4, hidden(), quick);
  EXPECT_EQ(short_one.status().code(), absl::StatusCode::kDeadlineExceeded) << short_one.status();
  EXPECT_NE(short_one.status().message().find("shard-0"), std::string::npos) << short_one.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the long one keeps waiting
  ASSERT_TRUE(cluster().SignalShard(0, SIGCONT).ok());
  waiting.join();
  ASSERT_TRUE(long_one.ok()) << long_one.status();
  EXPECT_TRUE(SameBits(long_one->out, want));
  auto after = user().Forward(layer(), x, 4, hidden(), slow);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(SameBits(after->out, want));
  EXPECT_EQ(AttentionMetric("moe_data_plane_events_total", connected), connections)
      << "the node opened the data plane to shard-0 again";
  EXPECT_EQ(AttentionMetric("moe_data_plane_events_total",
                            {"shard=\"shard-0\"", "event=\"transfer_failed\""}),
            0);
}

// auto falls back to in-band gRPC where a shard offers no UCX (counted), and stays exact.
TEST_F(ClusterDataPlane, AutoFallsBackToGrpcWhereAShardHasNoUcx) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  UsePreset("tiny", {{0, 8}, {8, 16}});
  options().expert_args = kGrpc;  // attention-svc keeps its default, auto
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  ExpectOracleAnswer(16, 21);
  EXPECT_GT(AttentionMetric("moe_wire_bytes_total", {"peer=\"expert\"", "transport=\"grpc\""}), 0);
  EXPECT_EQ(AttentionMetric("moe_wire_bytes_total", {"peer=\"expert\"", "transport=\"ucx\""}), 0);
  EXPECT_GE(AttentionMetric("moe_data_plane_events_total", {"event=\"fallback\""}), 1);
}

// --data_plane=ucx refuses to fall back: the batch fails UNAVAILABLE naming the shard, and the
// node never says it is ready (its readiness canary fails the same way).
TEST_F(ClusterDataPlane, UcxOnlyRefusesAShardWithoutUcx) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  UsePreset("tiny", {{0, 8}, {8, 16}});
  options().expert_args = kGrpc;
  options().attention_args = {"--data_plane=ucx", "--canary_interval_ms=200"};
  options().wait_ready = false;
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  client::ForwardOptions fo;
  fo.timeout = absl::Seconds(5);
  absl::StatusOr<client::ForwardResult> got = absl::UnknownError("not tried");
  for (int i = 0; i < 50; ++i) {  // until the placement reaches the node (bounded: 5 s)
    const absl::Time t0 = absl::Now();
    got = Forward(Hidden(16, 21), 16, fo);
    EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
    if (absl::StrContains(got.status().message(), "no out-of-band data plane")) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_NE(got.status().message().find("no out-of-band data plane"), absl::string_view::npos)
      << got.status();
  EXPECT_NE(got.status().message().find("shard-"), absl::string_view::npos) << got.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // a few canaries
  EXPECT_GE(AttentionMetric("moe_canary_checks_total", {"outcome=\"error\""}), 1);
  EXPECT_EQ(AttentionMetric("moe_canary_ready"), 0);
  EXPECT_FALSE(user().AttentionServing().value_or(true));
}

// Payloads of the sizes a canary batch can have, from a worker of the test's own.
std::vector<std::shared_ptr<dataplane::UcxBuffer>> HostilePayloads(dataplane::UcxWorker& w,
                                                                   int64_t d) {
  std::vector<std::shared_ptr<dataplane::UcxBuffer>> payloads;
  for (int64_t rows : {1, 3, 16, 48}) {
    auto b = w.Buffer(static_cast<size_t>(rows * d * 2));
    EXPECT_TRUE(b.ok());
    if (!b.ok()) continue;
    for (int64_t i = 0; i < rows * d * 2; ++i) (*b)->data()[i] = static_cast<uint8_t>(i * 31 + 7);
    payloads.push_back(*b);
  }
  return payloads;
}

// Batch messages as the shard takes them now: well-formed frames of the guessable client ids
// and sequences near the canary's, under MACs the peer cannot compute; replies sent to the
// shard; and frames that are not frames.
std::pair<dataplane::UcxWorker::Message, std::string> ForgedBatchMessage(uint64_t i) {
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
  return {kind, frame};
}

// Hellos that are malformed, of unknown clients, with wrong secrets, oversized.
std::string ForgedHello(uint64_t i) {
  switch (i / 8 % 4) {
    case 0:
      return dataplane::RandomBytes(1 + i % 255);  // malformed
    case 1:
      return dataplane::EncodeHello({1 + i % 5, dataplane::RandomBytes(16)});  // wrong secret
    case 2:
      return dataplane::EncodeHello({1000000 + i, dataplane::RandomBytes(16)});  // unknown
    default:
      return std::string(4096, 'h');  // oversized: dropped by the worker
  }
}

// A hostile UCX peer that holds the shard's worker address (leaked: a stranger is not handed
// it) but no secret: it sprays tagged payloads on random tags and on the tags the first data
// plane made predictable (client id << 40 | sequence), batch messages of the guessable client
// ids with MACs it cannot compute, replies and frames that are none, and sends hellos that are
// malformed, of unknown clients, with wrong secrets, oversized. Meanwhile a canary's answers stay
// bit-exact, every process stays up, and the shard counts the hellos it refused.
TEST_F(ClusterDataPlane, AHostileUcxPeerCannotChangeAnAnswer) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  ASSERT_NO_FATAL_FAILURE(StartAttackedCluster("posix", 77));
  const std::string address = testing::ShardUcxAddress(cluster(), 0);  // the leak
  ASSERT_FALSE(address.empty());
  auto canary = StartCanary(2000);
  dataplane::UcxOptions uo;
  uo.tls = "posix";
  auto hostile = dataplane::UcxWorker::Create(uo);
  ASSERT_TRUE(hostile.ok()) << hostile.status();
  auto ep = (*hostile)->Connect(address, nullptr);
  ASSERT_TRUE(ep.ok()) << ep.status();
  const auto payloads = HostilePayloads(**hostile, cfg().latent);
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
    const auto [kind, frame] = ForgedBatchMessage(i);
    pending.push_back((*hostile)->SendMessage(*ep, kind, frame, b, b->capacity() / 2, deadline));
    ++forged;
    if (i % 8 == 0) {
      pending.push_back((*hostile)->SendHello(*ep, ForgedHello(i), deadline));
      ++hellos;
    }
    if (pending.size() <= 256) continue;
    for (auto& t : pending) (void)t->Wait(absl::Now() + absl::Seconds(1));
    pending.clear();
  }
  for (auto& t : pending) (void)t->Wait(absl::Now() + absl::Seconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  canary->Stop();
  std::printf(
      "[hostile ucx peer] %d payloads, %d forged batch messages and %d hellos sprayed; canary "
      "%d bit-exact, %d wrong, %d failed\n",
      sprayed, forged, hellos, canary->ok(), canary->wrong(), canary->failed());
  ExpectCleanCanary(*canary, 10);
  ExpectEveryProcessUpAndServing();
  // The hellos and the forged batch messages were refused by kind: no bound client or no
  // frame, and the MAC.
  for (const char* event : {"hello_rejected", "message_rejected", "integrity_failed"}) {
    EXPECT_GT(ShardMetric(0, "moe_expert_data_plane_events_total",
                          {absl::StrCat("event=\"", event, "\"")}),
              0)
        << event;
  }
}

}  // namespace
}  // namespace moe
