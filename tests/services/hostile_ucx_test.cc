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
#include <memory>
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
#include "tests/services/cluster_test_base.h"
#include "tests/services/hostile_fixtures.h"

namespace moe {
namespace {

using tensor::Bf16;

int PortOf(const std::string& endpoint) {
  return std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
}

class ClusterUcxStranger : public testing::AttackedClusterTest {
 protected:
  // Every message reached the process's worker and was dropped there, by kind (the exported
  // counter): all but the hello and the two batch ids as strays, the batch ids' four as batch
  // messages nobody expects, and `hellos` malformed hellos.
  void ExpectDroppedByKind(const std::string& endpoint, double hellos) {
    EXPECT_EQ(testing::ScrapeSum(endpoint, "moe_ucx_messages_dropped_total", {"kind=\"stray\""}),
              2 * (65536 - 3));
    EXPECT_EQ(testing::ScrapeSum(endpoint, "moe_ucx_messages_dropped_total", {"kind=\"batch\""}),
              4);
    EXPECT_EQ(testing::ScrapeSum(endpoint, "moe_ucx_messages_dropped_total", {"kind=\"hello\""}),
              hellos);
  }

  // Every process was given 127.0.0.1: each listens there and nowhere else (UCX's TCP
  // transport included; by default it listened on every interface).
  void ExpectOnlyLoopbackListeners() {
    for (const auto& [name, pid] : cluster().Processes()) {
      const auto sockets = testing::ListeningSockets(pid);
      EXPECT_FALSE(sockets.empty()) << name;
      for (const auto& socket : sockets)
        EXPECT_TRUE(socket.loopback) << name << " listens on " << socket.address;
    }
  }

  // The attention node's UCX listening port: the one that is none of its fronts (read from the
  // kernel, as any local user can with `ss -ltn`).
  int AttentionUcxPort() {
    pid_t attention = 0;
    for (const auto& [name, pid] : cluster().Processes()) {
      if (name.find("attention") != std::string::npos) attention = pid;
    }
    EXPECT_NE(attention, 0);
    const std::set<int> fronts = {PortOf(cluster().attention_endpoint()),
                                  PortOf(cluster().attention_metrics()),
                                  PortOf(cluster().attention_http_endpoint())};
    for (const auto& sock : testing::ListeningSockets(attention)) {
      if (fronts.count(PortOf(sock.address)) == 0) return PortOf(sock.address);
    }
    return -1;
  }

  // A UCX address for `port` forged from a template: a worker of our own on loopback (kept in
  // *templ), whose own listening port is found in its address and replaced. Empty when the
  // template does not hold its port exactly once.
  static std::string ForgeAddress(int port, std::unique_ptr<testing::RawUcpPeer>* templ) {
    const auto own_before = testing::ListeningSockets(getpid());
    *templ = std::make_unique<testing::RawUcpPeer>("tcp", "lo");
    std::string forged = (*templ)->Address();
    int own_port = -1;
    for (const auto& sock : testing::ListeningSockets(getpid())) {
      bool existed = false;
      for (const auto& b : own_before) existed |= b.address == sock.address;
      if (!existed) own_port = PortOf(sock.address);
    }
    if (forged.empty() || own_port <= 0) return "";
    const char be[2] = {static_cast<char>(own_port >> 8), static_cast<char>(own_port & 255)};
    const size_t at = forged.find(std::string(be, 2));
    if (at == std::string::npos || forged.find(std::string(be, 2), at + 1) != std::string::npos) {
      return "";
    }
    forged[at] = static_cast<char>(port >> 8);
    forged[at + 1] = static_cast<char>(port & 255);
    return forged;
  }
};

TEST_F(ClusterUcxStranger, EveryActiveMessageIdFromAStrangerLeavesEveryProcessUp) {
  ASSERT_NO_FATAL_FAILURE(StartAttackedCluster("tcp", 78));
  const std::string address = testing::ShardUcxAddress(cluster(), 0);
  ASSERT_FALSE(address.empty());
  auto canary = StartCanary();

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
  canary->Stop();
  std::printf("[stray active messages] %d of %d sent; canary %d bit-exact, %d wrong, %d failed\n",
              sent, 2 * 65536, canary->ok(), canary->wrong(), canary->failed());
  EXPECT_EQ(sent, 2 * 65536) << "the shard stopped taking messages";
  // Every hello the shard was sent is a refused hello: the one with a reply endpoint that the
  // data plane refused (no such client), and the four the worker dropped as malformed (without
  // a reply endpoint, 257 bytes, with data, empty).
  const std::string shard_metrics = cluster().shard_metrics(0);
  ExpectDroppedByKind(shard_metrics, 4);
  EXPECT_EQ(testing::ScrapeSum(shard_metrics, "moe_expert_data_plane_events_total",
                               {"event=\"hello_rejected\""}),
            5);
  ExpectCleanCanary(*canary, 3);
  ExpectOnlyLoopbackListeners();
  ExpectEveryProcessUpAndServing();
}

// The same against attention-svc, whose UCX address is published nowhere: the stranger of the
// report forges it. It takes its own TCP-only worker's address as a template (loopback only),
// finds its own listening port in it, puts the attention node's UCX listening port there (read
// from the kernel: any local user can, with `ss -ltn`), connects, and sends every id with and
// without the reply flag. No credential, no GetInfo. The attention node (every front of it) must
// stay up and its answers bit-exact.
TEST_F(ClusterUcxStranger, AForgedAddressAndEveryIdLeaveTheAttentionNodeUp) {
  ASSERT_NO_FATAL_FAILURE(StartAttackedCluster("tcp", 79));
  // Warm the cluster: the attention node's data plane is open to both shards.
  ASSERT_TRUE(Forward(x_, kTokens).ok());
  const int ucx_port = AttentionUcxPort();
  ASSERT_GT(ucx_port, 0) << "the attention node has no UCX listening port";
  std::unique_ptr<testing::RawUcpPeer> templ;
  const std::string forged = ForgeAddress(ucx_port, &templ);
  ASSERT_FALSE(forged.empty()) << "the template address does not hold its port once";

  auto canary = StartCanary();
  moe::testing::RawUcpPeer peer("tcp", "lo");
  ASSERT_TRUE(peer.Connect(forged));
  const int sent = peer.SendEveryId(std::string(16, 'x'), std::string(70000, 'y'), 8192, 3,
                                    std::chrono::seconds(90));
  peer.Progress();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  canary->Stop();
  std::printf(
      "[forged address] attention UCX port %d; %d of %d sent; canary %d bit-exact, %d wrong, %d "
      "failed\n",
      ucx_port, sent, 2 * 65536, canary->ok(), canary->wrong(), canary->failed());
  EXPECT_EQ(sent, 2 * 65536) << "the attention node stopped taking messages";
  // They reached the attention node's worker (the forged address works) and were dropped there.
  ExpectDroppedByKind(cluster().attention_metrics(), 2);
  ExpectCleanCanary(*canary, 3);
  ExpectEveryProcessUpAndServing();
}

}  // namespace
}  // namespace moe
