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
#include <set>
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
#include "tests/common/metrics_text.h"
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
  const int sent = peer.SendEveryId(std::string(16, 'x'), std::string(70000, 'y'), 8192, 3,
                                    std::chrono::seconds(90));
  // And on the hello id (1) with a reply endpoint, the hellos the worker drops before the data
  // plane sees them: one of 257 bytes, one carrying data, one empty.
  constexpr unsigned kHelloId = 1;
  EXPECT_TRUE(peer.SendAm(kHelloId, true, std::string(257, 'h'), ""));
  EXPECT_TRUE(peer.SendAm(kHelloId, true, std::string(16, 'h'), std::string(100, 'd')));
  EXPECT_TRUE(peer.SendAm(kHelloId, true, "", ""));
  peer.Progress();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  canary.Stop();
  std::printf("[stray active messages] %d of %d sent; canary %d bit-exact, %d wrong, %d failed\n",
              sent, 2 * 65536, canary.ok(), canary.wrong(), canary.failed());
  EXPECT_EQ(sent, 2 * 65536) << "the shard stopped taking messages";
  // Every message reached the shard's worker and was dropped there, by kind (the exported
  // counter): all but the hello and the two batch ids as strays, the batch ids' four as batch
  // messages nobody expects.
  const std::string shard_metrics = a.cluster->shard_metrics(0);
  EXPECT_EQ(
      moe::testing::ScrapeSum(shard_metrics, "moe_ucx_messages_dropped_total", {"kind=\"stray\""}),
      2 * (65536 - 3));
  EXPECT_EQ(
      moe::testing::ScrapeSum(shard_metrics, "moe_ucx_messages_dropped_total", {"kind=\"batch\""}),
      4);
  // Every hello the shard was sent is a refused hello: the one with a reply endpoint that the
  // data plane refused (no such client), and the four the worker dropped as malformed (without
  // a reply endpoint, 257 bytes, with data, empty).
  EXPECT_EQ(
      moe::testing::ScrapeSum(shard_metrics, "moe_ucx_messages_dropped_total", {"kind=\"hello\""}),
      4);
  EXPECT_EQ(moe::testing::ScrapeSum(shard_metrics, "moe_expert_data_plane_events_total",
                                    {"event=\"hello_rejected\""}),
            5);
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

// The same against attention-svc, whose UCX address is published nowhere: the stranger of the
// report forges it. It takes its own TCP-only worker's address as a template (loopback only),
// finds its own listening port in it, puts the attention node's UCX listening port there (read
// from the kernel: any local user can, with `ss -ltn`), connects, and sends every id with and
// without the reply flag. No credential, no GetInfo. The attention node (every front of it) must
// stay up and its answers bit-exact.
TEST(ClusterDataPlane, AForgedAddressAndEveryIdLeaveTheAttentionNodeUp) {
  testing::AttackedCluster a = testing::StartAttackedCluster("tcp", 79);
  ASSERT_NE(a.cluster, nullptr);
  pid_t attention = 0;
  for (const auto& [name, pid] : a.cluster->Processes()) {
    if (name.find("attention") != std::string::npos) attention = pid;
  }
  ASSERT_NE(attention, 0);
  // Warm the cluster: the attention node's data plane is open to both shards.
  auto warm = testing::ClientFor(*a.cluster)->Forward(a.layer, a.x, a.kTokens, a.cfg.hidden);
  ASSERT_TRUE(warm.ok()) << warm.status();
  auto port_of = [](const std::string& endpoint) {
    return std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
  };
  const std::set<int> fronts = {port_of(a.cluster->attention_endpoint()),
                                port_of(a.cluster->attention_metrics()),
                                port_of(a.cluster->attention_http_endpoint())};
  std::vector<int> ucx_ports;
  for (const auto& sock : testing::ListeningSockets(attention)) {
    const int p = port_of(sock.address);
    if (fronts.count(p) == 0) ucx_ports.push_back(p);
  }
  ASSERT_FALSE(ucx_ports.empty()) << "the attention node has no UCX listening port";

  // The template: a worker of our own on loopback, and its listening port.
  const auto own_before = testing::ListeningSockets(getpid());
  moe::testing::RawUcpPeer templ("tcp", "lo");
  std::string forged = templ.Address();
  ASSERT_FALSE(forged.empty());
  int own_port = -1;
  for (const auto& sock : testing::ListeningSockets(getpid())) {
    bool existed = false;
    for (const auto& b : own_before) existed |= b.address == sock.address;
    if (!existed) own_port = port_of(sock.address);
  }
  ASSERT_GT(own_port, 0);
  const char be[2] = {static_cast<char>(own_port >> 8), static_cast<char>(own_port & 255)};
  const size_t at = forged.find(std::string(be, 2));
  ASSERT_NE(at, std::string::npos) << "the template address does not hold its port";
  ASSERT_EQ(forged.find(std::string(be, 2), at + 1), std::string::npos) << "the port twice";
  forged[at] = static_cast<char>(ucx_ports[0] >> 8);
  forged[at + 1] = static_cast<char>(ucx_ports[0] & 255);

  testing::Canary canary(*a.cluster, a.layer, a.x, a.kTokens, a.cfg.hidden, a.want);
  moe::testing::RawUcpPeer peer("tcp", "lo");
  ASSERT_TRUE(peer.Connect(forged));
  const int sent = peer.SendEveryId(std::string(16, 'x'), std::string(70000, 'y'), 8192, 3,
                                    std::chrono::seconds(90));
  peer.Progress();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  canary.Stop();
  std::printf(
      "[forged address] attention UCX port %d; %d of %d sent; canary %d bit-exact, %d wrong, %d "
      "failed\n",
      ucx_ports[0], sent, 2 * 65536, canary.ok(), canary.wrong(), canary.failed());
  EXPECT_EQ(sent, 2 * 65536) << "the attention node stopped taking messages";
  // They reached the attention node's worker (the forged address works) and were dropped there.
  const std::string m = a.cluster->attention_metrics();
  EXPECT_EQ(moe::testing::ScrapeSum(m, "moe_ucx_messages_dropped_total", {"kind=\"stray\""}),
            2 * (65536 - 3));
  EXPECT_EQ(moe::testing::ScrapeSum(m, "moe_ucx_messages_dropped_total", {"kind=\"hello\""}), 2);
  EXPECT_EQ(moe::testing::ScrapeSum(m, "moe_ucx_messages_dropped_total", {"kind=\"batch\""}), 4);
  for (const auto& [name, pid] : a.cluster->Processes()) {
    EXPECT_EQ(kill(pid, 0), 0) << name << " died";
  }
  EXPECT_GT(canary.ok(), 3);
  EXPECT_EQ(canary.wrong(), 0);
  EXPECT_EQ(canary.failed(), 0);
  auto after = testing::ClientFor(*a.cluster)->Forward(a.layer, a.x, a.kTokens, a.cfg.hidden);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(SameBits(after->out, a.want));
}

}  // namespace
}  // namespace moe
