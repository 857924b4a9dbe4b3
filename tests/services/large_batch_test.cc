// A batch's round trip grows with its bytes, not past them (issue: the cliff past about 1 MiB).
// An expert server with the echo backend (each row answered with its activations) runs in this
// process, and this process's attention-side channel sends it one dispatch message at a time on
// each lane: gRPC in band, UCX over shared memory, UCX over TCP. Round trips of a 512 KiB and a
// 4 MiB reply alternate, so both see the same noise; the 4 MiB one carries 8x the bytes and must
// cost less than 3 x 8x the 512 KiB one (before the fix, a doubling past 1 MiB cost 5-30x, so
// 512 KiB -> 4 MiB was 17-100x). What made the cliff is asserted as a count: the process's page
// faults per 4 MiB round trip stay below half of the reply's pages (with glibc's malloc: 3,341
// faults, 13 MiB faulted in, per round trip on the gRPC lane; with tcmalloc 0-260;
// services/common/allocator.h).
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention-svc/attention_options.h"
#include "services/common/model_config.h"
#include "services/common/poll_window.h"
#include "services/dataplane/ucx_worker.h"
#include "tests/common/echo_shard.h"
#include "tests/common/thread_sleeps.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

int64_t MinorFaults() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return r.ru_minflt;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Lane {
  std::string name;
  std::string tls;  // UCX_TLS; empty: gRPC in band
};

class LargeBatch : public ::testing::TestWithParam<Lane> {};

TEST_P(LargeBatch, AFourMiBRoundTripCostsItsBytesNotACliff) {
  const Lane lane = GetParam();
  if (!lane.tls.empty() && !dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  const ModelConfig cfg = *PresetConfig("mid");
  auto shard = testing::EchoShard::Start("mid", lane.tls);
  ASSERT_TRUE(shard.ok()) << shard.status();
  attention_svc::ExpertChannel& channel = (*shard)->channel();
  const testing::EchoBatch small = testing::MakeEchoBatch(cfg, 64),
                           big = testing::MakeEchoBatch(cfg, 512);
  ASSERT_EQ(small.reply_bytes, size_t{512} << 10);
  ASSERT_EQ(big.reply_bytes, size_t{4} << 20);
  // The echo answers every pair with its token's row: the reply is checked whole each time.
  auto round_trip = [&](const testing::EchoBatch& b) -> double {
    const auto start = Clock::now();
    auto call = channel.Send(b.header, b.message);
    auto reply = call->Wait(absl::Now() + absl::Seconds(30));
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    // The lane the batch really took (an unopened UCX data plane would fall back in band).
    EXPECT_STREQ(call->transport(), !lane.tls.empty() ? "ucx" : "grpc");
    EXPECT_TRUE(reply.ok()) << reply.status();
    if (!reply.ok()) return -1;
    EXPECT_EQ(reply->bf16.size() * 2, b.reply_bytes);
    const int64_t d = cfg.latent;
    const auto& z = b.message.z.bf16();
    for (size_t r = 0; r < b.message.row_source.size(); r += 97) {
      const int64_t src = b.message.row_source[r];
      EXPECT_EQ(0, std::memcmp(&reply->bf16[r * d], &z[src * d], d * 2)) << "row " << r;
    }
    return us;
  };
  for (int i = 0; i < 3; ++i) {  // warm: connections, the data plane's hello, pools
    round_trip(small);
    round_trip(big);
  }
  constexpr int kRounds = 12;
  std::vector<double> small_us, big_us;
  int64_t big_faults = 0;
  for (int i = 0; i < kRounds; ++i) {
    small_us.push_back(round_trip(small));
    const int64_t before = MinorFaults();
    big_us.push_back(round_trip(big));
    big_faults += MinorFaults() - before;
  }
  const double ratio = Median(big_us) / Median(small_us);
  const int64_t faults_per_trip = big_faults / kRounds;
  std::printf(
      "%s: 512 KiB %.0f us, 4 MiB %.0f us (%.1fx for 8x the bytes), %lld page faults "
      "per 4 MiB round trip\n",
      lane.name.c_str(), Median(small_us), Median(big_us), ratio,
      static_cast<long long>(faults_per_trip));
  EXPECT_LT(ratio, 3 * 8.0) << lane.name;
  EXPECT_LT(faults_per_trip, static_cast<int64_t>(big.reply_bytes / 4096 / 2)) << lane.name;
}

// The two protocols of the UCX lane carry the same batch bit for bit: batch messages (one UCX
// active message each way, no Dispatch stream ever opened) with a shard of this release, and the
// previous protocol (the header on the Dispatch stream, the payloads as tagged messages) with a
// shard that answers like the previous release; eager and rendezvous sizes, shared memory
// (posix alone, and with cma, where the receiver pulls a large reply) and TCP; the T = 200
// reply (1.6 MB) asks for its tag after it. What the channel really did is read back: whether
// it opened a Dispatch stream, how many batches asked for a detached tag, and how many batch
// messages its worker dropped (none).
TEST(EchoDataPlane, BothProtocolsCarryTheSameBatchBitExact) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  const ModelConfig cfg = *PresetConfig("mid");
  for (const char* tls : {"posix", "posix,cma", "tcp"}) {
    for (bool batch_messages : {true, false}) {
      SCOPED_TRACE(absl::StrCat(tls, batch_messages ? " batch messages" : " previous protocol"));
      auto shard = testing::EchoShard::Start("mid", tls, batch_messages);
      ASSERT_TRUE(shard.ok()) << shard.status();
      for (int64_t t : {1, 16, 200}) {
        const testing::EchoBatch b = testing::MakeEchoBatch(cfg, t);
        auto call = (*shard)->channel().Send(b.header, b.message);
        auto reply = call->Wait(absl::Now() + absl::Seconds(30));
        ASSERT_TRUE(reply.ok()) << reply.status();
        EXPECT_STREQ(call->transport(), "ucx");
        ASSERT_EQ(reply->bf16.size() * 2, b.reply_bytes);
        const int64_t d = cfg.latent;
        const auto& z = b.message.z.bf16();
        size_t wrong = 0;
        for (size_t r = 0; r < b.message.row_source.size(); ++r) {
          wrong += std::memcmp(&reply->bf16[r * d], &z[b.message.row_source[r] * d], d * 2) != 0;
        }
        EXPECT_EQ(wrong, 0u) << "T " << t;
      }
      EXPECT_EQ((*shard)->ucx_channel()->dispatch_streams_opened(), batch_messages ? 0 : 1);
      EXPECT_EQ((*shard)->worker()->messages_dropped(), 0);
      // Only the 1.6 MB reply, only from a shard that offers it.
      EXPECT_EQ((*shard)->ucx_channel()->detached_tag_batches(), batch_messages ? 1 : 0);
    }
  }
}

// Per-pair rows are read in the registered buffer they arrived in (ExpertReply::held keeps it),
// and a shard writes them into the buffer its reply leaves from: a reply's rows stay what the
// shard sent after its call is gone and 20 later batches of other values went through the same
// pools on both sides, and each of those is right too.
TEST(EchoDataPlane, RowsReadInPlaceStayTheRepliesAcrossLaterBatches) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  const ModelConfig cfg = *PresetConfig("mid");
  const int64_t d = cfg.latent;
  auto wrong_rows = [&](const attention_svc::ExpertReply& r, const testing::EchoBatch& b) {
    size_t wrong = 0;
    const auto& z = b.message.z.bf16();
    for (size_t i = 0; i < b.message.row_source.size(); ++i) {
      wrong += std::memcmp(&r.bf16[i * d], &z[b.message.row_source[i] * d], d * 2) != 0;
    }
    return wrong;
  };
  for (const char* tls : {"posix", "tcp"}) {
    SCOPED_TRACE(tls);
    auto shard = testing::EchoShard::Start("mid", tls);
    ASSERT_TRUE(shard.ok()) << shard.status();
    const testing::EchoBatch first = testing::MakeEchoBatch(cfg, 64);
    testing::EchoBatch later = testing::MakeEchoBatch(cfg, 64);
    std::vector<tensor::Bf16> other(static_cast<size_t>(64 * d));
    for (size_t i = 0; i < other.size(); ++i) {
      other[i] = tensor::Bf16::FromFloat(-1.0f - (i % 991) / 991.0f);
    }
    later.message.z = tensor::Activations::FromBf16(std::move(other), 64, d);
    absl::StatusOr<attention_svc::ExpertReply> kept = absl::UnknownError("not sent");
    {
      auto call = (*shard)->channel().Send(first.header, first.message);
      kept = call->Wait(absl::Now() + absl::Seconds(30));
      EXPECT_STREQ(call->transport(), "ucx");
    }
    ASSERT_TRUE(kept.ok()) << kept.status();
    ASSERT_EQ(kept->bf16.size() * 2, first.reply_bytes);
    for (int i = 0; i < 20; ++i) {
      auto call = (*shard)->channel().Send(later.header, later.message);
      auto r = call->Wait(absl::Now() + absl::Seconds(30));
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(r->bf16.size() * 2, later.reply_bytes);
      EXPECT_EQ(wrong_rows(*r, later), 0u) << "batch " << i;
    }
    EXPECT_EQ(wrong_rows(*kept, first), 0u);
    EXPECT_EQ((*shard)->worker()->messages_dropped(), 0);
  }
}

// Two ends of a shared-memory lane must use one FIFO shape (UCX writes into the peer's FIFO with
// its own and checks nothing: with UCX's own 64 x 8 KiB against this project's 128 x 32 KiB a
// raw peer's messages stopped after the first 64). A node whose shape differs from the shard's
// (said in OpenDataPlane) does not use the lane: its batch fails (UNAVAILABLE, as every data plane
// that does not open) naming both shapes and the variables to set, or goes in band where the node
// may fall back; the shard keeps serving a node that matches, bit for bit.
TEST(EchoDataPlane, ANodeWithAnotherSharedMemoryFifoDoesNotUseTheLane) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  const ModelConfig cfg = *PresetConfig("mid");
  auto shard = testing::EchoShard::Start("mid", "posix");
  ASSERT_TRUE(shard.ok()) << shard.status();
  setenv("UCX_POSIX_FIFO_SIZE", "64", 1);
  setenv("UCX_POSIX_SEG_SIZE", "8256", 1);
  auto other = testing::MakeUcxNode((*shard)->endpoint(), "posix", "other-node");
  unsetenv("UCX_POSIX_FIFO_SIZE");
  unsetenv("UCX_POSIX_SEG_SIZE");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->worker->shared_memory_fifo(), "64x8256");
  EXPECT_NE((*shard)->worker()->shared_memory_fifo(), "64x8256");
  const testing::EchoBatch b = testing::MakeEchoBatch(cfg, 100);
  for (int i = 0; i < 2; ++i) {  // the second is refused from what the first found
    auto refused = other->channel->Send(b.header, b.message)->Wait(absl::Now() + absl::Seconds(30));
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
    EXPECT_NE(refused.status().message().find("shared-memory FIFO is " +
                                              (*shard)->worker()->shared_memory_fifo() +
                                              ", this node's 64x8256"),
              std::string::npos)
        << refused.status();
    EXPECT_NE(refused.status().message().find("UCX_POSIX_FIFO_SIZE"), std::string::npos);
  }
  attention_svc::ChannelOptions co;
  co.shard = "echo-0";
  co.endpoint = (*shard)->endpoint();
  co.max_message_bytes = 1 << 30;
  co.node = "other-node-in-band";
  co.fallback_in_band = true;
  attention_svc::UcxExpertChannel falls_back(std::move(co), other->worker.get());
  // The node with the shard's shape: 70 batches (past any FIFO's wrap); the other one, in band.
  for (int i = 0; i < 70; ++i) {
    const bool in_band = i % 7 == 3;
    auto call =
        (in_band ? static_cast<attention_svc::ExpertChannel&>(falls_back) : (*shard)->channel())
            .Send(b.header, b.message);
    auto r = call->Wait(absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_STREQ(call->transport(), in_band ? "grpc" : "ucx");
    const auto& z = b.message.z.bf16();
    size_t wrong = 0;
    for (size_t row = 0; row < b.message.row_source.size(); ++row) {
      wrong += std::memcmp(&r->bf16[row * cfg.latent], &z[b.message.row_source[row] * cfg.latent],
                           cfg.latent * 2) != 0;
    }
    ASSERT_EQ(wrong, 0u) << "batch " << i;
  }
}

// An attention node that sends its next batch 500 us after the last reply (its own compute in
// between, as a model loop's layers do): the shard's compute thread polls for the next batch for
// a window learned from those gaps (--ucx_poll_max_us above them) and sleeps for none; with the
// window fixed at the floor (100 us, the ceiling at the floor) it slept between nearly every two
// batches (the kernel's count of the "expert-compute" thread's sleeps). Every reply bit-exact.
TEST(EchoDataPlane, TheComputeThreadPollsThroughTheGapsItLearned) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  const ModelConfig cfg = *PresetConfig("mid");
  const testing::EchoBatch b = testing::MakeEchoBatch(cfg, 8);
  constexpr int kBatches = 60;
  auto sleeps_with = [&](int poll_max_us, int64_t* sleeps) {
    auto shard = testing::EchoShard::Start("mid", "posix", /*batch_messages=*/true,
                                           /*progress_spin_us=*/0, poll_max_us);
    ASSERT_TRUE(shard.ok()) << shard.status();
    int64_t before = 0;
    for (int i = 0; i < 20 + kBatches; ++i) {
      if (i == 20) before = testing::ThreadSleeps("expert-compute");  // after warm-up, learned
      auto r = (*shard)->channel().Send(b.header, b.message)->Wait(absl::Now() + absl::Seconds(10));
      ASSERT_TRUE(r.ok()) << r.status();
      const auto& z = b.message.z.bf16();
      for (size_t row = 0; row < b.message.row_source.size(); ++row) {
        ASSERT_EQ(std::memcmp(&r->bf16[row * cfg.latent],
                              &z[b.message.row_source[row] * cfg.latent], cfg.latent * 2),
                  0);
      }
      const auto until = Clock::now() + std::chrono::microseconds(500);
      while (Clock::now() < until) {
      }
    }
    *sleeps = testing::ThreadSleeps("expert-compute") - before;
  };
  int64_t fixed = 0, learned = 0;
  sleeps_with(100, &fixed);
  // A ceiling far above the gaps: a loaded machine may stretch them to milliseconds.
  sleeps_with(50000, &learned);
  std::printf(
      "[polling] the shard's compute thread slept %lld times in %d batches 500 us apart with a "
      "fixed 100 us poll, %lld with the learned window\n",
      static_cast<long long>(fixed), kBatches, static_cast<long long>(learned));
  // Alone the fixed window slept about once per batch (60-125 times), and so did the learned one
  // with its window held at the floor (80: tried); a loaded machine may deschedule the threads
  // past the gaps, so the fixed window's count is not asserted (0 in one ctest -j2 run).
  EXPECT_LE(learned, kBatches / 4);  // 0-5 seen alone
}

// Both services' default windows (--ucx_poll_us, --ucx_poll_max_us) cover the waits of a local
// cluster at T = 1: its shards' compute threads waited ~1.5 ms between batches and the attention
// node ~1 ms for its replies; under the 1 ms ceiling of before most of those waits slept
// (0.10-0.15 ms per batch between a message and its compute; cluster_bench's +poll3000 ahead at
// T = 1 and 4 in 10 of 10 alternated pairs, docs/data-plane.md). The rule is PollWindow's; this
// pins the defaults it gets (with a 1 ms ceiling the window stays at the 100 us floor and this
// fails: tried). (End to end, batches 1 ms apart on an echo shard slept 0-1 times in
// 40 with the default and 44-47 with a 1 ms ceiling, but under two CPU hogs the gaps stretch past
// any ceiling, so that is not a test.)
TEST(EchoDataPlane, BothServicesDefaultWindowsCoverALocalClustersT1Waits) {
  const expert_svc::ExpertServerOptions shard;
  const attention_svc::AttentionServerOptions node;
  for (const auto& [name, floor_us, ceiling_us] :
       {std::tuple<const char*, int, int>{"expert-svc", shard.ucx_poll_us, shard.ucx_poll_max_us},
        {"attention-svc", node.ucx_poll_us, node.ucx_poll_max_us}}) {
    PollWindow w{std::chrono::microseconds(floor_us), std::chrono::microseconds(ceiling_us)};
    for (int i = 0; i < PollWindow::kSamples; ++i) {
      w.Record(std::chrono::microseconds(1300 + 700 * (i % 2)));  // 1.3 and 2 ms
    }
    EXPECT_GE(w.Window(), std::chrono::microseconds(2000)) << name;
  }
}

// Attention nodes come and go (a worker dies, a node reconnects under its name) while others keep
// sending: every batch of every live node is answered. UCX may hand a new peer the endpoint of
// one that died; the shard once closed that endpoint when the dead peer's node reconnected, and
// the live node's batches then went unanswered (found by hop_bench's senders over TCP); later it
// gave the new peer the dead one's endpoint id, which the reconnect then forgot, and the new
// peer's hello went unacknowledged (a CI run). Whether UCX reuses an endpoint in this test
// depends on timing, so the rules are pinned by DataPlaneClients.ReconnectsReplaceTheirOldEntry-
// WithinTheLimit and UcxWorker.EveryHelloGetsAnEndpointOfItsOwnWhenUcxReusesOne.
TEST(EchoDataPlane, NodesThatComeAndGoLeaveTheOthersAnswered) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  const ModelConfig cfg = *PresetConfig("mid");
  auto server =
      expert_svc::ExpertServer::Start(testing::EchoServerOptions("mid", cfg.top_k, "tcp"));
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string endpoint = absl::StrCat("127.0.0.1:", (*server)->port());
  testing::EchoBatch b = testing::MakeEchoBatch(cfg, 4);
  b.header.timeout_ms = 3000;
  int answered = 0, failed = 0;
  for (int round = 1; round <= 4; ++round) {
    std::vector<testing::UcxNode> nodes;
    for (int i = 0; i <= round; ++i) {
      auto n = testing::MakeUcxNode(endpoint, "tcp", absl::StrCat("node-", i));
      ASSERT_TRUE(n.ok()) << n.status();
      nodes.push_back(std::move(*n));
    }
    std::vector<std::thread> threads;
    std::atomic<int> ok{0}, bad{0};
    for (auto& n : nodes) {
      threads.emplace_back([&, ch = n.channel.get()] {
        for (int j = 0; j < 30; ++j) {
          auto r = ch->Send(b.header, b.message)->Wait(absl::Now() + absl::Seconds(3));
          (r.ok() ? ok : bad).fetch_add(1);
          if (!r.ok()) std::fprintf(stderr, "round %d: %s\n", round, r.status().ToString().c_str());
        }
      });
    }
    for (auto& t : threads) t.join();
    answered += ok.load();
    failed += bad.load();
  }
  EXPECT_EQ(failed, 0);
  EXPECT_EQ(answered, 30 * (2 + 3 + 4 + 5));
  (*server)->Shutdown(absl::Seconds(1));
}

// A shard that no longer knows a client drops its batch messages unread (here another process
// opened the data plane under the same node name, which replaces the client; an idle one is
// evicted the same way): that batch fails at its deadline, naming the shard, and the next one
// opens the data plane again and is answered, instead of every later batch waiting out its
// deadline too.
TEST(EchoDataPlane, ABatchTheShardDroppedReopensTheDataPlane) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  const ModelConfig cfg = *PresetConfig("mid");
  auto server =
      expert_svc::ExpertServer::Start(testing::EchoServerOptions("mid", cfg.top_k, "posix"));
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string endpoint = absl::StrCat("127.0.0.1:", (*server)->port());
  testing::EchoBatch b = testing::MakeEchoBatch(cfg, 2);
  b.header.timeout_ms = 400;
  std::vector<testing::UcxNode> nodes;
  for (int i = 0; i < 2; ++i) {
    auto n = testing::MakeUcxNode(endpoint, "posix", "same-node");
    ASSERT_TRUE(n.ok()) << n.status();
    nodes.push_back(std::move(*n));
  }
  auto send = [&](int i) {
    return nodes[i].channel->Send(b.header, b.message)->Wait(absl::Now() + absl::Seconds(5));
  };
  ASSERT_TRUE(send(0).ok());
  ASSERT_TRUE(send(1).ok());  // the same node name: the shard replaces channel 0's client
  auto dropped = send(0);
  EXPECT_EQ(dropped.status().code(), absl::StatusCode::kDeadlineExceeded) << dropped.status();
  EXPECT_NE(dropped.status().message().find("echo-0"), std::string::npos);
  auto again = send(0);  // reopened
  EXPECT_TRUE(again.ok()) << again.status();
  nodes.clear();
  (*server)->Shutdown(absl::Seconds(1));
}

INSTANTIATE_TEST_SUITE_P(EveryLane, LargeBatch,
                         ::testing::Values(Lane{"grpc", ""}, Lane{"ucx_shm", "posix"},
                                           Lane{"ucx_tcp", "tcp"}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace moe
