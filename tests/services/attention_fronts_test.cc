// The attention node's public fronts as a caller meets them, with real processes on loopback:
// the Open Inference Protocol's readiness following the shards, and the bounds one client meets
// on a ForwardStream (in flight, cancelled, not reading).
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "inference/grpc_inference.grpc.pb.h"
#include "moe/v1/attention.grpc.pb.h"
#include "moe/v1/expert.grpc.pb.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/moe_client.h"
#include "services/dataplane/ucx_worker.h"
#include "services/tools/local_cluster.h"
#include "services/transport/grpc_server.h"
#include "services/transport/tensor_codec.h"
#include "tests/common/metrics_text.h"
#include "tests/services/cluster_fixtures.h"
#include "tests/services/cluster_test_base.h"

namespace moe {
namespace {

using tensor::Bf16;
using testing::SameBits;

// The Open Inference Protocol's readiness follows the expert shards a layer needs, and
// GetModelInfo says which shard is down: a killed shard makes ServerReady and ModelReady false
// (once the router marks it unhealthy); its restart makes them true again.
class ClusterOpenInference : public testing::ClusterTest {
 protected:
  // ServerReady and ModelReady as a standard OIP client sees them.
  void Ready(bool* server, bool* model) {
    auto oip = inference::GRPCInferenceService::NewStub(
        transport::MakeChannel(cluster().attention_endpoint()));
    grpc::ClientContext c1, c2;
    c1.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    c2.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    inference::ServerReadyResponse sr;
    inference::ModelReadyRequest mreq;
    mreq.set_name("moe-layer-1");
    inference::ModelReadyResponse mr;
    ASSERT_TRUE(oip->ServerReady(&c1, inference::ServerReadyRequest(), &sr).ok());
    ASSERT_TRUE(oip->ModelReady(&c2, mreq, &mr).ok());
    *server = sr.ready();
    *model = mr.ready();
  }
  // Until both say `want` (bounded: 10 s).
  void AwaitReady(bool want) {
    bool server = !want, model = !want;
    for (int i = 0; i < 100 && (server != want || model != want); ++i) {
      ASSERT_NO_FATAL_FAILURE(Ready(&server, &model));
      if (server != want || model != want) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
    EXPECT_EQ(server, want);
    EXPECT_EQ(model, want);
  }
};

TEST_F(ClusterOpenInference, ReadinessFollowsTheShards) {
  UsePreset("tiny", {{0, 8}, {8, 16}});
  options().router_args = {"--heartbeat_interval_ms=200"};
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  AwaitReady(true);
  auto info = user().GetModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->ready());
  EXPECT_EQ(info->shards_size(), 2);
  ASSERT_TRUE(cluster().SignalShard(1, SIGKILL).ok());
  AwaitReady(false);
  info = user().GetModelInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_FALSE(info->ready());
  for (const v1::ShardSummary& s : info->shards()) {
    EXPECT_EQ(s.healthy(), s.shard() != "shard-1") << s.shard();
  }
  ASSERT_TRUE(cluster().RestartShard(1).ok());
  AwaitReady(true);
}

// The readiness canary on a real cluster (every 200 ms, 1 s timeout): ready once a canary
// matched; a shard stopped past the timeout makes the node not ready (the standard readiness
// says so) and a canary that matches after SIGCONT makes it ready again; every outcome counted.
class ClusterCanary : public ClusterOpenInference {};

TEST_F(ClusterCanary, AStalledShardMakesTheNodeNotReadyUntilACanaryMatches) {
  UsePreset("tiny", {{0, 8}, {8, 16}});
  options().router_args = {"--heartbeat_interval_ms=2000"};  // the router notices after 6 s
  options().attention_args = {"--canary_interval_ms=200", "--canary_timeout_ms=1000"};
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  AwaitReady(true);
  EXPECT_GE(AttentionMetric("moe_canary_checks_total", {"outcome=\"match\""}), 1);
  EXPECT_EQ(AttentionMetric("moe_canary_ready"), 1);
  ASSERT_TRUE(cluster().SignalShard(1, SIGSTOP).ok());
  AwaitReady(false);  // within the canary's timeout and interval, before the router notices
  const double timeouts = AttentionMetric("moe_canary_checks_total", {"outcome=\"timeout\""});
  const double ready_while_stopped = AttentionMetric("moe_canary_ready");
  ASSERT_TRUE(cluster().SignalShard(1, SIGCONT).ok());
  EXPECT_GE(timeouts, 1);
  EXPECT_EQ(ready_while_stopped, 0);
  AwaitReady(true);
  EXPECT_EQ(AttentionMetric("moe_canary_checks_total", {"outcome=\"mismatch\""}), 0);
  ExpectOracleAnswer(8, 3);
}

// A canary queued behind requests the node answers meanwhile is "busy", not a timeout: under
// traffic of 512-token requests (each longer than the canary's 30 ms timeout on one shard
// thread) the node stays ready at every look, no canary counts as a timeout, and the answers
// stay exact; a shard stalled under the same traffic (its requests fail at their deadline) still
// makes the node not ready, and it is ready again after SIGCONT with the traffic still on (each
// busy canary doubles the next one's timeout, so one gets through and matches: on CI, before
// that, the node stayed not ready under the traffic).
TEST_F(ClusterCanary, ACanaryQueuedBehindAnsweredRequestsKeepsTheNodeReady) {
  UsePreset("mid");
  options().router_args = {"--heartbeat_interval_ms=2000"};  // the router notices after 6 s
  options().attention_args = {"--canary_interval_ms=100", "--canary_timeout_ms=30"};
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  AwaitReady(true);
  // (The first canaries may time out while the data plane opens: counted from here.)
  const double timeouts_before =
      AttentionMetric("moe_canary_checks_total", {"outcome=\"timeout\""});
  constexpr int64_t kTokens = 512;
  const std::vector<Bf16> x = Hidden(kTokens, 4), want = Want(x, kTokens);
  std::atomic<bool> stop{false};
  std::atomic<int> exact{0}, wrong{0}, failed{0};
  auto traffic = [&] {
    auto c = testing::ClientFor(cluster());
    client::ForwardOptions fo;
    fo.timeout = absl::Milliseconds(1500);
    for (int i = 0; i < 200 && !stop.load(); ++i) {  // bounded in count and by stop
      auto r = c->Forward(layer(), x, kTokens, hidden(), fo);
      if (!r.ok()) {
        failed.fetch_add(1);
      } else {
        (testing::SameBits(r->out, want) ? exact : wrong).fetch_add(1);
      }
    }
  };
  std::vector<std::thread> clients;
  for (int i = 0; i < 2; ++i) clients.emplace_back(traffic);
  int looks = 0, not_ready = 0;
  for (const absl::Time until = absl::Now() + absl::Seconds(3); absl::Now() < until; ++looks) {
    bool server = false, model = false;
    ASSERT_NO_FATAL_FAILURE(Ready(&server, &model));
    not_ready += !(server && model);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const double busy = AttentionMetric("moe_canary_checks_total", {"outcome=\"busy\""});
  const double timeouts =
      AttentionMetric("moe_canary_checks_total", {"outcome=\"timeout\""}) - timeouts_before;
  std::printf(
      "[canary under load] %d looks, %d not ready; %d exact answers; canaries busy %.0f, "
      "timeout %.0f\n",
      looks, not_ready, exact.load(), busy, timeouts);
  EXPECT_EQ(not_ready, 0);
  EXPECT_GE(busy, 1) << "no canary queued behind the traffic: the test did not test";
  EXPECT_EQ(timeouts, 0);
  EXPECT_GT(exact.load(), 4);
  EXPECT_EQ(failed.load(), 0);

  // The same traffic with a shard stalled: its requests fail at their deadline, and so the
  // canaries that time out meanwhile are timeouts again.
  ASSERT_TRUE(cluster().SignalShard(1, SIGSTOP).ok());
  AwaitReady(false);
  ASSERT_TRUE(cluster().SignalShard(1, SIGCONT).ok());
  AwaitReady(true);
  stop.store(true);
  for (auto& t : clients) t.join();
  EXPECT_GT(AttentionMetric("moe_canary_checks_total", {"outcome=\"timeout\""}), timeouts_before);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(AttentionMetric("moe_canary_checks_total", {"outcome=\"mismatch\""}), 0);
}

// The process's own command line (/proc/PID/cmdline), one argument each.
std::vector<std::string> CommandLine(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  for (size_t at = 0; at < all.size();) {
    const size_t end = all.find('\0', at);
    args.push_back(all.substr(at, end - at));
    at = end == std::string::npos ? all.size() : end + 1;
  }
  return args;
}

// A lying member, as an attacker with a member's credentials makes one: shard-1 killed and the
// same binary started again with shard-1's own flags and token, but on a checkpoint of other
// weights (another seed). It registers as shard-1 once the dead one's lease has gone, and every
// answer it gives is wrong: the node's readiness canary finds it at the next canary and the
// node is not ready (standard OIP readiness) until the real shard is back.
TEST_F(ClusterCanary, AShardServingOtherWeightsUnderItsOwnNameIsCaught) {
  UsePreset("tiny", {{0, 8}, {8, 16}});
  options().router_args = {"--heartbeat_interval_ms=200"};
  options().attention_args = {"--canary_interval_ms=200"};
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  AwaitReady(true);
  const std::string other = testing::MakeTempDir("ckpt_other");
  checkpoint::SyntheticOptions so;
  so.seed = 6;  // CheckpointFor's is 5
  so.router_skew = 1.0;
  so.single_file = true;
  ASSERT_TRUE(checkpoint::WriteSyntheticCheckpoint(cfg(), other, so).ok());
  pid_t shard1 = 0;
  for (const auto& [name, pid] : cluster().Processes()) {
    if (name == "shard-1") shard1 = pid;
  }
  ASSERT_GT(shard1, 0);
  std::vector<std::string> args = CommandLine(shard1);
  ASSERT_FALSE(args.empty());
  for (std::string& a : args) {  // its own flags and token; other weights, files of its own
    const size_t eq = a.find('=');
    if (eq == std::string::npos) continue;
    const std::string flag = a.substr(0, eq + 1), value = a.substr(eq + 1);
    if (flag == "--checkpoint=") a = flag + other;
    if (flag == "--port_file=" || flag == "--metrics_port_file=") {
      a = flag + other + "/" + value.substr(value.rfind('/') + 1);
    }
  }
  ASSERT_TRUE(cluster().SignalShard(1, SIGKILL).ok());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  const std::string log = other + "/rogue.log";
  posix_spawn_file_actions_addopen(&fa, 2, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  pid_t rogue = 0;
  const int rc = posix_spawn(&rogue, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ASSERT_EQ(rc, 0);
  // Once the dead shard's lease has gone the rogue holds shard-1's place; its first canary is a
  // mismatch (bounded: 15 s), and the node is not ready.
  double mismatches = 0;
  for (int i = 0; i < 150 && mismatches < 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    mismatches = AttentionMetric("moe_canary_checks_total", {"outcome=\"mismatch\""});
  }
  AwaitReady(false);
  const double ready = AttentionMetric("moe_canary_ready");
  ::kill(rogue, SIGKILL);
  ::waitpid(rogue, nullptr, 0);
  EXPECT_GE(mismatches, 1) << "the rogue's wrong answers were not caught (" << log << ")";
  EXPECT_EQ(ready, 0);
  ASSERT_TRUE(cluster().RestartShard(1).ok());
  AwaitReady(true);
  ExpectOracleAnswer(8, 3);
}

// A mid cluster whose attention node has one worker and the given stream limits.
class ClusterStreams : public testing::ClusterTest {
 protected:
  void StartStreams(std::vector<std::string> attention_args, uint64_t seed) {
    UsePreset("mid", {{0, 64}, {64, 128}});
    options().attention_args = std::move(attention_args);
    options().attention_args.push_back("--workers=1");
    ASSERT_NO_FATAL_FAILURE(StartCluster());
    x_ = Hidden(64, seed);
    want_ = Want(x_, 64);
  }
  // Until the node has counted `at_least` ForwardStream requests CANCELLED (skipped, not
  // computed); bounded by `tries` x 100 ms. Returns the count.
  double AwaitSkipped(double at_least, int tries) {
    double skipped = 0;
    for (int i = 0; i < tries; ++i) {
      skipped =
          AttentionMetric("moe_errors_total", {"method=\"ForwardStream\"", "code=\"CANCELLED\""});
      if (skipped >= at_least) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return skipped;
  }
  void ExpectServedBitExact() {
    auto after = Forward(x_, 64);
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_TRUE(SameBits(after->out, want_));
  }

  std::vector<Bf16> x_, want_;
};

// One client cannot fill the attention node with work: a ForwardStream holds at most
// --max_stream_in_flight requests (the rest get RESOURCE_EXHAUSTED, each with its own answer,
// the stream going on), and the queued work of a stream the client cancelled is skipped.
TEST_F(ClusterStreams, OneStreamCannotQueueUnboundedWork) {
  ASSERT_NO_FATAL_FAILURE(StartStreams({"--max_stream_in_flight=4"}, 17));
  {
    auto stream = user().OpenForwardStream(absl::Seconds(60));
    ASSERT_TRUE(stream.ok());
    for (int i = 0; i < 40; ++i) ASSERT_TRUE((*stream)->Send(layer(), x_, 64, hidden()).ok());
    ASSERT_TRUE((*stream)->CloseSend().ok());
    int ok = 0, refused = 0;
    for (int i = 0; i < 41; ++i) {  // 40 answers, then the end of the stream
      auto r = (*stream)->Receive();
      if (!r.ok()) break;
      if (r->second.ok()) {
        ++ok;
        EXPECT_TRUE(SameBits(r->second->out, want_));
        continue;
      }
      EXPECT_EQ(r->second.status().code(), absl::StatusCode::kResourceExhausted);
      EXPECT_NE(r->second.status().message().find("in flight on this stream"),
                absl::string_view::npos)
          << r->second.status();
      ++refused;
    }
    std::printf("[one stream, 40 requests, limit 4] %d answered, %d refused\n", ok, refused);
    EXPECT_EQ(ok + refused, 40);
    EXPECT_GE(ok, 4);
    EXPECT_GE(refused, 1);
  }
  // Cancelled: what waited in the queue is not computed.
  const std::vector<Bf16> big = Hidden(256, 18);
  {
    auto stream = user().OpenForwardStream(absl::Seconds(60));
    ASSERT_TRUE(stream.ok());
    for (int i = 0; i < 4; ++i) ASSERT_TRUE((*stream)->Send(layer(), big, 256, hidden()).ok());
    // The first answer means the node has read all four (one worker: the rest wait).
    auto first = (*stream)->Receive();
    ASSERT_TRUE(first.ok()) << first.status();
  }  // destroyed: cancelled
  EXPECT_GE(AwaitSkipped(1, 50), 1) << "the cancelled stream's queued work ran anyway";
  ExpectServedBitExact();  // the node serves the next client at once
}

// A client that sends on a ForwardStream and never reads: once its unread replies pass
// --max_stream_outbox_bytes it is treated as gone (replies dropped, its queued work skipped),
// not buffered and computed without end, and its stream ends RESOURCE_EXHAUSTED (never OK:
// replies were lost); another client is served meanwhile.
TEST_F(ClusterStreams, AClientThatDoesNotReadIsCutOff) {
  ASSERT_NO_FATAL_FAILURE(StartStreams(
      {"--max_stream_outbox_bytes=2097152", "--max_stream_in_flight=1000", "--max_queued=1000"},
      19));
  v1::ForwardRequest req;
  req.set_layer(layer());
  transport::EncodeBf16Into(x_, 64, hidden(), req.mutable_hidden_states());
  // A plain channel (default flow-control window): the replies back up in the server.
  auto stub = v1::AttentionService::NewStub(
      grpc::CreateChannel(cluster().attention_endpoint(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto rw = stub->ForwardStream(&ctx);
  constexpr int kSent = 200;
  const absl::Time t0 = absl::Now();
  int written = 0;
  for (int i = 0; i < kSent && absl::Now() - t0 < absl::Seconds(20); ++i) {
    req.set_request_id(i + 1);
    if (!rw->Write(req)) break;  // the server ended the stream
    ++written;
  }
  EXPECT_GT(written, 16);
  EXPECT_GE(AwaitSkipped(1, 200), 1) << "the unread replies were buffered without bound";
  // Another client is served while that stream is still open.
  ASSERT_NO_FATAL_FAILURE(ExpectServedBitExact());
  // The rest of the non-reader's work is skipped, not computed (each reply is 128 KiB: about
  // 16 fit in the outbox, a few more in flight), until every sent request is accounted for.
  const double skipped = AwaitSkipped(kSent / 2, 100);
  const double computed = AttentionMetric("moe_forward_tokens_total") / 64 - 1;  // - the canary
  std::printf("[non-reading stream] %d sent, %.0f computed, %.0f skipped\n", kSent, computed,
              skipped);
  EXPECT_LT(computed, kSent / 2);
  rw->WritesDone();
  v1::ForwardResponse r;
  for (int i = 0; i < kSent && rw->Read(&r); ++i) {
  }
  const grpc::Status end = rw->Finish();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(end.error_message().find("does not read its replies"), std::string::npos)
      << end.error_message();
}

}  // namespace
}  // namespace moe
