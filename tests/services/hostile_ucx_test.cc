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
#include "tests/services/hostile_fixtures.h"

namespace moe {
namespace {

using tensor::Bf16;
using testing::SameBits;

TEST(ClusterDataPlane, EveryActiveMessageIdFromAStrangerLeavesEveryProcessUp) {
  testing::AttackedCluster a = testing::StartAttackedCluster("tcp", 78);
  ASSERT_NE(a.cluster, nullptr);

  const std::string address = testing::ShardUcxAddress(*a.cluster, 0);
  ASSERT_FALSE(address.empty());
  testing::Canary canary(*a.cluster, a.layer, a.x, a.kTokens, a.cfg.hidden, a.want);

  moe::testing::RawUcpPeer peer("tcp");
  ASSERT_TRUE(peer.Connect(address));
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
  canary.Stop();
  std::printf("[stray active messages] %d of %d sent; canary %d bit-exact, %d wrong, %d failed\n",
              sent, 2 * 65536, canary.ok(), canary.wrong(), canary.failed());
  EXPECT_EQ(sent, 2 * 65536) << "the shard stopped taking messages";
  for (const auto& [name, pid] : a.cluster->Processes()) {
    EXPECT_EQ(kill(pid, 0), 0) << name << " died";
  }
  EXPECT_GT(canary.ok(), 3);
  EXPECT_EQ(canary.wrong(), 0);
  EXPECT_EQ(canary.failed(), 0);
  // Every process was given 127.0.0.1: each listens there and nowhere else (UCX's TCP
  // transport included; by default it listened on every interface).
  for (const auto& [name, pid] : a.cluster->Processes()) {
    const auto sockets = testing::ListeningSockets(pid);
    EXPECT_FALSE(sockets.empty()) << name;
    for (const auto& socket : sockets)
      EXPECT_TRUE(socket.loopback) << name << " listens on " << socket.address;
  }
  auto after = testing::ClientFor(*a.cluster)->Forward(a.layer, a.x, a.kTokens, a.cfg.hidden);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(SameBits(after->out, a.want));
}

}  // namespace
}  // namespace moe
