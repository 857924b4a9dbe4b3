// router-svc as a library in this process, driven through its gRPC stub, on who may do what and
// how much: watchers get the latest state and are bounded by a byte budget; only members
// register, heartbeat and report (tokens, identities); admin calls need the admin token (from a
// file); registrations are bounded by the deployment's table and expire.
#include <grpcpp/grpcpp.h>
#include <sys/stat.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <thread>

#include "gtest/gtest.h"
#include "moe/v1/router.grpc.pb.h"
#include "router-svc/router_server.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/synthetic.h"
#include "services/common/random.h"
#include "services/numerics/qb.h"
#include "services/transport/grpc_server.h"
#include "services/transport/security.h"
#include "tests/common/tiny_checkpoint.h"
#include "tests/router_svc/router_fixture.h"

namespace moe::router_svc {
namespace {

using moe::testing::TinyCheckpoint;

// Registers n shards over experts [0, 16) of layer 1, each with a name and an endpoint near
// their bounds (about 400 bytes of placement each).
void RegisterBigShards(Router& r, int n) {
  for (int i = 0; i < n; ++i) {
    v1::RegisterExpertServerRequest reg;
    reg.set_shard("shard-" + std::to_string(i) + std::string(110, 'x'));
    reg.set_endpoint("127.0.0.1:1/" + std::string(240, 'e'));
    v1::ExpertRange* range = reg.add_ranges();
    range->set_layer(1);
    range->set_expert_lo(0);
    range->set_expert_hi(16);
    v1::RegisterExpertServerResponse lease;
    ASSERT_TRUE(r->RegisterExpertServer(r.As(reg.shard()).get(), reg, &lease).ok()) << i;
  }
}

// Watchers hold states, not events: one that does not read while the placement changes 300
// times then reads the latest placement after far fewer messages; watch streams are bounded.
TEST(RouterServer, WatchersGetTheLatestStateAndAreBounded) {
  RouterServerOptions o;
  o.max_watchers = 2;
  Router r(o);
  grpc::ClientContext slow_ctx;
  slow_ctx.AddMetadata("x-moe-cluster-token", kMember);
  auto slow = r->WatchPlacement(&slow_ctx, v1::GetPlacementRequest());
  v1::Placement first;
  ASSERT_TRUE(slow->Read(&first));
  constexpr int kChanges = 300;
  // Big placements (names and endpoints near their bounds): 300 of them pass the 16 MB window.
  ASSERT_NO_FATAL_FAILURE(RegisterBigShards(r, kChanges));
  v1::Placement latest;
  ASSERT_TRUE(r->GetPlacement(r.Ctx().get(), v1::GetPlacementRequest(), &latest).ok());
  ASSERT_EQ(latest.shards_size(), kChanges);
  int messages = 0;
  v1::Placement p;
  while (messages < kChanges && slow->Read(&p)) {  // bounded: at most one message per change
    ++messages;
    if (p.version() == latest.version()) break;
  }
  EXPECT_EQ(p.version(), latest.version());
  EXPECT_EQ(p.shards_size(), kChanges);
  std::printf("[slow watcher] %d placement changes, %d messages read\n", kChanges, messages);
  EXPECT_LT(messages, kChanges / 2);
  // A second watch is allowed, a third refused (max_watchers = 2).
  grpc::ClientContext second_ctx, third_ctx;
  auto second = r->WatchPlacement(&second_ctx, v1::GetPlacementRequest());
  ASSERT_TRUE(second->Read(&p));
  auto third = r->WatchPlacement(&third_ctx, v1::GetPlacementRequest());
  EXPECT_FALSE(third->Read(&p));
  EXPECT_EQ(third->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  slow_ctx.TryCancel();
  second_ctx.TryCancel();
  (void)slow->Finish();
  (void)second->Finish();
}

// The bytes watchers hold unread are bounded together (--max_watch_bytes): while placements
// grow past it, a watcher that is pushed to over the budget is ended (its call cancelled, so
// what gRPC holds for it goes too); the router serves on, and a new watcher gets the latest.
TEST(RouterServer, WatchersArePastTheByteBudgetEnded) {
  RouterServerOptions o;
  o.max_watch_bytes = 256 << 10;  // 256 KiB for every watcher together
  Router r(o);
  grpc::ClientContext idle_ctx;
  idle_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto idle = r->WatchPlacement(&idle_ctx, v1::GetPlacementRequest());
  v1::Placement p;
  ASSERT_TRUE(idle->Read(&p));  // then not again until the registrations are done
  // 600 shards of ~400 bytes: placements of up to ~240 KB, ~70 MB over all versions.
  ASSERT_NO_FATAL_FAILURE(RegisterBigShards(r, 600));
  // The stream was ended: what it reads now ends in an error before its deadline, at most
  // one message per change.
  int idle_read = 0;
  while (idle_read < 600 && idle->Read(&p)) ++idle_read;
  const grpc::Status s = idle->Finish();
  EXPECT_TRUE(s.error_code() == grpc::StatusCode::CANCELLED ||
              s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED)
      << s.error_code() << " " << s.error_message();
  std::printf("[over the watch budget] ended after %d messages\n", idle_read);
  // A new watcher: the latest placement.
  v1::Placement latest;
  ASSERT_TRUE(r->GetPlacement(r.Ctx().get(), v1::GetPlacementRequest(), &latest).ok());
  ASSERT_EQ(latest.shards_size(), 600);
  grpc::ClientContext fresh_ctx;
  fresh_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto fresh = r->WatchPlacement(&fresh_ctx, v1::GetPlacementRequest());
  ASSERT_TRUE(fresh->Read(&p));
  EXPECT_EQ(p.version(), latest.version());
  fresh_ctx.TryCancel();
  (void)fresh->Finish();
}

// Membership is authenticated: registrations, heartbeats and reports need the cluster token,
// and a router without one accepts none; a forged report changes nothing.
TEST(RouterServer, OnlyMembersRegisterHeartbeatAndReport) {
  Router r(RouterServerOptions{});
  v1::RegisterExpertServerRequest reg;
  reg.set_shard("rogue");
  reg.set_endpoint("127.0.0.1:1");
  v1::ExpertRange* range = reg.add_ranges();
  range->set_layer(1);
  range->set_expert_lo(0);
  range->set_expert_hi(16);
  v1::RegisterExpertServerResponse lease;
  auto bare = std::make_unique<grpc::ClientContext>();
  bare->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status s = r->RegisterExpertServer(bare.get(), reg, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  auto wrong = std::make_unique<grpc::ClientContext>();
  wrong->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  wrong->AddMetadata("x-moe-cluster-token", "member-tokeN");
  EXPECT_EQ(r->RegisterExpertServer(wrong.get(), reg, &lease).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  v1::Placement p;
  ASSERT_TRUE(r->GetPlacement(r.Ctx().get(), v1::GetPlacementRequest(), &p).ok());
  EXPECT_EQ(p.shards_size(), 0) << "a refused registration must not join the placement";
  v1::ReportStatsRequest forged;
  forged.set_node("rogue");
  forged.set_layer(1);
  forged.set_tokens(1000);
  for (int e = 0; e < 16; ++e) forged.add_loads(e == 0 ? 4000 : 0);
  v1::ReportStatsResponse ack;
  auto bare2 = std::make_unique<grpc::ClientContext>();
  bare2->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  EXPECT_EQ(r->ReportStats(bare2.get(), forged, &ack).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  v1::GetLoadStatsRequest lr;
  lr.set_layer(1);
  v1::LoadStats stats;
  ASSERT_TRUE(r->GetLoadStats(r.Ctx().get(), lr, &stats).ok());
  EXPECT_EQ(stats.total_tokens(), 0);
  // A member's token names it: shard-a's token does not register "rogue" (no member has
  // presented that token yet: a stranger's, UNAUTHENTICATED) ...
  s = r->RegisterExpertServer(r.Ctx().get(), reg, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  EXPECT_NE(s.error_message().find("that shard's own"), std::string::npos) << s.error_message();
  // The member registers under its own name; its lease is a random 64-bit number, not 1, 2 ...
  ASSERT_TRUE(r->RegisterExpertServer(r.As("rogue").get(), reg, &lease).ok());
  EXPECT_GT(lease.lease_id(), uint64_t{1} << 32);
  v1::HeartbeatRequest hb;
  hb.set_lease_id(lease.lease_id());
  v1::HeartbeatResponse hr;
  auto bare3 = std::make_unique<grpc::ClientContext>();
  bare3->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  EXPECT_EQ(r->Heartbeat(bare3.get(), hb, &hr).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(r->Heartbeat(r.As("rogue").get(), hb, &hr).ok());
  // ... and once it has, its token under another name is a member acting as someone else:
  // PERMISSION_DENIED naming whose token it is, for registrations and for another's lease.
  v1::RegisterExpertServerRequest other = reg;
  other.set_shard("victim");
  s = r->RegisterExpertServer(r.As("rogue").get(), other, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("with the member token of shard rogue"), std::string::npos)
      << s.error_message();
  v1::RegisterExpertServerResponse victim;
  ASSERT_TRUE(r->RegisterExpertServer(r.As("victim").get(), other, &victim).ok());
  v1::HeartbeatRequest vhb;
  vhb.set_lease_id(victim.lease_id());
  EXPECT_EQ(r->Heartbeat(r.As("rogue").get(), vhb, &hr).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // A lease nobody holds: NOT_FOUND for any member (it registers again).
  vhb.set_lease_id(victim.lease_id() ^ 1);
  EXPECT_EQ(r->Heartbeat(r.As("rogue").get(), vhb, &hr).error_code(), grpc::StatusCode::NOT_FOUND);
  // Each role's token for its own calls only: an attention node cannot register or heartbeat,
  // an expert cannot report, and the cluster secret itself is no member's token.
  EXPECT_EQ(r->RegisterExpertServer(r.Attention().get(), reg, &lease).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(r->Heartbeat(r.Attention().get(), hb, &hr).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(r->ReportStats(r.As("rogue").get(), forged, &ack).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  auto secret = std::make_unique<grpc::ClientContext>();
  secret->AddMetadata("x-moe-cluster-token", kMember);
  s = r->RegisterExpertServer(secret.get(), reg, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_NE(s.error_message().find("needs the cluster token of an expert member"),
            std::string::npos)
      << s.error_message();

  Router closed(RouterServerOptions{}, /*member=*/false);  // no cluster token at all
  s = closed->RegisterExpertServer(closed.Ctx().get(), reg, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(s.error_message().find("membership is closed"), std::string::npos) << s.error_message();
}

// Secure by default: without an admin token every call that changes the bias is refused (a
// dry run changes nothing and stays open); the token comes from a file only its owner (and
// group) can read.
TEST(RouterServer, AdminCallsAreRefusedWithoutATokenAndTheTokenComesFromAFile) {
  {
    Router open(RouterServerOptions{});
    v1::RebalanceRequest rb;
    rb.set_layer(1);
    v1::RebalanceResponse rr;
    grpc::Status s = open->Rebalance(open.Ctx("anything").get(), rb, &rr);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_NE(s.error_message().find("admin calls are disabled"), std::string::npos);
    v1::SetBiasModeRequest sm;
    sm.set_layer(1);
    sm.set_mode(v1::BIAS_MODE_FROZEN);
    v1::LayerBias ack;
    EXPECT_EQ(open->SetBiasMode(open.Ctx().get(), sm, &ack).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
    v1::RollbackBiasRequest rbk;
    rbk.set_layer(1);
    EXPECT_EQ(open->RollbackBias(open.Ctx().get(), rbk, &ack).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
    rb.set_dry_run(true);  // no traffic yet: refused for that reason, not for the token
    EXPECT_EQ(open->Rebalance(open.Ctx().get(), rb, &rr).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  const std::string dir = ::testing::TempDir();
  auto write = [&](const std::string& name, const std::string& text, mode_t mode) {
    const std::string path = dir + "/" + name;
    std::ofstream(path) << text;
    ::chmod(path.c_str(), mode);
    return path;
  };
  RouterServerOptions o;
  o.checkpoint = TinyCheckpoint();
  o.admin_token_file = write("world_readable_token", "s3cret\n", 0644);
  auto refused = RouterServer::Start(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  o.admin_token_file = write("empty_token", " \n", 0600);
  EXPECT_EQ(RouterServer::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.admin_token_file = dir + "/no_such_token";
  EXPECT_EQ(RouterServer::Start(o).status().code(), absl::StatusCode::kNotFound);
  o.admin_token_file = write("good_token", "  s3cret\n", 0640);
  o.bias_mode = BiasMode::kFrozen;
  o.admin_token = "ignored-when-a-file-is-given";
  Router r(o);
  v1::SetBiasModeRequest sm;
  sm.set_layer(1);
  sm.set_mode(v1::BIAS_MODE_REBALANCE);
  v1::LayerBias ack;
  EXPECT_EQ(r->SetBiasMode(r.Ctx("ignored-when-a-file-is-given").get(), sm, &ack).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(r->SetBiasMode(r.Ctx("s3cre").get(), sm, &ack).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(r->SetBiasMode(r.Ctx("s3cret").get(), sm, &ack).ok());
  EXPECT_EQ(ack.mode(), v1::BIAS_MODE_REBALANCE);
}

// Members are bounded too: a shard registers only the range the deployment's table gives its
// name, one range per managed layer, under a bounded name; and a registration whose lease is
// long expired leaves the placement (and the store) by itself.
TEST(RouterServer, RegistrationsAreBoundedByTheDeploymentAndExpire) {
  std::string tmpl = ::testing::TempDir() + "/moe_ranges_XXXXXX";
  const std::string dir = ::mkdtemp(tmpl.data());
  {
    std::ofstream f(dir + "/ranges.json");
    f << R"({"shards": {"shard-a": [0, 8], "shard-b": [8, 16]}})";
  }
  RouterServerOptions o;
  o.ranges_file = dir + "/ranges.json";
  o.heartbeat_interval_ms = 100;
  o.shard_expiry_seconds = 1;
  o.max_shards = 2;
  Router r(o);
  auto reg = [&](const std::string& shard, std::vector<std::array<int, 3>> ranges) {
    v1::RegisterExpertServerRequest req;
    req.set_shard(shard);
    req.set_endpoint("127.0.0.1:7");
    for (const auto& [layer, lo, hi] : ranges) {
      auto* x = req.add_ranges();
      x->set_layer(layer);
      x->set_expert_lo(lo);
      x->set_expert_hi(hi);
    }
    v1::RegisterExpertServerResponse resp;
    return r->RegisterExpertServer(r.As(shard).get(), req, &resp);
  };
  struct Case {
    std::string shard;
    std::vector<std::array<int, 3>> ranges;
    grpc::StatusCode code;
    const char* message;
  };
  for (const Case& c : {
           Case{"a-evil",
                {{1, 0, 16}},
                grpc::StatusCode::PERMISSION_DENIED,
                "shard a-evil may serve no experts"},
           Case{"shard-a",
                {{1, 0, 16}},
                grpc::StatusCode::PERMISSION_DENIED,
                "shard shard-a may serve experts [0, 8) (the deployment's ranges file), not the "
                "range [0, 16) it registered for layer 1"},
           Case{"shard-a",
                {{7, 0, 8}},
                grpc::StatusCode::INVALID_ARGUMENT,
                "layer 7 is not managed by this router"},
           Case{"shard-a",
                {{1, 0, 4}, {1, 4, 8}},
                grpc::StatusCode::INVALID_ARGUMENT,
                "two ranges for layer 1"},
           Case{std::string(210, 'x'),
                {{1, 0, 8}},
                grpc::StatusCode::INVALID_ARGUMENT,
                "a shard name of 210 bytes"},
           Case{"shard a",
                {{1, 0, 8}},
                grpc::StatusCode::INVALID_ARGUMENT,
                "letters, digits, '-', '.' and '_' only"},
       }) {
    SCOPED_TRACE(c.shard.substr(0, 20));
    const grpc::Status s = reg(c.shard, c.ranges);
    EXPECT_EQ(s.error_code(), c.code) << s.error_message();
    EXPECT_NE(s.error_message().find(c.message), std::string::npos) << s.error_message();
  }
  // Within its range: accepted (a narrower range too).
  ASSERT_TRUE(reg("shard-a", {{1, 0, 8}}).ok());
  ASSERT_TRUE(reg("shard-b", {{1, 8, 12}}).ok());
  v1::Placement p;
  ASSERT_TRUE(r->GetPlacement(r.Ctx().get(), v1::GetPlacementRequest(), &p).ok());
  ASSERT_EQ(p.shards_size(), 2);
  // Silent past shard_expiry_seconds: removed by the health loop (bounded wait: 5 s).
  for (int i = 0; i < 50 && p.shards_size() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_TRUE(r->GetPlacement(r.Ctx().get(), v1::GetPlacementRequest(), &p).ok());
  }
  EXPECT_EQ(p.shards_size(), 0) << "expired registrations stay in the placement";
}

}  // namespace
}  // namespace moe::router_svc
