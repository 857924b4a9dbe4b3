// A stranger's UCX active messages against a running shard (issue: the data plane, third
// generation). UCX 1.13.1 reads its AM handler table without a bounds check: one active message
// on id 65535 took down an expert-svc (SIGSEGV on UCX's progress thread, glibc's malloc). Under
// tcmalloc the reads past the table land in mapped memory instead, and without a handler on
// every id this test saw 16 of the 131,072 messages never completed (the worker read whatever
// lay past its table). Here a raw UCP peer (tests/dataplane/raw_ucp_peer.h) connects to
// shard-0's worker over TCP and sends every id 0..65535, with and without the reply flag, while
// a canary sends the same request again and again through the whole cluster: every process must
// stay up and every canary answer must equal the in-process layer bit for bit. The peer reads
// the shard's address with the members' token, which only makes it stronger than the stranger
// of the report (who forged an address from UCX's listening ports and needed no credential);
// what it sends is the same.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "moe/v1/expert.grpc.pb.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/moe_client.h"
#include "services/tools/local_cluster.h"
#include "services/transport/channel.h"
#include "tests/common/listening_sockets.h"
#include "tests/dataplane/raw_ucp_peer.h"
#include "tests/services/cluster_fixtures.h"

namespace moe {
namespace {

using tensor::Bf16;
using testing::SameBits;

TEST(ClusterDataPlane, EveryActiveMessageIdFromAStrangerLeavesEveryProcessUp) {
  const std::string& dir = testing::CheckpointFor("tiny");
  ModelConfig cfg;
  auto local = testing::InProcessLayer(dir, &cfg);
  tools::LocalClusterOptions o = testing::TestCluster(dir, {{0, 8}, {8, 16}});
  o.expert_args = testing::UcxArgs("tcp");
  o.attention_args = testing::UcxArgs("tcp");
  auto cluster = tools::LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);
  constexpr int64_t kTokens = 16;
  const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, kTokens, 78);
  const std::vector<Bf16> want = local->Forward(x, kTokens, cfg.hidden)->out;

  auto stub = v1::ExpertService::NewStub(transport::MakeChannel((*cluster)->shard_endpoint(0)));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  ctx.AddMetadata(transport::kClusterTokenMetadata, testing::AttentionToken(**cluster));
  v1::ExpertServerInfo info;
  ASSERT_TRUE(stub->GetInfo(&ctx, v1::GetExpertInfoRequest(), &info).ok());
  ASSERT_FALSE(info.ucx_address().empty());

  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, wrong{0}, failed{0};
  std::thread canary([&] {
    auto client = testing::ClientFor(**cluster);
    client::ForwardOptions fo;
    fo.timeout = absl::Seconds(5);
    for (int i = 0; i < 5000 && !stop.load(); ++i) {  // bounded in count and (below) time
      auto r = client->Forward(layer, x, kTokens, cfg.hidden, fo);
      if (!r.ok()) {
        failed.fetch_add(1);
      } else {
        (SameBits(r->out, want) ? ok : wrong).fetch_add(1);
      }
    }
  });

  moe::testing::RawUcpPeer peer("tcp");
  ASSERT_TRUE(peer.Connect(info.ucx_address()));
  const std::string header(16, 'x'), data(70000, 'y');
  int sent = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  for (int reply = 0; reply < 2; ++reply) {
    for (int id = 0; id < 65536 && std::chrono::steady_clock::now() < until; ++id) {
      sent += peer.SendAm(static_cast<unsigned>(id), reply == 1, header,
                          id % 8192 == 3 ? data : std::string());
    }
  }
  peer.Progress();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  stop.store(true);
  canary.join();
  std::printf("[stray active messages] %d of %d sent; canary %d bit-exact, %d wrong, %d failed\n",
              sent, 2 * 65536, ok.load(), wrong.load(), failed.load());
  EXPECT_EQ(sent, 2 * 65536) << "the shard stopped taking messages";
  for (const auto& [name, pid] : (*cluster)->Processes()) {
    EXPECT_EQ(kill(pid, 0), 0) << name << " died";
  }
  EXPECT_GT(ok.load(), 3);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(failed.load(), 0);
  // Every process was given 127.0.0.1: each listens there and nowhere else (UCX's TCP
  // transport included; by default it listened on every interface).
  for (const auto& [name, pid] : (*cluster)->Processes()) {
    const auto sockets = testing::ListeningSockets(pid);
    EXPECT_FALSE(sockets.empty()) << name;
    for (const auto& socket : sockets)
      EXPECT_TRUE(socket.loopback) << name << " listens on " << socket.address;
  }
  auto after = testing::ClientFor(**cluster)->Forward(layer, x, kTokens, cfg.hidden);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(SameBits(after->out, want));
}

}  // namespace
}  // namespace moe
