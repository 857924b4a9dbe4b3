// The control-plane client against a real router-svc in this process: registration and
// heartbeats seen through another link's placement watch, the bias watch, errors carried back,
// a prompt Stop() with open watches, and registration again after a router restart.
#include "services/client/router_link.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "gtest/gtest.h"
#include "router-svc/router_server.h"
#include "services/checkpoint/synthetic.h"
#include "services/transport/security.h"
#include "tests/common/tiny_checkpoint.h"

namespace moe::client {
namespace {

using moe::testing::TinyCheckpoint;

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

constexpr char kMember[] = "member-token";

std::unique_ptr<router_svc::RouterServer> StartRouter(int port) {
  router_svc::RouterServerOptions o;
  o.checkpoint = TinyCheckpoint();
  o.port = port;
  o.heartbeat_interval_ms = 100;
  o.cluster_token = kMember;
  auto r = router_svc::RouterServer::Start(o);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? std::move(*r) : nullptr;
}

// Polls cond every 20 ms for at most `limit`.
bool Eventually(const std::function<bool()>& cond, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return cond();
}

v1::RegisterExpertServerRequest Registration() {
  v1::RegisterExpertServerRequest req;
  req.set_shard("shard-x");
  req.set_endpoint("127.0.0.1:1");
  v1::ExpertRange* r = req.add_ranges();
  r->set_layer(1);
  r->set_expert_lo(0);
  r->set_expert_hi(16);
  return req;
}

TEST(RouterLink, RegistersWatchesReportsAndStopsPromptly) {
  const int port = FreePort();
  auto router = StartRouter(port);
  ASSERT_NE(router, nullptr);
  const std::string endpoint = "127.0.0.1:" + std::to_string(port);
  RouterLink expert(endpoint, {}, transport::ExpertMemberToken(kMember, "shard-x")),
      attention(endpoint, {}, transport::MemberRoleToken(kMember, "attention"));
  std::mutex mu;
  bool placed = false;
  uint64_t bias_version = 99;
  attention.WatchPlacement([&](const v1::Placement& p) {
    std::lock_guard<std::mutex> lock(mu);
    for (const v1::ShardInfo& s : p.shards()) placed |= s.shard() == "shard-x" && s.healthy();
  });
  attention.WatchBias({1}, [&](const v1::LayerBias& b) {
    std::lock_guard<std::mutex> lock(mu);
    bias_version = b.version();
  });
  std::atomic<int> queued_calls{0};
  expert.KeepRegistered(Registration(), [&] { return int64_t{++queued_calls}; });
  EXPECT_TRUE(Eventually(
      [&] {
        std::lock_guard<std::mutex> lock(mu);
        return placed && bias_version == 0;
      },
      std::chrono::milliseconds(5000)));
  // The router publishes the placement before the expert's link has read its registration's
  // reply, so the lease may arrive a moment after the watch saw the shard (a CI run read 0).
  EXPECT_TRUE(Eventually([&] { return expert.lease() > 0u; }, std::chrono::milliseconds(5000)));
  EXPECT_TRUE(Eventually([&] { return queued_calls > 2; }, std::chrono::milliseconds(5000)))
      << "heartbeats carry the queue length";
  // An error comes back as a status, with the router's message.
  v1::ReportStatsRequest bad;
  bad.set_layer(1);
  bad.add_loads(1);
  auto r = attention.ReportStats(bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("1 loads, layer 1 has 16 experts"), absl::string_view::npos)
      << r.status();
  // Stop ends open watches at once.
  const auto t0 = std::chrono::steady_clock::now();
  attention.Stop();
  expert.Stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  router->Shutdown();
}

TEST(RouterLink, RegistersAgainAfterARouterRestart) {
  const int port = FreePort();
  auto router = StartRouter(port);
  ASSERT_NE(router, nullptr);
  RouterLink expert("127.0.0.1:" + std::to_string(port), {},
                    transport::ExpertMemberToken(kMember, "shard-x"));
  expert.KeepRegistered(Registration(), nullptr);
  ASSERT_TRUE(Eventually([&] { return expert.lease() > 0; }, std::chrono::milliseconds(5000)));
  router->Shutdown();
  router.reset();
  router = StartRouter(port);  // knows no lease
  ASSERT_NE(router, nullptr);
  RouterLink watcher("127.0.0.1:" + std::to_string(port));
  std::atomic<bool> placed{false};
  watcher.WatchPlacement([&](const v1::Placement& p) {
    for (const v1::ShardInfo& s : p.shards()) {
      if (s.shard() == "shard-x" && s.healthy()) placed = true;
    }
  });
  EXPECT_TRUE(Eventually([&] { return placed.load(); }, std::chrono::milliseconds(8000)))
      << "the shard never registered with the new router";
  watcher.Stop();
  expert.Stop();
  router->Shutdown();
}

}  // namespace
}  // namespace moe::client
