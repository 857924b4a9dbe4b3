// router-svc's durable state (--state_db): versions, modes and leases back after a restart, a
// database of another checkpoint refused, and a state that is never silently empty.
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "moe/v1/router.grpc.pb.h"
#include "router-svc/router_server.h"
#include "router-svc/state_store.h"
#include "services/common/random.h"
#include "services/numerics/dynamic_k.h"
#include "services/numerics/qb.h"
#include "services/numerics/router.h"
#include "services/transport/channel.h"
#include "tests/common/tiny_checkpoint.h"
#include "tests/router_svc/router_fixture.h"

namespace moe::router_svc {
namespace {

using moe::testing::TinyCheckpoint;

// --state_db: the bias versions with their reasons, the mode and the registrations (with
// their leases) come back after a restart; a shard heartbeating through it keeps its place; a
// database of another checkpoint is refused.
TEST(RouterServer, BiasHistoryModesAndLeasesSurviveARestart) {
  std::string tmpl = ::testing::TempDir() + "/moe_state_XXXXXX";
  const std::string dir = ::mkdtemp(tmpl.data());
  RouterServerOptions o;
  o.state_db = dir + "/router.db";
  o.initialize = true;  // the cluster's first start
  o.admin_token = "adm";
  v1::RegisterExpertServerResponse lease;
  {
    Router r(o);
    v1::RegisterExpertServerRequest reg;
    reg.set_shard("shard-a");
    reg.set_endpoint("127.0.0.1:7");
    auto* range = reg.add_ranges();
    range->set_layer(1);
    range->set_expert_lo(0);
    range->set_expert_hi(16);
    ASSERT_TRUE(r->RegisterExpertServer(r.Ctx().get(), reg, &lease).ok());
    v1::RollbackBiasRequest rb;
    rb.set_layer(1);
    rb.set_to_version(0);
    v1::LayerBias b;
    ASSERT_TRUE(r->RollbackBias(r.Ctx("adm").get(), rb, &b).ok());
    ASSERT_EQ(b.version(), 1u);
    v1::SetBiasModeRequest sm;
    sm.set_layer(1);
    sm.set_mode(v1::BIAS_MODE_CONTINUOUS);
    sm.set_continuous_tokens(5000);
    ASSERT_TRUE(r->SetBiasMode(r.Ctx("adm").get(), sm, &b).ok());
  }  // router-svc stops
  Router again(o);
  v1::GetBiasRequest gb;
  gb.set_layer(1);
  v1::LayerBias b;
  ASSERT_TRUE(again->GetBias(again.Ctx().get(), gb, &b).ok());
  EXPECT_EQ(b.version(), 1u);
  EXPECT_EQ(b.reason(), "rollback to 0");
  EXPECT_EQ(b.mode(), v1::BIAS_MODE_CONTINUOUS);
  v1::GetLoadStatsRequest gs;
  gs.set_layer(1);
  v1::LoadStats st;
  ASSERT_TRUE(again->GetLoadStats(again.Ctx().get(), gs, &st).ok());
  ASSERT_EQ(st.history_size(), 2);
  EXPECT_EQ(st.history(0).reason(), "checkpoint");
  // The shard's old lease still heartbeats; the first placement already holds it.
  v1::HeartbeatRequest hb;
  hb.set_lease_id(lease.lease_id());
  v1::HeartbeatResponse hr;
  EXPECT_TRUE(again->Heartbeat(again.Ctx().get(), hb, &hr).ok());
  v1::Placement p;
  ASSERT_TRUE(again->GetPlacement(again.Ctx().get(), v1::GetPlacementRequest(), &p).ok());
  ASSERT_EQ(p.shards_size(), 1);
  EXPECT_EQ(p.shards(0).shard(), "shard-a");
  EXPECT_EQ(p.shards(0).endpoint(), "127.0.0.1:7");
  // A new version after the restart continues the numbering.
  v1::RollbackBiasRequest rb;
  rb.set_layer(1);
  rb.set_to_version(1);
  ASSERT_TRUE(again->RollbackBias(again.Ctx("adm").get(), rb, &b).ok());
  EXPECT_EQ(b.version(), 2u);

  // A database written for another checkpoint (another version 0) is refused at start.
  const std::string other = dir + "/other.db";
  {
    auto store = OpenSqliteStore(other);
    ASSERT_TRUE(store.ok()) << store.status();
    BiasVersion v0;
    v0.layer = 1;
    v0.bias = std::vector<float>(16, 0.5f);
    v0.reason = "checkpoint";
    ASSERT_TRUE((*store)->PutBiasVersion(v0).ok());
  }
  RouterServerOptions bad = o;
  bad.state_db = other;
  bad.checkpoint = TinyCheckpoint();
  bad.cluster_token = kMember;
  auto refused = RouterServer::Start(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("written for another checkpoint"), std::string::npos)
      << refused.status();
}

// A lost state never becomes a new cluster without a word: a missing, 0-byte or table-only db
// is refused at start unless --initialize; every commit is in the db file itself (a copy of
// the db file alone, taken while the router runs, with no -wal beside it, holds the latest
// version); the start says how the state began (metric, page JSON).
TEST(RouterServer, AStateIsNeverSilentlyEmpty) {
  std::string tmpl = ::testing::TempDir() + "/moe_state_XXXXXX";
  const std::string dir = ::mkdtemp(tmpl.data());
  RouterServerOptions o;
  o.checkpoint = TinyCheckpoint();
  o.cluster_token = kMember;
  o.admin_token = "adm";
  o.state_db = dir + "/router.db";
  // Missing: refused, and nothing is created.
  auto missing = RouterServer::Start(o);
  ASSERT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  EXPECT_NE(missing.status().message().find("does not exist"), std::string::npos);
  EXPECT_NE(missing.status().message().find("--initialize"), std::string::npos);
  EXPECT_NE(::access(o.state_db.c_str(), F_OK), 0);
  // 0 bytes (what a failed copy leaves): refused as empty, twice (opening it does not make it a
  // state).
  { std::ofstream(o.state_db).flush(); }
  for (int i = 0; i < 2; ++i) {
    auto empty = RouterServer::Start(o);
    ASSERT_EQ(empty.status().code(), absl::StatusCode::kFailedPrecondition) << empty.status();
    EXPECT_NE(empty.status().message().find("is empty: refusing to start a new cluster's state"),
              std::string::npos)
        << empty.status();
  }
  // --initialize: a new state, said so in the metric and the page's JSON.
  RouterServerOptions first = o;
  first.initialize = true;
  first.metrics_port = 0;
  first.metrics_port_file = dir + "/metrics.port";
  const std::string copy = dir + "/copy.db";
  {
    auto r = RouterServer::Start(first);
    ASSERT_TRUE(r.ok()) << r.status();
    const std::string m = ScrapeMetrics(first, **r);
    EXPECT_NE(m.find("moe_router_state_info{start=\"initialized\",store=\"sqlite\"} 1"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("moe_router_state_initialized_timestamp_seconds"), std::string::npos);
    // Version 1, then a copy of the db file alone while the router runs.
    auto stub = v1::RouterService::NewStub(
        transport::MakeChannel("127.0.0.1:" + std::to_string((*r)->port())));
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-moe-admin-token", "adm");
    v1::RollbackBiasRequest rb;
    rb.set_layer(1);
    rb.set_to_version(0);
    v1::LayerBias b;
    ASSERT_TRUE(stub->RollbackBias(&ctx, rb, &b).ok());
    ASSERT_EQ(b.version(), 1u);
    std::ifstream in(o.state_db, std::ios::binary);
    std::ofstream out(copy, std::ios::binary);
    out << in.rdbuf();
  }
  // The copy, without its -wal: version 1 is there; no --initialize needed, none made.
  RouterServerOptions from_copy = o;
  from_copy.state_db = copy;
  from_copy.metrics_port = 0;
  from_copy.metrics_port_file = dir + "/metrics2.port";
  auto r = RouterServer::Start(from_copy);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(ScrapeMetrics(from_copy, **r)
                .find("moe_router_state_info{start=\"restored\",store=\"sqlite\"} 1"),
            std::string::npos);
  auto stub = v1::RouterService::NewStub(
      transport::MakeChannel("127.0.0.1:" + std::to_string((*r)->port())));
  grpc::ClientContext ctx;
  ctx.AddMetadata("x-moe-cluster-token", kMember);
  v1::GetBiasRequest gb;
  gb.set_layer(1);
  v1::LayerBias b;
  ASSERT_TRUE(stub->GetBias(&ctx, gb, &b).ok());
  EXPECT_EQ(b.version(), 1u);
  EXPECT_EQ(b.reason(), "rollback to 0");
}

// One attention node's report of m tokens of skewed scores routed with `bias` (tiny: E 16, k 4),
// with its budget histogram (k_min 1).
v1::ReportStatsRequest BudgetReport(const std::vector<float>& bias, uint64_t version, int64_t m,
                                    numerics::BudgetHistogram* budget_out = nullptr) {
  const int64_t n = 16, k = 4;
  Rng rng(5);
  std::vector<float> s(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      s[i * n + j] = 1.0f / (1.0f + std::exp(-(rng.Normal() + 0.1f * static_cast<float>(j % 5))));
    }
  }
  numerics::QbWindow w;
  w.window_id = w.bias_version = version;
  w.layer = 1;
  w.top_k = k;
  auto qb = numerics::QbHistogram::Create(w, bias);
  EXPECT_TRUE(qb.ok() && qb->Accumulate(s, m).ok());
  numerics::BudgetWindow bw;
  bw.bias_version = version;
  bw.layer = 1;
  bw.top_k = k;
  bw.k_min = 1;
  auto budget = numerics::BudgetHistogram::Create(bw, n);
  EXPECT_TRUE(budget.ok());
  EXPECT_TRUE(
      budget->Accumulate(numerics::SelectExperts(s.data(), bias.data(), m, n, k, true, 1), s.data())
          .ok());
  v1::ReportStatsRequest req;
  req.set_node("attention-0");
  req.set_layer(1);
  req.set_bias_version(version);
  req.set_tokens(m);
  *req.mutable_loads() = {qb->loads().begin(), qb->loads().end()};
  req.set_qb_histogram(qb->Serialize());
  req.set_budget_histogram(budget->Serialize());
  if (budget_out != nullptr) *budget_out = *budget;
  return req;
}

// Dynamic k's thresholds: refused before any traffic, solved from the window's budget
// histograms (equal to the histogram's own solve), published with the bias as a version, kept
// across a restart, restored by a rollback. A lying budget histogram is refused whole.
TEST(RouterServer, ExpertBudgetsAreSolvedStoredAndRolledBack) {
  std::string tmpl = ::testing::TempDir() + "/moe_budget_XXXXXX";
  const std::string dir = ::mkdtemp(tmpl.data());
  RouterServerOptions o;
  o.state_db = dir + "/router.db";
  o.initialize = true;
  o.admin_token = "adm";
  std::vector<float> table;
  uint64_t budget_version = 0;
  {
    Router r(o);
    v1::GetBiasRequest gb;
    gb.set_layer(1);
    v1::LayerBias v0;
    ASSERT_TRUE(r->GetBias(r.Ctx().get(), gb, &v0).ok());
    EXPECT_EQ(v0.budget().k_avg(), 4);  // no budget: the full top-k
    EXPECT_EQ(v0.budget().k_min(), 1);
    EXPECT_EQ(v0.budget().thresholds_size(), 0);
    v1::SetExpertBudgetRequest sb;
    sb.set_layer(1);
    sb.set_k_avg(2);
    v1::LayerBias b;
    grpc::Status st = r->SetExpertBudget(r.Ctx("adm").get(), sb, &b);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    st = r->SetExpertBudget(r.Ctx().get(), sb, &b);  // a member is not an admin
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);

    const std::vector<float> bias(v0.bias().begin(), v0.bias().end());
    numerics::BudgetHistogram sent = *numerics::BudgetHistogram::Create({0, 1, 4, 1, 512}, 16);
    v1::ReportStatsRequest report = BudgetReport(bias, 0, 3000, &sent);
    // Hostile: a budget histogram that does not add up to the loads, and bytes that are none.
    v1::ReportStatsResponse rr;
    v1::ReportStatsRequest lying = report;
    v1::ReportStatsRequest other = BudgetReport(bias, 0, 2999);
    lying.set_budget_histogram(other.budget_histogram());
    st = r->ReportStats(r.Attention().get(), lying, &rr);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    lying.set_budget_histogram(std::string(100, 'x'));
    st = r->ReportStats(r.Attention().get(), lying, &rr);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    v1::GetLoadStatsRequest gs;
    gs.set_layer(1);
    v1::LoadStats ls;
    ASSERT_TRUE(r->GetLoadStats(r.Ctx().get(), gs, &ls).ok());
    EXPECT_EQ(ls.window_tokens(), 0) << "a refused report counts nothing";

    st = r->ReportStats(r.Attention().get(), report, &rr);
    ASSERT_TRUE(st.ok()) << st.error_message();
    st = r->SetExpertBudget(r.Ctx("adm").get(), sb, &b);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(b.version(), 1u);
    EXPECT_EQ(b.budget().k_avg(), 2);
    EXPECT_EQ(b.budget().solved_from_tokens(), 3000);
    EXPECT_EQ(b.budget().solved_from_version(), 0u);
    EXPECT_EQ(std::vector<float>(b.bias().begin(), b.bias().end()), bias);  // the same bias
    table.assign(b.budget().thresholds().begin(), b.budget().thresholds().end());
    EXPECT_EQ(table, sent.SolveTable());
    budget_version = b.version();
    // The window restarted with the version: a new budget keeps the solved table.
    sb.set_k_avg(3);
    ASSERT_TRUE(r->SetExpertBudget(r.Ctx("adm").get(), sb, &b).ok());
    EXPECT_EQ(b.budget().k_avg(), 3);
    EXPECT_EQ(std::vector<float>(b.budget().thresholds().begin(), b.budget().thresholds().end()),
              table);
    EXPECT_NE(b.reason().find("thresholds of version 0"), std::string::npos) << b.reason();
  }
  Router again(o);
  v1::GetBiasRequest gb;
  gb.set_layer(1);
  v1::LayerBias b;
  ASSERT_TRUE(again->GetBias(again.Ctx().get(), gb, &b).ok());
  EXPECT_EQ(b.version(), 2u);
  EXPECT_EQ(b.budget().k_avg(), 3);
  EXPECT_EQ(std::vector<float>(b.budget().thresholds().begin(), b.budget().thresholds().end()),
            table);
  v1::RollbackBiasRequest rb;
  rb.set_layer(1);
  rb.set_to_version(0);
  ASSERT_TRUE(again->RollbackBias(again.Ctx("adm").get(), rb, &b).ok());
  EXPECT_EQ(b.budget().k_avg(), 4);
  EXPECT_EQ(b.budget().thresholds_size(), 0);
  rb.set_to_version(budget_version);
  ASSERT_TRUE(again->RollbackBias(again.Ctx("adm").get(), rb, &b).ok());
  EXPECT_EQ(b.budget().k_avg(), 2);
  EXPECT_EQ(b.budget().thresholds_size(), 3 * 16);
}

// Thresholds solved under one bias are marked stale once a Rebalance moves the bias past
// --budget_stale_bias (attention nodes then serve the full top-k), and solved again by the router
// itself from the next window under the new bias as a version with the same bias; the window's
// noise floor is stated and flagged above --budget_window_floor.
TEST(RouterServer, StaleThresholdsAreSolvedAgainFromTheNextWindow) {
  RouterServerOptions o;
  o.admin_token = "adm";
  o.budget_window_floor = 0.1;  // 3,000 tokens at budget 2 of tiny (E 16) leave 0.122
  Router r(o);
  v1::GetBiasRequest gb;
  gb.set_layer(1);
  v1::LayerBias v;
  ASSERT_TRUE(r->GetBias(r.Ctx().get(), gb, &v).ok());
  std::vector<float> bias(v.bias().begin(), v.bias().end());
  v1::ReportStatsResponse rr;
  ASSERT_TRUE(r->ReportStats(r.Attention().get(), BudgetReport(bias, 0, 3000), &rr).ok());
  v1::SetExpertBudgetRequest sb;
  sb.set_layer(1);
  sb.set_k_avg(2);
  ASSERT_TRUE(r->SetExpertBudget(r.Ctx("adm").get(), sb, &v).ok());
  EXPECT_FALSE(v.budget().stale());
  EXPECT_DOUBLE_EQ(v.budget().window_floor(), numerics::BudgetWindowFloor(16, 2, 3000));
  EXPECT_NEAR(v.budget().window_floor(), std::sqrt(2 * std::log(16.0) / (2 * 3000 / 16.0)), 1e-12);
  const int64_t enough = numerics::BudgetWindowTokens(16, 2, 0.1);
  EXPECT_LE(numerics::BudgetWindowFloor(16, 2, enough), 0.1);
  EXPECT_GT(numerics::BudgetWindowFloor(16, 2, enough - 1), 0.1);
  EXPECT_NE(v.reason().find(absl::StrCat("a window of ", enough, " tokens meets it")),
            std::string::npos)
      << v.reason();

  // Traffic under version 1, then a QB step that moves the skewed bias far.
  ASSERT_TRUE(r->ReportStats(r.Attention().get(), BudgetReport(bias, 1, 3000), &rr).ok());
  v1::RebalanceRequest rq;
  rq.set_layer(1);
  v1::RebalanceResponse rs;
  ASSERT_TRUE(r->Rebalance(r.Ctx("adm").get(), rq, &rs).ok());
  ASSERT_TRUE(r->GetBias(r.Ctx().get(), gb, &v).ok());
  ASSERT_EQ(v.version(), 2u);
  double moved = 0;
  for (int e = 0; e < 16; ++e) moved = std::max<double>(moved, std::abs(v.bias(e) - bias[e]));
  ASSERT_GT(moved, o.budget_stale_bias);
  EXPECT_TRUE(v.budget().stale());
  EXPECT_EQ(v.budget().solved_from_version(), 1u);
  EXPECT_NE(v.reason().find("thresholds stale"), std::string::npos) << v.reason();
  bias.assign(v.bias().begin(), v.bias().end());

  // Under version 2: nothing until the window holds as many tokens as the stale ones came from.
  ASSERT_TRUE(r->ReportStats(r.Attention().get(), BudgetReport(bias, 2, 1000), &rr).ok());
  ASSERT_TRUE(r->GetBias(r.Ctx().get(), gb, &v).ok());
  EXPECT_EQ(v.version(), 2u);
  ASSERT_TRUE(r->ReportStats(r.Attention().get(), BudgetReport(bias, 2, 2000), &rr).ok());
  ASSERT_TRUE(r->GetBias(r.Ctx().get(), gb, &v).ok());
  EXPECT_EQ(v.version(), 3u);
  EXPECT_FALSE(v.budget().stale());
  EXPECT_EQ(v.budget().k_avg(), 2);
  EXPECT_EQ(v.budget().solved_from_version(), 2u);
  EXPECT_EQ(v.budget().solved_from_tokens(), 3000);
  EXPECT_EQ(std::vector<float>(v.bias().begin(), v.bias().end()), bias);  // the same bias
  EXPECT_NE(v.reason().find("thresholds solved again under version 2 from 3000 tokens"),
            std::string::npos)
      << v.reason();
}

// A state written before dynamic k (bias_versions without the budget column) opens: its
// versions have no budget (the full top-k), and new ones store theirs.
TEST(RouterServer, AStateFromBeforeDynamicKOpens) {
  std::string tmpl = ::testing::TempDir() + "/moe_oldstate_XXXXXX";
  const std::string dir = ::mkdtemp(tmpl.data());
  RouterServerOptions o;
  o.state_db = dir + "/router.db";
  o.initialize = true;
  o.admin_token = "adm";
  std::vector<float> bias;
  {
    Router r(o);  // makes the state, then the old schema is put back by hand
    v1::GetBiasRequest gb;
    gb.set_layer(1);
    v1::LayerBias v0;
    ASSERT_TRUE(r->GetBias(r.Ctx().get(), gb, &v0).ok());
    bias.assign(v0.bias().begin(), v0.bias().end());
  }
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(o.state_db.c_str(), &db), SQLITE_OK);
  for (const char* sql :
       {"CREATE TABLE old (layer INTEGER NOT NULL, version INTEGER NOT NULL, mode TEXT NOT NULL, "
        "reason TEXT NOT NULL, created_unix_ms INTEGER NOT NULL, bias BLOB NOT NULL, "
        "PRIMARY KEY (layer, version));",
        "INSERT INTO old SELECT layer, version, mode, reason, created_unix_ms, bias FROM "
        "bias_versions;",
        "DROP TABLE bias_versions;", "ALTER TABLE old RENAME TO bias_versions;"}) {
    ASSERT_EQ(sqlite3_exec(db, sql, nullptr, nullptr, nullptr), SQLITE_OK) << sql;
  }
  sqlite3_close(db);
  o.initialize = false;
  Router again(o);
  v1::GetBiasRequest gb;
  gb.set_layer(1);
  v1::LayerBias b;
  ASSERT_TRUE(again->GetBias(again.Ctx().get(), gb, &b).ok());
  EXPECT_EQ(b.version(), 0u);
  EXPECT_EQ(b.budget().k_avg(), 4);
  v1::ReportStatsResponse rr;
  ASSERT_TRUE(again->ReportStats(again.Attention().get(), BudgetReport(bias, 0, 500), &rr).ok());
  v1::SetExpertBudgetRequest sb;
  sb.set_layer(1);
  sb.set_k_avg(2);
  ASSERT_TRUE(again->SetExpertBudget(again.Ctx("adm").get(), sb, &b).ok());
  EXPECT_EQ(b.version(), 1u);
  EXPECT_EQ(b.budget().thresholds_size(), 3 * 16);
}

}  // namespace
}  // namespace moe::router_svc
