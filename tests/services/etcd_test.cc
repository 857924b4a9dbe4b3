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
#include <memory>
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
#include "tests/services/cluster_test_base.h"

extern char** environ;

namespace moe {
namespace {

using testing::MakeTempDir;

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

// A real etcd on loopback, a cluster whose router-a leads on it, and router-b as its standby.
class ClusterEtcd : public testing::ClusterTest {
 protected:
  void StartEtcd() {
    work_ = MakeTempDir("etcd");
    const int client_port = FreePort(), peer_port = FreePort();
    etcd_ = absl::StrCat("127.0.0.1:", client_port);
    const std::string peer = absl::StrCat("http://127.0.0.1:", peer_port);
    ASSERT_TRUE(Spawn(
        {"/usr/bin/etcd", "--data-dir", work_ + "/etcd", "--listen-client-urls", "http://" + etcd_,
         "--advertise-client-urls", "http://" + etcd_, "--listen-peer-urls", peer,
         "--initial-advertise-peer-urls", peer, "--initial-cluster", "default=" + peer},
        work_ + "/etcd.log", &etcd_proc_));
    bool up = false;
    for (int i = 0; i < 100 && !up; ++i) {  // 10 s
      up = router_svc::EtcdStore::Connect(etcd_, "/probe").ok();
      if (!up) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ASSERT_TRUE(up) << "etcd did not come up (" << work_ << "/etcd.log)";
  }

  // An empty prefix is not a new cluster unless asked: the elected router exits, saying why.
  void ExpectAnEmptyPrefixRefused() {
    Child lone;
    ASSERT_TRUE(Spawn({MOE_BIN_DIR "/router-svc", "--checkpoint=" + checkpoint_dir(), "--port=0",
                       "--metrics_port=-1", "--web_port=-1", "--etcd=" + etcd_,
                       "--etcd_prefix=/moe/never-initialized", "--name=router-lone"},
                      work_ + "/router-lone.log", &lone));
    int status = 0;
    pid_t done = 0;
    for (int i = 0; i < 150 && done == 0; ++i) {  // bounded: 15 s
      done = ::waitpid(lone.pid, &status, WNOHANG);
      if (done == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ASSERT_EQ(done, lone.pid) << "router-svc served an empty etcd prefix";
    lone.pid = -1;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << status;
    std::ifstream f(work_ + "/router-lone.log");
    const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_NE(log.find("/moe/never-initialized is empty: refusing to start a new cluster's state"),
              std::string::npos)
        << log;
  }

  // router-b joins as a standby: not ready, and its admin calls refused naming it.
  void StartStandby() {
    ASSERT_TRUE(Spawn(
        testing::Concat({MOE_BIN_DIR "/router-svc", "--checkpoint=" + checkpoint_dir(), "--port=0",
                         "--port_file=" + work_ + "/router-b.port", "--metrics_port=-1",
                         "--web_port=-1", "--name=router-b", "--heartbeat_interval_ms=200",
                         "--cluster_token_file=" + work_ + "/cluster_token",
                         "--admin_token_file=" + work_ + "/admin_token"},
                        OnEtcd()),
        work_ + "/router-b.log", &b_));
    const int b_port = ReadPort(work_ + "/router-b.port");
    ASSERT_GT(b_port, 0);
    b_endpoint_ = absl::StrCat("127.0.0.1:", b_port);
    auto serving = BReady();
    ASSERT_TRUE(serving.ok()) << serving.status();
    EXPECT_FALSE(*serving) << "a standby must not be ready";
    client::ClientOptions to_b;
    to_b.router = b_endpoint_;
    to_b.admin_token = options().admin_token;
    to_b.timeout = absl::Seconds(5);
    auto via_b = client::MoeClient::Create(to_b);
    ASSERT_TRUE(via_b.ok());
    via_b_ = std::move(*via_b);
    auto refused = via_b_->GetBias(1);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_NE(refused.status().message().find("standby"), absl::string_view::npos)
        << refused.status();
  }

  std::vector<std::string> OnEtcd() const { return {"--etcd=" + etcd_, "--etcd_prefix=/moe/test"}; }
  absl::StatusOr<bool> BReady() { return transport::CheckHealth(b_endpoint_, absl::Seconds(1)); }

  // The shards registered with router-a, as router-b now lists them.
  std::vector<std::string> ShardsAtB() {
    auto stub = v1::RouterService::NewStub(transport::MakeChannel(b_endpoint_));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::Placement p;
    EXPECT_TRUE(stub->GetPlacement(&ctx, v1::GetPlacementRequest(), &p).ok());
    std::vector<std::string> shards;
    for (const auto& s : p.shards()) shards.push_back(s.shard());
    return shards;
  }

  std::string work_, etcd_, b_endpoint_;
  Child etcd_proc_, b_;
  std::unique_ptr<client::MoeClient> via_b_;
};

TEST_F(ClusterEtcd, TheStandbyTakesOverFromAKilledLeaderWithTheState) {
  if (::access("/usr/bin/etcd", X_OK) != 0) {
    GTEST_SKIP() << "no /usr/bin/etcd (Debian etcd-server; scripts/setup.sh installs it)";
  }
  ASSERT_NO_FATAL_FAILURE(StartEtcd());
  {  // Writes are fenced: a store that does not lead cannot write.
    auto store = router_svc::EtcdStore::Connect(etcd_, "/moe/test");
    ASSERT_TRUE(store.ok());
    router_svc::BiasVersion v;
    v.layer = 1;
    const absl::Status s = (*store)->PutBiasVersion(v);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  }
  UsePreset("tiny", {{0, 8}, {8, 16}});
  ASSERT_NO_FATAL_FAILURE(ExpectAnEmptyPrefixRefused());
  // The cluster with router-a on etcd (its first start: --initialize).
  options().work_dir = work_;
  options().admin_token = "etcd-admin";
  options().router_args =
      testing::Concat(OnEtcd(), {"--name=router-a", "--heartbeat_interval_ms=200", "--initialize"});
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  ASSERT_NO_FATAL_FAILURE(StartStandby());

  // State worth keeping, made at the leader.
  auto v1 = admin().RollbackBias(1, 0);
  ASSERT_TRUE(v1.ok()) << v1.status();
  ASSERT_EQ(v1->version(), 1u);
  ASSERT_TRUE(admin().SetBiasMode(1, v1::BIAS_MODE_CONTINUOUS, 7000).ok());

  ASSERT_TRUE(cluster().SignalRouter(SIGKILL).ok());
  const absl::Time killed = absl::Now();
  bool took_over = false;
  for (int i = 0; i < 150 && !took_over; ++i) {  // 15 s; the lease's TTL is 3 s
    auto s = BReady();
    took_over = s.ok() && *s;
    if (!took_over) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(took_over) << "router-b never led (" << work_ << "/router-b.log)";
  std::printf("[etcd] router-b leads %.1f s after the kill of router-a\n",
              absl::ToDoubleSeconds(absl::Now() - killed));
  auto bias = via_b_->GetBias(1);
  ASSERT_TRUE(bias.ok()) << bias.status();
  EXPECT_EQ(bias->version(), 1u);
  EXPECT_EQ(bias->reason(), "rollback to 0");
  EXPECT_EQ(bias->mode(), v1::BIAS_MODE_CONTINUOUS);
  auto stats = via_b_->GetLoadStats(1);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->history_size(), 2);
  // The registrations came over too.
  EXPECT_EQ(ShardsAtB(), (std::vector<std::string>{"shard-0", "shard-1"}));
  // And the new leader writes: a new version continues the numbering.
  auto v2 = via_b_->RollbackBias(1, 0);
  ASSERT_TRUE(v2.ok()) << v2.status();
  EXPECT_EQ(v2->version(), 2u);
}

}  // namespace
}  // namespace moe
