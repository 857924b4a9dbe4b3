// --data_plane=auto, the default (services/dataplane/data_plane.h): a shard offers UCX and shm,
// and a node uses, per shard, shm where it reaches the shard's socket (one host and network
// namespace, the same user) and UCX otherwise, through the real expert server. The cases a node
// meets: a shard on its host (shm), a shard that offers only UCX (a shard of the previous
// release, or --data_plane=ucx), a shard whose socket is not in this namespace (another pod), and
// a socket held by another user (a squatter); each answers bit-exact on the lane it should,
// nothing goes in band, and the node asks a shard without shm again only after its back-off.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention-svc/dataplane/registry.h"
#include "attention-svc/dataplane/shm/shm_client_half.h"
#include "attention-svc/expert_channel_factory.h"
#include "moe/v1/expert.grpc.pb.h"
#include "services/dataplane/data_plane.h"
#include "services/dataplane/ucx_worker.h"
#include "services/transport/channel.h"
#include "tests/common/backend_shard.h"
#include "tests/common/echo_shard.h"
#include "tests/common/metrics_text.h"

namespace moe {
namespace {

using C = absl::StatusCode;
using testing::BackendShard;
using testing::WrongEchoRows;

// The node's halves under auto (shm, then UCX) and a channel to one shard through them, as
// ExpertLinks makes it; the events the channels count.
struct AutoNode {
  std::vector<std::unique_ptr<attention_svc::ClientHalf>> halves;
  std::vector<std::string> events;
  std::string lanes;
  std::mutex mu;

  AutoNode() {
    for (const std::string& b : dataplane::DataPlane{}.backends()) {
      auto h = attention_svc::StartClientHalf(b, {});
      EXPECT_TRUE(h.ok()) << b << ": " << h.status();
      if (h.ok()) halves.push_back(std::move(*h));
    }
  }
  std::shared_ptr<attention_svc::ExpertChannel> ChannelTo(const std::string& endpoint) {
    attention_svc::ExpertChannelConfig c;
    c.node = "attention-auto";
    c.max_message_bytes = 1 << 30;
    for (const auto& h : halves) c.data_planes.push_back(h.get());
    c.on_event = [this](const std::string&, const std::string& e) {
      std::lock_guard<std::mutex> l(mu);
      events.push_back(e);
    };
    c.on_lanes = [this](const std::string&, const dataplane::Lanes& l, const std::string&) {
      std::lock_guard<std::mutex> g(mu);
      lanes = l.kind;
    };
    return attention_svc::MakeExpertChannel(c, {"echo-0", endpoint, 0, 8, true, 0});
  }
};

// Batches of 1, 16 and 200 tokens on `ch`: each bit-exact (against the in-band lane too) on
// `lane`.
void ExpectServedOn(attention_svc::ExpertChannel& ch, const std::string& endpoint,
                    const char* lane) {
  testing::ExpectServedBitExactOn(ch, *PresetConfig("mid"), endpoint, lane, {1, 16, 200});
}

absl::StatusOr<v1::OpenDataPlaneReply> Open(const std::string& endpoint,
                                            const std::string& transport) {
  auto stub = v1::ExpertService::NewStub(transport::MakeChannel(endpoint));
  grpc::ClientContext ctx;
  v1::OpenDataPlaneRequest req;
  req.set_node("raw");
  req.set_transport(transport);
  v1::OpenDataPlaneReply reply;
  const grpc::Status s = stub->OpenDataPlane(&ctx, req, &reply);
  if (!s.ok()) return absl::Status(static_cast<C>(s.error_code()), s.error_message());
  return reply;
}

double RefusedOpens(const BackendShard& s) {
  return testing::ScrapeSum(s.metrics, "moe_errors_total",
                            {"method=\"OpenDataPlane\"", "code=\"FAILED_PRECONDITION\""});
}
double WireBytes(const BackendShard& s, const std::string& lane) {
  return testing::ScrapeSum(s.metrics, "moe_wire_bytes_total", {"transport=\"" + lane + "\""});
}

TEST(AutoDataPlane, AShardOffersBothAndANodeOnItsHostUsesShm) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  const ModelConfig cfg = *PresetConfig("mid");
  BackendShard shard = testing::StartBackendShard(cfg, "auto");
  // What it says: UCX first (what it registers, what callers that name no backend get).
  auto stub = v1::ExpertService::NewStub(transport::MakeChannel(shard.endpoint));
  grpc::ClientContext ctx;
  v1::ExpertServerInfo info;
  ASSERT_TRUE(stub->GetInfo(&ctx, v1::GetExpertInfoRequest(), &info).ok());
  EXPECT_EQ(info.data_plane(), "ucx");
  EXPECT_EQ(std::vector<std::string>(info.data_planes().begin(), info.data_planes().end()),
            (std::vector<std::string>{"ucx", "shm"}));
  EXPECT_EQ(Open(shard.endpoint, "")->transport(), "ucx") << "a caller of before the field";
  EXPECT_EQ(Open(shard.endpoint, "shm")->transport(), "shm");
  EXPECT_EQ(Open(shard.endpoint, "ucx")->transport(), "ucx");
  auto other = Open(shard.endpoint, "rdma9");
  EXPECT_EQ(other.status().code(), C::kFailedPrecondition);
  EXPECT_NE(
      other.status().message().find("does not offer the rdma9 data plane (it offers ucx, shm"),
      std::string::npos)
      << other.status();

  AutoNode node;
  std::shared_ptr<attention_svc::ExpertChannel> ch = node.ChannelTo(shard.endpoint);
  ASSERT_NO_FATAL_FAILURE(ExpectServedOn(*ch, shard.endpoint, "shm"));
  EXPECT_EQ(node.events, std::vector<std::string>{"connected"}) << "nothing in band, once";
  EXPECT_EQ(node.lanes, "shm");
  EXPECT_GT(WireBytes(shard, "shm"), 0);
  EXPECT_EQ(WireBytes(shard, "ucx"), 0);
  // A batch larger than half a ring goes to the next backend (UCX), not in band.
  const int64_t big_t = attention_svc::kShmClientRing / 2 / (cfg.top_k * cfg.latent * 2) + 1;
  const testing::EchoBatch big = testing::MakeEchoBatch(cfg, big_t);
  auto call = ch->Send(big.header, big.message);
  auto r = call->Wait(absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_STREQ(call->transport(), "ucx");
  EXPECT_EQ(WrongEchoRows(big, *r, cfg.latent), 0u);
  EXPECT_GT(WireBytes(shard, "ucx"), 0);
  EXPECT_EQ(std::count(node.events.begin(), node.events.end(), "fallback"), 0);
}

TEST(AutoDataPlane, AShardThatOffersOnlyUcxIsServedOnUcxAndAskedAgainOnlyAfterTheBackOff) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  const ModelConfig cfg = *PresetConfig("mid");
  BackendShard shard = testing::StartBackendShard(cfg, "ucx");
  AutoNode node;
  std::shared_ptr<attention_svc::ExpertChannel> ch = node.ChannelTo(shard.endpoint);
  ASSERT_NO_FATAL_FAILURE(ExpectServedOn(*ch, shard.endpoint, "ucx"));
  ASSERT_NO_FATAL_FAILURE(ExpectServedOn(*ch, shard.endpoint, "ucx"));
  EXPECT_EQ(node.events, std::vector<std::string>{"connected"});
  // Six batches, one question for shm (FAILED_PRECONDITION), the rest straight to UCX.
  EXPECT_EQ(RefusedOpens(shard), 1);
}

// A stand-in for a shard the node reaches over the network only: ExpertService from the proto,
// whose OpenDataPlane asks the real shard and, for shm, answers an address that is not a socket
// here (another pod's namespace) or `shm_address` where the case says. Counts the shm opens.
class ElsewhereShard final : public v1::ExpertService::Service {
 public:
  ElsewhereShard(const std::string& real, std::string shm_address)
      : real_(v1::ExpertService::NewStub(transport::MakeChannel(real))),
        shm_address_(std::move(shm_address)) {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(this);
    server_ = b.BuildAndStart();
  }
  ~ElsewhereShard() override { server_->Shutdown(); }
  std::string endpoint() const { return absl::StrCat("127.0.0.1:", port_); }
  int shm_opens() const { return shm_opens_.load(); }

  grpc::Status OpenDataPlane(grpc::ServerContext*, const v1::OpenDataPlaneRequest* req,
                             v1::OpenDataPlaneReply* reply) override {
    grpc::ClientContext ctx;
    const grpc::Status s = real_->OpenDataPlane(&ctx, *req, reply);
    if (s.ok() && req->transport() == "shm") {
      ++shm_opens_;
      reply->set_worker_address(shm_address_);
    }
    return s;
  }

 private:
  std::unique_ptr<v1::ExpertService::Stub> real_;
  const std::string shm_address_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::atomic<int> shm_opens_{0};
};

TEST(AutoDataPlane, AShardWhoseSocketIsNotInThisNamespaceIsServedOnUcx) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  const ModelConfig cfg = *PresetConfig("mid");
  BackendShard shard = testing::StartBackendShard(cfg, "auto");
  ElsewhereShard elsewhere(shard.endpoint, absl::StrCat("@moe-shm-elsewhere-", ::getpid()));
  AutoNode node;
  std::shared_ptr<attention_svc::ExpertChannel> ch = node.ChannelTo(elsewhere.endpoint());
  ASSERT_NO_FATAL_FAILURE(ExpectServedOn(*ch, shard.endpoint, "ucx"));
  ASSERT_NO_FATAL_FAILURE(ExpectServedOn(*ch, shard.endpoint, "ucx"));
  EXPECT_EQ(elsewhere.shm_opens(), 1) << "asked once, then UCX until the back-off ends";
  EXPECT_EQ(node.events, std::vector<std::string>{"connected"});
  EXPECT_EQ(WireBytes(shard, "shm"), 0);
}

// An abstract socket held by another user (the node runs as root here: a child that gave up to
// nobody listens under the name). The node must not send it the hello's secret or its memory.
TEST(AutoDataPlane, ASocketOfAnotherUserIsNotUsed) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to start a listener of another user";
  const std::string name = absl::StrCat("moe-shm-squatter-", ::getpid());
  int ready[2], heard[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe2(heard, O_NONBLOCK), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // only async-signal-safe calls after fork
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(2);
    const int s = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path + 1, name.data(), name.size());
    const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    if (s < 0 || ::bind(s, reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(s, 8) != 0) {
      ::_exit(3);
    }
    (void)::write(ready[1], "r", 1);
    for (;;) {  // accepts and reads whatever comes, until killed
      const int c = ::accept(s, nullptr, nullptr);
      char buf[256];
      if (c >= 0 && ::read(c, buf, sizeof buf) > 0) (void)::write(heard[1], "h", 1);
    }
  }
  ::close(ready[1]);
  ::close(heard[1]);
  char r = 0;
  ASSERT_EQ(::read(ready[0], &r, 1), 1) << "the squatter did not start";
  ::close(ready[0]);
  const ModelConfig cfg = *PresetConfig("mid");
  BackendShard shard = testing::StartBackendShard(cfg, "auto");
  ElsewhereShard squatted(shard.endpoint, "@" + name);
  AutoNode node;
  std::shared_ptr<attention_svc::ExpertChannel> ch = node.ChannelTo(squatted.endpoint());
  ASSERT_NO_FATAL_FAILURE(ExpectServedOn(*ch, shard.endpoint, "ucx"));
  EXPECT_EQ(squatted.shm_opens(), 1);
  EXPECT_EQ(::read(heard[0], &r, 1), -1) << "the squatter heard from the node";
  ::close(heard[0]);
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFSIGNALED(status)) << "the squatter ended on its own: " << status;
}

}  // namespace
}  // namespace moe
