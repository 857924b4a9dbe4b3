// The data plane's seam (expert-svc/dataplane, attention-svc/dataplane): both registries name the
// same backends, every --data_plane value is checked against them, and the second backend (the
// in-process fake) carries batches through the real expert server (its OpenDataPlane, the
// hello, the sealed batch messages, the core) bit for bit like the in-band lane, refuses what a
// stranger puts on its wire, and is never mistaken for UCX.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "attention-svc/dataplane/registry.h"
#include "attention-svc/expert_channel_grpc.h"
#include "expert-svc/dataplane/registry.h"
#include "expert-svc/expert_server.h"
#include "moe/v1/expert.grpc.pb.h"
#include "services/dataplane/data_plane.h"
#include "services/dataplane/fake_wire.h"
#include "services/dataplane/ucx_worker.h"
#include "services/transport/channel.h"
#include "tests/common/backend_shard.h"
#include "tests/common/echo_shard.h"
#include "tests/common/metrics_text.h"

namespace moe {
namespace {

using C = absl::StatusCode;

TEST(DataPlaneRegistry, BothSidesNameTheSameBackends) {
  EXPECT_EQ(expert_svc::ServerBackendNames(), attention_svc::ClientBackendNames());
  EXPECT_EQ(expert_svc::ServerBackendNames(), (std::vector<std::string>{"ucx", "fake", "shm"}));
  auto unknown = expert_svc::StartServerHalf("rdma9", {});
  EXPECT_EQ(unknown.status().code(), C::kNotFound);
  EXPECT_NE(unknown.status().message().find("ucx, fake, shm"), std::string::npos);
  EXPECT_EQ(attention_svc::StartClientHalf("rdma9", {}).status().code(), C::kNotFound);
  // The flag takes auto, grpc and the registered names, nothing else.
  for (const char* ok : {"auto", "grpc", "ucx", "fake", "shm"}) {
    EXPECT_TRUE(dataplane::ParseDataPlane(ok, expert_svc::ServerBackendNames()).ok()) << ok;
  }
  auto bad = dataplane::ParseDataPlane("rdma9", expert_svc::ServerBackendNames());
  EXPECT_EQ(bad.status().code(), C::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("auto, grpc, ucx, fake, shm"), std::string::npos);
  // auto: shm, then UCX (a node's order of preference; a shard offers both, UCX first).
  EXPECT_EQ(dataplane::DataPlane{}.backends(), (std::vector<std::string>{"shm", "ucx"}));
  EXPECT_EQ(dataplane::DataPlane{"grpc"}.backends(), std::vector<std::string>{});
  EXPECT_EQ(dataplane::DataPlane{"fake"}.backends(), std::vector<std::string>{"fake"});
  // --ucx_progress_spin_us reaches the backends within [0, 10 ms].
  EXPECT_EQ(dataplane::ProgressSpin(-5).count(), 0);
  EXPECT_EQ(dataplane::ProgressSpin(30).count(), 30);
  EXPECT_EQ(dataplane::ProgressSpin(1 << 30).count(), 10000);
}

// An echo shard on the fake data plane, with its metrics.
using FakeShard = testing::BackendShard;
FakeShard StartFakeShard(const ModelConfig& cfg) { return testing::StartBackendShard(cfg, "fake"); }
attention_svc::ChannelOptions ChannelTo(const FakeShard& s, bool fallback) {
  return testing::BackendChannel(s, "attention-fake", fallback);
}
using testing::WrongEchoRows;

TEST(FakeDataPlane, CarriesBatchesThroughTheRealServerBitExact) {
  const ModelConfig cfg = *PresetConfig("mid");
  FakeShard shard = StartFakeShard(cfg);
  {  // The shard says what it offers.
    auto stub = v1::ExpertService::NewStub(transport::MakeChannel(shard.endpoint));
    grpc::ClientContext ctx;
    v1::ExpertServerInfo info;
    ASSERT_TRUE(stub->GetInfo(&ctx, v1::GetExpertInfoRequest(), &info).ok());
    EXPECT_EQ(info.data_plane(), "fake");
    EXPECT_EQ(info.ucx_address().substr(0, 5), "fake:");
  }
  auto half = attention_svc::StartClientHalf("fake", {});
  ASSERT_TRUE(half.ok()) << half.status();
  std::vector<std::string> events;
  attention_svc::ChannelOptions co = ChannelTo(shard, /*fallback=*/false);
  co.on_event = [&](const std::string&, const std::string& e) { events.push_back(e); };
  std::shared_ptr<attention_svc::ExpertChannel> fake = (*half)->MakeChannel(co);
  attention_svc::GrpcExpertChannel inband("echo-0", shard.endpoint, 1 << 30, "");
  for (int64_t t : {1, 16, 200}) {
    const testing::EchoBatch b = testing::MakeEchoBatch(cfg, t);
    const int64_t before = dataplane::FakeWire::delivered();
    auto call = fake->Send(b.header, b.message);
    auto reply = call->Wait(absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_STREQ(call->transport(), "fake");
    // The request and the reply crossed the wire (and the hello and its ack, the first time).
    EXPECT_GE(dataplane::FakeWire::delivered() - before, 2) << "T " << t;
    ASSERT_EQ(reply->bf16.size() * 2, b.reply_bytes);
    EXPECT_EQ(WrongEchoRows(b, *reply, cfg.latent), 0u) << "T " << t;
    auto in = inband.Send(b.header, b.message)->Wait(absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(in.ok()) << in.status();
    ASSERT_EQ(in->bf16.size(), reply->bf16.size());
    EXPECT_EQ(std::memcmp(in->bf16.data(), reply->bf16.data(), in->bf16.size() * 2), 0) << t;
  }
  EXPECT_STREQ(fake->transport(), "fake");
  EXPECT_EQ(events, std::vector<std::string>{"connected"});
}

// Bytes a stranger in the process puts on the shard's wire address are counted and dropped,
// never answered and never computed; the connection's batches stay bit-exact.
TEST(FakeDataPlane, StrangersOnTheWireAreDroppedAndCounted) {
  const ModelConfig cfg = *PresetConfig("mid");
  FakeShard shard = StartFakeShard(cfg);
  auto half = attention_svc::StartClientHalf("fake", {});
  ASSERT_TRUE(half.ok());
  std::shared_ptr<attention_svc::ExpertChannel> fake =
      (*half)->MakeChannel(ChannelTo(shard, false));
  const testing::EchoBatch b = testing::MakeEchoBatch(cfg, 8);
  ASSERT_TRUE(fake->Send(b.header, b.message)->Wait(absl::Now() + absl::Seconds(30)).ok());
  std::string address;
  {
    auto stub = v1::ExpertService::NewStub(transport::MakeChannel(shard.endpoint));
    grpc::ClientContext ctx;
    v1::ExpertServerInfo info;
    ASSERT_TRUE(stub->GetInfo(&ctx, v1::GetExpertInfoRequest(), &info).ok());
    address = info.ucx_address();
  }
  // A frame for client 1 with a made-up MAC, a garbage frame, a hello with a wrong secret.
  dataplane::BatchFrame f;
  f.token = 7;
  f.client_id = 1;
  f.sequence = 99;
  f.header_bytes = 0;
  f.mac = std::string(16, 'x');
  ASSERT_TRUE(dataplane::FakeWire::Send(address, dataplane::EncodeBatchFrame(f), "abc").ok());
  ASSERT_TRUE(dataplane::FakeWire::Send(address, std::string(56, '\xff'), "").ok());
  ASSERT_TRUE(dataplane::FakeWire::Send(address, dataplane::EncodeHello({1, std::string(16, 's')}),
                                        "fake:0")
                  .ok());
  for (int i = 0; i < 3; ++i) {  // the canary, after and between
    auto r = fake->Send(b.header, b.message)->Wait(absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(WrongEchoRows(b, *r, cfg.latent), 0u);
  }
  const std::string fam = "moe_expert_data_plane_events_total";
  EXPECT_EQ(testing::ScrapeSum(shard.metrics, fam, {"event=\"integrity_failed\""}), 1);
  EXPECT_EQ(testing::ScrapeSum(shard.metrics, fam, {"event=\"message_rejected\""}), 1);
  EXPECT_EQ(testing::ScrapeSum(shard.metrics, fam, {"event=\"hello_rejected\""}), 1);
}

// A node of one backend and a shard of another never mix: the fake shard refuses nothing, but
// the UCX node sees "fake" in OpenDataPlane and goes in band (auto) or fails naming both.
TEST(FakeDataPlane, ANodeOfAnotherBackendGoesInBandOrFailsNamingBoth) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  const ModelConfig cfg = *PresetConfig("mid");
  FakeShard shard = StartFakeShard(cfg);
  auto ucx = attention_svc::StartClientHalf("ucx", {});
  ASSERT_TRUE(ucx.ok()) << ucx.status();
  const testing::EchoBatch b = testing::MakeEchoBatch(cfg, 4);
  std::vector<std::string> events;
  attention_svc::ChannelOptions co = ChannelTo(shard, /*fallback=*/true);
  co.on_event = [&](const std::string&, const std::string& e) { events.push_back(e); };
  auto automatic = (*ucx)->MakeChannel(co);
  auto call = automatic->Send(b.header, b.message);
  auto r = call->Wait(absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_STREQ(call->transport(), "grpc");
  EXPECT_EQ(WrongEchoRows(b, *r, cfg.latent), 0u);
  EXPECT_EQ(events, std::vector<std::string>{"fallback"});
  auto strict = (*ucx)->MakeChannel(ChannelTo(shard, /*fallback=*/false));
  auto refused = strict->Send(b.header, b.message)->Wait(absl::Now() + absl::Seconds(30));
  EXPECT_EQ(refused.status().code(), C::kUnavailable);
  // The shard names what the node asked for and what it offers.
  EXPECT_NE(refused.status().message().find("does not offer the ucx data plane (it offers fake"),
            std::string::npos)
      << refused.status();
}

// A shard that stops mid-conversation: the next batch ends within its deadline (UNAVAILABLE or
// DEADLINE_EXCEEDED, naming the shard), it does not hang.
TEST(FakeDataPlane, AStoppedShardEndsTheBatchWithinItsDeadline) {
  const ModelConfig cfg = *PresetConfig("mid");
  FakeShard shard = StartFakeShard(cfg);
  auto half = attention_svc::StartClientHalf("fake", {});
  ASSERT_TRUE(half.ok());
  auto fake = (*half)->MakeChannel(ChannelTo(shard, false));
  testing::EchoBatch b = testing::MakeEchoBatch(cfg, 4);
  ASSERT_TRUE(fake->Send(b.header, b.message)->Wait(absl::Now() + absl::Seconds(30)).ok());
  shard.server->Shutdown(absl::Seconds(1));
  b.header.timeout_ms = 2000;
  const absl::Time start = absl::Now();
  auto r = fake->Send(b.header, b.message)->Wait(absl::Now() + absl::Seconds(10));
  EXPECT_FALSE(r.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(4)) << r.status();
  EXPECT_NE(r.status().message().find("echo-0"), std::string::npos) << r.status();
}

}  // namespace
}  // namespace moe
