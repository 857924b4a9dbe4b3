// Several routers on a real etcd (Debian etcd-server, started here on loopback): one leads, the
// other is a standby (NOT_SERVING, every call UNAVAILABLE); a kill -9 of the leader makes the
// standby take over within the lease's TTL with nothing lost: the bias version and its history,
// the mode, the registrations with their leases.
#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "moe/v1/router.grpc.pb.h"
#include "router-svc/etcd_store.h"
#include "services/transport/channel.h"
#include "services/transport/health_check.h"
#include "tests/services/cluster_fixtures.h"

extern char** environ;

namespace moe {
namespace {

using testing::CheckpointFor;
using testing::ClientFor;
using testing::MakeTempDir;
using testing::TestCluster;
using tools::LocalCluster;
using tools::LocalClusterOptions;

// A child process (killed with SIGKILL when the test ends).
struct Child {
  pid_t pid = -1;
  ~Child() { Kill(); }
  void Kill() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      pid = -1;
    }
  }
};

bool Spawn(const std::vector<std::string>& args, const std::string& log, Child* c) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const int rc = posix_spawn(&c->pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  return rc == 0;
}

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

int ReadPort(const std::string& file) {
  for (int i = 0; i < 200; ++i) {  // 20 s
    std::ifstream f(file);
    int port = 0;
    if (f >> port && port > 0) return port;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return 0;
}

TEST(ClusterEtcd, TheStandbyTakesOverFromAKilledLeaderWithTheState) {
  if (::access("/usr/bin/etcd", X_OK) != 0) {
    GTEST_SKIP() << "no /usr/bin/etcd (Debian etcd-server; scripts/setup.sh installs it)";
  }
  const std::string work = MakeTempDir("etcd");
  const int client_port = FreePort(), peer_port = FreePort();
  const std::string etcd = absl::StrCat("127.0.0.1:", client_port);
  Child etcd_proc;
  ASSERT_TRUE(Spawn({"/usr/bin/etcd", "--data-dir", work + "/etcd", "--listen-client-urls",
                     "http://" + etcd, "--advertise-client-urls", "http://" + etcd,
                     "--listen-peer-urls", absl::StrCat("http://127.0.0.1:", peer_port),
                     "--initial-advertise-peer-urls", absl::StrCat("http://127.0.0.1:", peer_port),
                     "--initial-cluster", absl::StrCat("default=http://127.0.0.1:", peer_port)},
                    work + "/etcd.log", &etcd_proc));
  bool up = false;
  for (int i = 0; i < 100 && !up; ++i) {  // 10 s
    up = router_svc::EtcdStore::Connect(etcd, "/probe").ok();
    if (!up) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(up) << "etcd did not come up (" << work << "/etcd.log)";
  {  // Writes are fenced: a store that does not lead cannot write.
    auto store = router_svc::EtcdStore::Connect(etcd, "/moe/test");
    ASSERT_TRUE(store.ok());
    router_svc::BiasVersion v;
    v.layer = 1;
    const absl::Status s = (*store)->PutBiasVersion(v);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  }

  const std::string& dir = CheckpointFor("tiny");
  {  // An empty prefix is not a new cluster unless asked: the elected router exits, saying why.
    Child lone;
    ASSERT_TRUE(Spawn({MOE_BIN_DIR "/router-svc", "--checkpoint=" + dir, "--port=0",
                       "--metrics_port=-1", "--web_port=-1", "--etcd=" + etcd,
                       "--etcd_prefix=/moe/never-initialized", "--name=router-lone"},
                      work + "/router-lone.log", &lone));
    int status = 0;
    pid_t done = 0;
    for (int i = 0; i < 150 && done == 0; ++i) {  // bounded: 15 s
      done = ::waitpid(lone.pid, &status, WNOHANG);
      if (done == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ASSERT_EQ(done, lone.pid) << "router-svc served an empty etcd prefix";
    lone.pid = -1;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << status;
    std::ifstream f(work + "/router-lone.log");
    const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_NE(log.find("/moe/never-initialized is empty: refusing to start a new cluster's state"),
              std::string::npos)
        << log;
  }

  // The cluster with router-a on etcd (its first start: --initialize); router-b joins as a
  // standby.
  LocalClusterOptions o = TestCluster(dir, {{0, 8}, {8, 16}});
  o.work_dir = work;
  o.admin_token = "etcd-admin";
  const std::vector<std::string> on_etcd = {"--etcd=" + etcd, "--etcd_prefix=/moe/test"};
  o.router_args =
      testing::Concat(on_etcd, {"--name=router-a", "--heartbeat_interval_ms=200", "--initialize"});
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Child b;
  ASSERT_TRUE(
      Spawn(testing::Concat({MOE_BIN_DIR "/router-svc", "--checkpoint=" + dir, "--port=0",
                             "--port_file=" + work + "/router-b.port", "--metrics_port=-1",
                             "--web_port=-1", "--name=router-b", "--heartbeat_interval_ms=200",
                             "--cluster_token_file=" + work + "/cluster_token",
                             "--admin_token_file=" + work + "/admin_token"},
                            on_etcd),
            work + "/router-b.log", &b));
  const int b_port = ReadPort(work + "/router-b.port");
  ASSERT_GT(b_port, 0);
  const std::string b_endpoint = absl::StrCat("127.0.0.1:", b_port);
  auto b_ready = [&] { return transport::CheckHealth(b_endpoint, absl::Seconds(1)); };
  auto serving = b_ready();
  ASSERT_TRUE(serving.ok()) << serving.status();
  EXPECT_FALSE(*serving) << "a standby must not be ready";
  client::ClientOptions to_b;
  to_b.router = b_endpoint;
  to_b.admin_token = o.admin_token;
  to_b.timeout = absl::Seconds(5);
  auto via_b = client::MoeClient::Create(to_b);
  ASSERT_TRUE(via_b.ok());
  auto refused = (*via_b)->GetBias(1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(refused.status().message().find("standby"), absl::string_view::npos)
      << refused.status();

  // State worth keeping, made at the leader.
  auto admin = ClientFor(**cluster, o.admin_token);
  auto v1 = admin->RollbackBias(1, 0);
  ASSERT_TRUE(v1.ok()) << v1.status();
  ASSERT_EQ(v1->version(), 1u);
  auto mode = admin->SetBiasMode(1, v1::BIAS_MODE_CONTINUOUS, 7000);
  ASSERT_TRUE(mode.ok()) << mode.status();

  ASSERT_TRUE((*cluster)->SignalRouter(SIGKILL).ok());
  const absl::Time killed = absl::Now();
  bool took_over = false;
  for (int i = 0; i < 150 && !took_over; ++i) {  // 15 s; the lease's TTL is 3 s
    auto s = b_ready();
    took_over = s.ok() && *s;
    if (!took_over) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(took_over) << "router-b never led (" << work << "/router-b.log)";
  std::printf("[etcd] router-b leads %.1f s after the kill of router-a\n",
              absl::ToDoubleSeconds(absl::Now() - killed));
  auto bias = (*via_b)->GetBias(1);
  ASSERT_TRUE(bias.ok()) << bias.status();
  EXPECT_EQ(bias->version(), 1u);
  EXPECT_EQ(bias->reason(), "rollback to 0");
  EXPECT_EQ(bias->mode(), v1::BIAS_MODE_CONTINUOUS);
  auto stats = (*via_b)->GetLoadStats(1);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->history_size(), 2);
  // The registrations came over too.
  auto stub = v1::RouterService::NewStub(transport::MakeChannel(b_endpoint));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::Placement p;
  ASSERT_TRUE(stub->GetPlacement(&ctx, v1::GetPlacementRequest(), &p).ok());
  std::vector<std::string> shards;
  for (const auto& s : p.shards()) shards.push_back(s.shard());
  EXPECT_EQ(shards, (std::vector<std::string>{"shard-0", "shard-1"}));
  // And the new leader writes: a new version continues the numbering.
  auto v2 = (*via_b)->RollbackBias(1, 0);
  ASSERT_TRUE(v2.ok()) << v2.status();
  EXPECT_EQ(v2->version(), 2u);
}

}  // namespace
}  // namespace moe
