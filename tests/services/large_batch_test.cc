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
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention-svc/expert_channel_grpc.h"
#include "attention-svc/expert_channel_ucx.h"
#include "expert-svc/expert_server.h"
#include "services/common/model_config.h"
#include "services/dataplane/ucx_worker.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

int64_t MinorFaults() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return r.ru_minflt;
}

// One message of T tokens, each routed to all k experts of the echo shard: T x D bf16 out,
// T x k x D bf16 back (mid: 8 KiB of reply per token).
struct Batch {
  attention_svc::DispatchHeader header;
  attention_svc::DispatchMessage message;
  size_t reply_bytes = 0;
};

Batch MakeBatch(const ModelConfig& cfg, int64_t t) {
  const int64_t d = cfg.latent, k = cfg.top_k;
  Batch b;
  std::vector<tensor::Bf16> z(static_cast<size_t>(t * d));
  for (size_t i = 0; i < z.size(); ++i) z[i] = tensor::Bf16::FromFloat((i % 997) / 997.0f);
  b.message.shard = 0;
  b.message.z = tensor::Activations::FromBf16(std::move(z), t, d);
  for (int64_t i = 0; i < t; ++i) b.message.tokens.push_back(i);
  for (int64_t e = 0; e < k; ++e) {
    b.message.groups.emplace_back(static_cast<int32_t>(e), static_cast<int32_t>(t));
    for (int64_t i = 0; i < t; ++i) {
      b.message.pairs.push_back(i * k + e);
      b.message.row_source.push_back(static_cast<int32_t>(i));
    }
  }
  b.header.layer = static_cast<int32_t>(cfg.first_moe_layer);
  b.header.mode = attention_svc::ReplyMode::kPerPair;
  b.header.num_tokens = t;
  b.header.latent = d;
  b.header.timeout_ms = 30000;
  b.reply_bytes = static_cast<size_t>(t * k * d * 2);
  return b;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Lane {
  std::string name;
  bool ucx;
  std::string tls;
};

class LargeBatch : public ::testing::TestWithParam<Lane> {};

TEST_P(LargeBatch, AFourMiBRoundTripCostsItsBytesNotACliff) {
  const Lane lane = GetParam();
  if (lane.ucx && !dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  const ModelConfig cfg = *PresetConfig("mid");
  expert_svc::ExpertServerOptions o;
  o.host = "127.0.0.1";
  o.preset = "mid";
  o.expert_lo = 0;
  o.expert_hi = cfg.top_k;
  o.shard = "echo-0";
  o.threads = 1;
  o.backend = expert_svc::Backend::kEcho;
  o.measure_limits = false;
  o.verify_fraction = 0;
  o.data_plane = lane.ucx ? dataplane::DataPlane::kUcx : dataplane::DataPlane::kGrpc;
  o.ucx_tls = lane.tls;
  auto server = expert_svc::ExpertServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string endpoint = absl::StrCat("127.0.0.1:", (*server)->port());
  std::unique_ptr<dataplane::UcxWorker> worker;
  std::unique_ptr<attention_svc::ExpertChannel> channel;
  if (lane.ucx) {
    dataplane::UcxOptions uo;
    uo.tls = lane.tls;
    auto w = dataplane::UcxWorker::Create(uo);
    ASSERT_TRUE(w.ok()) << w.status();
    worker = std::move(*w);
    channel = std::make_unique<attention_svc::UcxExpertChannel>(
        "echo-0", endpoint, 1 << 30, worker.get(), dataplane::DataPlane::kUcx, "test", nullptr, "");
  } else {
    channel = std::make_unique<attention_svc::GrpcExpertChannel>("echo-0", endpoint, 1 << 30, "");
  }
  const Batch small = MakeBatch(cfg, 64), big = MakeBatch(cfg, 512);
  ASSERT_EQ(small.reply_bytes, size_t{512} << 10);
  ASSERT_EQ(big.reply_bytes, size_t{4} << 20);
  // The echo answers every pair with its token's row: the reply is checked whole each time.
  auto round_trip = [&](const Batch& b) -> double {
    const auto start = Clock::now();
    auto call = channel->Send(b.header, b.message);
    auto reply = call->Wait(absl::Now() + absl::Seconds(30));
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    // The lane the batch really took (an unopened UCX data plane would fall back in band).
    EXPECT_STREQ(call->transport(), lane.ucx ? "ucx" : "grpc");
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
  channel.reset();
  (*server)->Shutdown(absl::Seconds(1));
}

INSTANTIATE_TEST_SUITE_P(EveryLane, LargeBatch,
                         ::testing::Values(Lane{"grpc", false, ""}, Lane{"ucx_shm", true, "posix"},
                                           Lane{"ucx_tcp", true, "tcp"}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace moe
