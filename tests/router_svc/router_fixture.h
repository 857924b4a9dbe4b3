// The router-svc tests' fixture: a router of their own in this process, driven through its
// gRPC stub as a member (its role's token) or a stranger.
#ifndef MOE_TESTS_ROUTER_SVC_ROUTER_FIXTURE_H_
#define MOE_TESTS_ROUTER_SVC_ROUTER_FIXTURE_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>

#include "gtest/gtest.h"
#include "moe/v1/router.grpc.pb.h"
#include "router-svc/router_server.h"
#include "services/transport/channel.h"
#include "services/transport/security.h"
#include "tests/common/http_client.h"
#include "tests/common/tiny_checkpoint.h"

namespace moe::router_svc {

inline constexpr char kMember[] = "member-token";

// GET /metrics of a router started with a metrics_port_file.
inline std::string ScrapeMetrics(const RouterServerOptions& o, const RouterServer&) {
  std::ifstream f(o.metrics_port_file);
  int port = 0;
  f >> port;
  return moe::testing::HttpExchange(
      port, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
}

// A router-svc of its own, whose membership token every Ctx() carries (member: false, neither).
class Router {
 public:
  explicit Router(RouterServerOptions o, bool member = true) : member_(member) {
    o.checkpoint = moe::testing::TinyCheckpoint();
    if (o.cluster_token.empty() && member) o.cluster_token = kMember;
    auto s = RouterServer::Start(o);
    EXPECT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    stub_ = v1::RouterService::NewStub(
        transport::MakeChannel("127.0.0.1:" + std::to_string(server_->port())));
  }
  v1::RouterService::Stub* operator->() { return stub_.get(); }
  // As the expert member shard-a (its own token: transport::ExpertMemberToken of the cluster
  // secret and its name), with an admin token when one is given.
  std::unique_ptr<grpc::ClientContext> Ctx(const std::string& token = "",
                                           const char* role = "expert",
                                           const std::string& shard = "shard-a") {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!token.empty()) c->AddMetadata("x-moe-admin-token", token);
    if (member_) {
      c->AddMetadata("x-moe-cluster-token", std::string_view(role) == "expert"
                                                ? transport::ExpertMemberToken(kMember, shard)
                                                : transport::MemberRoleToken(kMember, role));
    }
    return c;
  }
  // As the expert member of another name.
  std::unique_ptr<grpc::ClientContext> As(const std::string& shard) {
    return Ctx("", "expert", shard);
  }
  // As an attention member (it reports statistics).
  std::unique_ptr<grpc::ClientContext> Attention() { return Ctx("", "attention"); }

 private:
  const bool member_;
  std::unique_ptr<RouterServer> server_;
  std::unique_ptr<v1::RouterService::Stub> stub_;
};

}  // namespace moe::router_svc

#endif  // MOE_TESTS_ROUTER_SVC_ROUTER_FIXTURE_H_
