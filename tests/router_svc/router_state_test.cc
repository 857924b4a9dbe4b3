// router-svc's state, class by class, without gRPC: the placement registry (leases, health by
// heartbeat with a test clock, snapshots, shard maps), the bias ledger (versions, rollback,
// modes), the load window (report validation, stale reports, bounds, the QB plan) and the
// load-balance page (admin token, queries, errors).
#include <limits>

#include "gtest/gtest.h"
#include "router-svc/bias_ledger.h"
#include "router-svc/load_balance_page.h"
#include "router-svc/load_window.h"
#include "router-svc/placement_registry.h"
#include "services/common/random.h"

namespace moe::router_svc {
namespace {

using std::chrono::milliseconds;

TEST(PlacementRegistry, RefusesBadRegistrationsWithTheReason) {
  struct Case {
    std::string shard, endpoint;
    std::vector<LayerRange> ranges;
    std::string error;
  };
  const Clock::time_point t0;
  for (const Case& c : std::vector<Case>{
           {"", "h:1", {{1, 0, 4}}, "needs a shard name and an endpoint"},
           {"s", "", {{1, 0, 4}}, "needs a shard name and an endpoint"},
           {"s", "h:1", {}, "registration without ranges"},
           {"s", "h:1", {{1, 4, 4}}, "range [4, 4) of layer 1 is invalid"},
           {"s", "h:1", {{1, -1, 4}}, "range [-1, 4) of layer 1 is invalid"},
           {"s", "h:1", {{2, 0, 17}}, "range [0, 17) of layer 2 is invalid"},
       }) {
    PlacementRegistry reg(16);
    auto lease = reg.Register(c.shard, c.endpoint, c.ranges, t0);
    ASSERT_FALSE(lease.ok());
    EXPECT_NE(lease.status().message().find(c.error), absl::string_view::npos) << lease.status();
    EXPECT_EQ(reg.shards(), 0);
    EXPECT_EQ(reg.version(), 1u);  // a refused registration publishes nothing
  }
}

TEST(PlacementRegistry, HoldsAtMostMaxShards) {
  PlacementRegistry reg(16, /*max_shards=*/2);
  const auto t0 = Clock::now();
  ASSERT_TRUE(reg.Register("shard-0", "h:1", {{1, 0, 8}}, t0).ok());
  ASSERT_TRUE(reg.Register("shard-1", "h:2", {{1, 8, 16}}, t0).ok());
  auto third = reg.Register("shard-2", "h:3", {{1, 0, 16}}, t0);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
  // Re-registering a name whose lease has died is fine (it does not count twice).
  EXPECT_TRUE(reg.Register("shard-1", "h:4", {{1, 8, 16}}, t0 + milliseconds(1501)).ok());
  EXPECT_EQ(reg.shards(), 2);
  EXPECT_EQ(reg.Register(std::string(300, 'x'), "h:5", {{1, 0, 16}}, t0).status().code(),
            absl::StatusCode::kResourceExhausted);  // the bound comes first
}

TEST(PlacementRegistry, LeasesHeartbeatsAndHealth) {
  PlacementRegistry reg(16);
  const Clock::time_point t0;
  const auto stale = milliseconds(1500);
  auto a = reg.Register("shard-0", "h:1", {{1, 0, 8}}, t0);
  auto b = reg.Register("shard-1", "h:2", {{1, 8, 16}}, t0);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
  EXPECT_EQ(reg.version(), 3u);
  // Heartbeats keep a shard healthy; an unknown lease is refused.
  EXPECT_EQ(*reg.Heartbeat(*a, t0 + milliseconds(1000)), false);
  EXPECT_EQ(reg.Heartbeat(999, t0).status().code(), absl::StatusCode::kNotFound);
  // shard-1 falls silent: unhealthy after more than `stale`, not before.
  EXPECT_TRUE(reg.ExpireStale(t0 + milliseconds(1500), stale).empty());
  EXPECT_EQ(reg.ExpireStale(t0 + milliseconds(1600), stale), std::vector<std::string>{"shard-1"});
  EXPECT_EQ(reg.version(), 4u);
  EXPECT_EQ(reg.healthy_shards(), 1);
  EXPECT_TRUE(reg.ExpireStale(t0 + milliseconds(1700), stale).empty());  // once
  const PlacementSnapshot snap = reg.Snapshot(t0 + milliseconds(2000));
  ASSERT_EQ(snap.shards.size(), 2u);
  EXPECT_EQ(snap.shards[1].name, "shard-1");
  EXPECT_FALSE(snap.shards[1].healthy);
  EXPECT_EQ(snap.shards[1].last_seen_ms, 2000);
  // A heartbeat brings it back (a new version). While its lease lives (1.5 s after its last
  // heartbeat, the default lifetime) no registration takes its name: ALREADY_EXISTS, up to the
  // last millisecond; after that one replaces the lease (a restarted shard).
  EXPECT_EQ(*reg.Heartbeat(*b, t0 + milliseconds(2000)), true);
  EXPECT_EQ(reg.version(), 5u);
  for (int ms : {2000, 2100, 3500}) {
    auto taken = reg.Register("shard-1", "h:3", {{1, 8, 16}}, t0 + milliseconds(ms));
    EXPECT_EQ(taken.status().code(), absl::StatusCode::kAlreadyExists) << ms;
  }
  EXPECT_EQ(reg.version(), 5u);
  EXPECT_EQ(reg.Snapshot(t0).shards[1].endpoint, "h:2");
  auto b2 = reg.Register("shard-1", "h:3", {{1, 8, 16}}, t0 + milliseconds(3501));
  ASSERT_TRUE(b2.ok());
  EXPECT_EQ(reg.Heartbeat(*b, t0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reg.Snapshot(t0).shards[1].endpoint, "h:3");
}

// The data plane's lanes ride on heartbeats: a change is a new placement version shown on the
// page; the same lanes again, or none, change nothing; anything but the lanes' own alphabet
// (markup, control bytes) or over 128 bytes is refused.
TEST(PlacementRegistry, HeartbeatsCarryTheLanesUcxSelected) {
  PlacementRegistry reg(16);
  const Clock::time_point t0;
  auto a = reg.Register("shard-0", "h:1", {{1, 0, 16}}, t0, "ucx");
  ASSERT_TRUE(a.ok());
  const uint64_t v0 = reg.version();
  EXPECT_EQ(*reg.Heartbeat(*a, t0, "shm (posix)"), true);
  EXPECT_EQ(reg.version(), v0 + 1);
  EXPECT_EQ(*reg.Heartbeat(*a, t0, "shm (posix)"), false);
  EXPECT_EQ(*reg.Heartbeat(*a, t0, ""), false);
  EXPECT_EQ(reg.version(), v0 + 1);
  EXPECT_EQ(reg.Snapshot(t0).shards[0].lanes, "shm (posix)");
  EXPECT_EQ(reg.ShardLoads(1, std::vector<int64_t>(16, 1))[0].lanes, "shm (posix)");
  for (const std::string& bad :
       {std::string("<img src=x onerror=alert(1)>"), std::string("tcp\n"), std::string(129, 'a')}) {
    EXPECT_EQ(reg.Heartbeat(*a, t0, bad).status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(reg.Snapshot(t0).shards[0].lanes, "shm (posix)");
  EXPECT_EQ(*reg.Heartbeat(*a, t0, "mixed (posix, tcp)"), true);
}

// A shard registers with grpc or its data-plane backend's name (ucx, shm, ...: shown on the
// page); anything that is not such a short lowercase name is refused, escaped in the error.
TEST(PlacementRegistry, ADataPlaneIsABackendsNameOrRefused) {
  PlacementRegistry reg(16);
  const Clock::time_point t0;
  for (const char* ok : {"grpc", "ucx", "shm", "fake"}) {
    EXPECT_TRUE(reg.Register(std::string("s-") + ok, "h:1", {{1, 0, 16}}, t0, ok).ok()) << ok;
  }
  for (const std::string& bad :
       {std::string(""), std::string("UCX"), std::string("shm\n"), std::string("<b>x</b>"),
        std::string(17, 'a'), std::string("s\x01m", 3)}) {
    auto r = reg.Register("s-bad", "h:1", {{1, 0, 16}}, t0, bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(r.status().message().find('\n'), std::string::npos);
  }
}

// A shard caught answering wrong bytes: out of the placement under its name until released,
// never the last replica of an expert.
TEST(PlacementRegistry, QuarantineKeepsALiarOutButNeverARangeDown) {
  using std::chrono::milliseconds;
  PlacementRegistry reg(16);
  const Clock::time_point t0;
  auto a = reg.Register("shard-0", "h:1", {{1, 0, 8}}, t0);
  auto b = reg.Register("shard-1", "h:2", {{1, 8, 16}}, t0);
  auto c = reg.Register("shard-1b", "h:3", {{1, 8, 16}}, t0);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(reg.Quarantine("nobody", "x").status().code(), absl::StatusCode::kNotFound);
  // shard-0 alone serves [0, 8): refused, and nothing changed.
  const uint64_t v0 = reg.version();
  EXPECT_EQ(reg.Quarantine("shard-0", "x").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(reg.version(), v0);
  EXPECT_EQ(reg.healthy_shards(), 3);
  ASSERT_EQ(*reg.Quarantine("shard-1b", "wrong answers"), true);
  EXPECT_EQ(*reg.Quarantine("shard-1b", "again"), false);
  EXPECT_EQ(reg.version(), v0 + 1);
  EXPECT_EQ(reg.healthy_shards(), 2);
  EXPECT_EQ(reg.quarantined_shards(), 1);
  // Now shard-1 is the last serving replica of [8, 16).
  EXPECT_EQ(reg.Quarantine("shard-1", "x").status().code(), absl::StatusCode::kFailedPrecondition);
  auto find = [&](Clock::time_point now, const std::string& name) {
    for (const ShardEntry& e : reg.Snapshot(now).shards) {
      if (e.name == name) return e;
    }
    ADD_FAILURE() << name << " not in the snapshot";
    return ShardEntry{};
  };
  ShardEntry q = find(t0, "shard-1b");
  EXPECT_FALSE(q.healthy);
  EXPECT_TRUE(q.quarantined);
  EXPECT_EQ(q.quarantine_reason, "wrong answers");
  std::vector<std::string> names;
  const std::vector<int32_t> owner = reg.ShardOfExpert(1, &names);
  ASSERT_EQ(owner.size(), 16u);
  for (int32_t o : owner) EXPECT_NE(names[static_cast<size_t>(o)], "shard-1b");
  // Heartbeats keep its lease alive, not its health.
  EXPECT_EQ(*reg.Heartbeat(*c, t0 + milliseconds(500)), false);
  EXPECT_FALSE(find(t0 + milliseconds(500), "shard-1b").healthy);
  // Removed as silent, then registered again: still quarantined.
  reg.RemoveGone(t0 + milliseconds(10000), milliseconds(5000));
  auto again = reg.Register("shard-1b", "h:4", {{1, 8, 16}}, t0 + milliseconds(10001));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(find(t0 + milliseconds(10001), "shard-1b").quarantined);
  EXPECT_FALSE(find(t0 + milliseconds(10001), "shard-1b").healthy);
  for (const ShardLoad& l : reg.ShardLoads(1, std::vector<int64_t>(16, 1))) {
    EXPECT_EQ(l.quarantined, l.name == "shard-1b") << l.name;
  }
  EXPECT_TRUE(reg.Release("shard-1b"));
  EXPECT_FALSE(reg.Release("shard-1b"));
  EXPECT_TRUE(find(t0 + milliseconds(10001), "shard-1b").healthy);
  EXPECT_EQ(reg.quarantined_shards(), 0);
}

TEST(PlacementRegistry, ShardMapsAndLoads) {
  PlacementRegistry reg(8);
  const Clock::time_point t0;
  ASSERT_TRUE(reg.Register("a", "h:1", {{1, 0, 3}, {2, 0, 8}}, t0).ok());
  std::vector<std::string> names;
  EXPECT_TRUE(reg.ShardOfExpert(1, &names).empty());  // experts 3..7 of layer 1 uncovered
  ASSERT_TRUE(reg.Register("b", "h:2", {{1, 3, 8}}, t0).ok());
  EXPECT_EQ(reg.ShardOfExpert(1, &names), (std::vector<int32_t>{0, 0, 0, 1, 1, 1, 1, 1}));
  EXPECT_EQ(names, (std::vector<std::string>{"a", "b"}));
  const std::vector<ShardLoad> loads = reg.ShardLoads(1, {1, 2, 3, 4, 5, 6, 7, 8});
  ASSERT_EQ(loads.size(), 2u);
  EXPECT_EQ(loads[0].load, 6);
  EXPECT_EQ(loads[1].load, 30);
  EXPECT_EQ(reg.ShardLoads(2, std::vector<int64_t>(8, 1))[0].load, 8);
}

TEST(BiasLedger, VersionsRollbackAndModes) {
  const std::vector<float> ckpt = {0.1f, -0.1f, 0.0f, 0.0f};
  BiasLedger l(3, ckpt, BiasMode::kRebalance, 100, /*now=*/1000);
  EXPECT_EQ(l.current().version, 0u);
  EXPECT_EQ(l.current().reason, "checkpoint");
  EXPECT_EQ(l.Append({1, 2, 3, 4}, "qb", 2000).version, 1u);
  EXPECT_EQ(l.Append({5, 6, 7, 8}, "qb", 3000).version, 2u);
  auto rb = l.Rollback(1, 4000);
  ASSERT_TRUE(rb.ok());
  EXPECT_EQ((*rb)->version, 3u);
  EXPECT_EQ((*rb)->bias, (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ((*rb)->reason, "rollback to 1");
  EXPECT_EQ(l.Rollback(9, 0).status().code(), absl::StatusCode::kNotFound);
  // Frozen restores the checkpoint bias as a new version; frozen again changes nothing.
  EXPECT_TRUE(*l.SetMode(BiasMode::kFrozen, 0, 5000));
  EXPECT_EQ(l.current().version, 4u);
  EXPECT_EQ(l.current().bias, ckpt);
  EXPECT_FALSE(*l.SetMode(BiasMode::kFrozen, 0, 5000));
  EXPECT_EQ(l.history().size(), 5u);
  EXPECT_EQ(l.Rollback(1, 0).status().code(), absl::StatusCode::kFailedPrecondition);
  // Continuous with a new token count; a negative count is refused and changes nothing.
  EXPECT_FALSE(*l.SetMode(BiasMode::kContinuous, 500, 6000));
  EXPECT_EQ(l.continuous_tokens(), 500);
  EXPECT_EQ(l.current().mode, BiasMode::kContinuous);
  EXPECT_FALSE(l.SetMode(BiasMode::kRebalance, -1, 0).ok());
  EXPECT_EQ(l.mode(), BiasMode::kContinuous);
  for (size_t i = 0; i < l.history().size(); ++i) EXPECT_EQ(l.history()[i].version, i);
  EXPECT_EQ(*ParseBiasMode("continuous"), BiasMode::kContinuous);
  EXPECT_FALSE(ParseBiasMode("melted").ok());
}

constexpr int64_t kExperts = 16, kTopK = 4;

// A node's report of `tokens` random tokens routed with `bias` at `version`.
StatsReport MakeReport(uint64_t version, int64_t tokens, uint64_t seed,
                       const std::vector<float>& bias = std::vector<float>(kExperts, 0.0f)) {
  numerics::QbWindow w;
  w.window_id = 1;
  w.bias_version = version;
  w.layer = 1;
  w.top_k = kTopK;
  auto h = numerics::QbHistogram::Create(w, bias);
  Rng rng(seed);
  std::vector<float> scores(static_cast<size_t>(tokens * kExperts));
  for (float& s : scores) s = static_cast<float>(rng.Uniform());
  EXPECT_TRUE(h->Accumulate(scores, tokens).ok());
  StatsReport r;
  r.node = "node-a";
  r.layer = 1;
  r.bias_version = version;
  r.tokens = tokens;
  r.loads = h->loads();
  r.qb_histogram = h->Serialize();
  return r;
}

TEST(LoadWindow, RefusedReportsChangeNothing) {
  LoadWindow w(1, kExperts, kTopK, 1 << 20);
  const StatsReport good = MakeReport(0, 50, 1);
  struct Case {
    std::string name, error;
    std::function<void(StatsReport&)> spoil;
  };
  for (const Case& c : std::vector<Case>{
           {"too few loads", "15 loads, layer 1 has 16 experts",
            [](auto& r) { r.loads.pop_back(); }},
           {"negative", "negative load", [](auto& r) { r.loads[0] = -r.loads[0] - 1; }},
           // Loads that would wrap int64 in the sum check (forged: 2^63 - 1 and -2^63 + ...).
           {"wrapping", "a load of 9223372036854775807 for 50 tokens",
            [](auto& r) {
              r.loads[0] = std::numeric_limits<int64_t>::max();
              r.loads[1] = std::numeric_limits<int64_t>::max();
            }},
           {"too many tokens", "at most 2^40 per report",
            [](auto& r) { r.tokens = int64_t{1} << 62; }},
           {"sum", "expected tokens * k = 200",
            [](auto& r) {
              r.loads[0] += 1;
              r.loads[1] -= 2;
            }},
           {"histogram shape", "does not match the report",
            [](auto& r) {
              r.tokens = 49;
              r.loads[0] -= 4;
            }},
           {"loads vs histogram", "loads differ from the histogram's",
            [](auto& r) {
              r.loads[0] += 1;
              r.loads[1] -= 1;
            }},
           {"garbage histogram", "", [](auto& r) { r.qb_histogram = "xyz"; }},
       }) {
    StatsReport r = good;
    c.spoil(r);
    auto got = w.Add(r, 0);
    ASSERT_FALSE(got.ok()) << c.name;
    EXPECT_NE(got.status().message().find(c.error), absl::string_view::npos)
        << c.name << ": " << got.status();
    EXPECT_EQ(w.total_tokens(), 0) << c.name;
    EXPECT_TRUE(w.empty()) << c.name;
  }
}

TEST(LoadWindow, CountsStaleReportsInTheTotalsOnlyAndBoundsTheWindow) {
  LoadWindow w(1, kExperts, kTopK, /*window_tokens=*/300);
  EXPECT_EQ(*w.Add(MakeReport(7, 40, 2), /*current=*/8), ReportResult::kStale);
  EXPECT_EQ(w.total_tokens(), 40);
  EXPECT_TRUE(w.empty());
  for (uint64_t i = 0; i < 10; ++i) {
    EXPECT_EQ(*w.Add(MakeReport(8, 100, 10 + i), 8), ReportResult::kCurrent);
  }
  // The newest reports covering window_tokens are kept: 3 x 100 tokens.
  EXPECT_EQ(w.window_tokens(), 300);
  EXPECT_EQ(w.reports(), 3u);
  int64_t sum = 0;
  for (int64_t v : w.window_loads()) sum += v;
  EXPECT_EQ(sum, 300 * kTopK);
  EXPECT_EQ(w.total_tokens(), 1040);
  // Many small reports fold into at most kMaxWindowReports.
  LoadWindow big(1, kExperts, kTopK, 1 << 20);
  for (uint64_t i = 0; i < 50; ++i) ASSERT_TRUE(big.Add(MakeReport(0, 5, 100 + i), 0).ok());
  EXPECT_EQ(big.reports(), static_cast<size_t>(kMaxWindowReports));
  EXPECT_EQ(big.window_tokens(), 250);
  EXPECT_EQ(big.Pooled()->tokens(), 250);
  w.Clear();
  EXPECT_TRUE(w.empty());
  EXPECT_EQ(w.window_tokens(), 0);
  EXPECT_EQ(w.total_tokens(), 1040);
}

TEST(LoadWindow, PlanRebalanceSolvesThePooledHistogram) {
  LoadWindow w(1, kExperts, kTopK, 1 << 20);
  EXPECT_EQ(PlanRebalance(w, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  // Three nodes report; the plan is the QB solution of their pooled histograms.
  numerics::QbHistogram pooled =
      *numerics::QbHistogram::Create({1, 0, 1, kTopK, 1000}, std::vector<float>(kExperts, 0.0f));
  for (uint64_t n = 0; n < 3; ++n) {
    StatsReport r = MakeReport(0, 200, 40 + n);
    auto h = numerics::QbHistogram::Deserialize(r.qb_histogram);
    ASSERT_TRUE(pooled.Merge(*h).ok());
    ASSERT_TRUE(w.Add(r, 0).ok());
  }
  auto plan = PlanRebalance(w, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->bias, pooled.Solve());  // the window's pooled histogram, nothing else
  EXPECT_EQ(plan->window_tokens, 600);
  EXPECT_LT(plan->predicted_after.max_vio, plan->before.max_vio + 1e-9);
  EXPECT_GT(plan->noise_floor_max_vio, 0);
}

metrics::HttpRequest Req(const std::string& method, const std::string& path,
                         std::map<std::string, std::string> query = {},
                         std::map<std::string, std::string> headers = {}) {
  metrics::HttpRequest r;
  r.method = method;
  r.path = path;
  r.query = std::move(query);
  r.headers = std::move(headers);
  return r;
}

TEST(LoadBalancePage, OnlyTheAdminTokenChangesTheBias) {
  int rebalances = 0;
  PageCallbacks cb;
  cb.layers = [] { return nlohmann::json{{"layers", {1}}}; };
  cb.state = [](int32_t layer) -> absl::StatusOr<nlohmann::json> {
    if (layer != 1) return absl::NotFoundError("layer 2 is not managed");
    return nlohmann::json{{"layer", 1}};
  };
  cb.rebalance = [&](int32_t) -> absl::StatusOr<nlohmann::json> {
    ++rebalances;
    return nlohmann::json{{"applied", true}};
  };
  cb.rollback = [](int32_t, uint64_t to) -> absl::StatusOr<nlohmann::json> {
    if (to > 3) return absl::NotFoundError("no bias version");
    return nlohmann::json{{"version", 4}};
  };
  const LoadBalancePage page("s3cret", cb), open_page("", cb);
  struct Case {
    const LoadBalancePage* page;
    metrics::HttpRequest req;
    int status;
    std::string body;
  };
  const std::map<std::string, std::string> good = {{"x-moe-admin-token", "s3cret"}};
  for (const Case& c : std::vector<Case>{
           {&page, Req("GET", "/"), 200, "<"},
           {&page, Req("GET", "/api/layers"), 200, "\"layers\""},
           {&page, Req("GET", "/api/state"), 400, "needs ?layer="},
           {&page, Req("GET", "/api/state", {{"layer", "2"}}), 404, "not managed"},
           {&page, Req("GET", "/api/state", {{"layer", "1"}}), 200, "\"layer\":1"},
           {&page, Req("GET", "/api/rebalance", {{"layer", "1"}}, good), 405, "POST only"},
           {&page, Req("POST", "/api/rebalance", {{"layer", "1"}}), 403, "token is required"},
           {&page, Req("POST", "/api/rebalance", {{"layer", "1"}}, {{"x-moe-admin-token", "no"}}),
            403, "token is wrong"},
           {&open_page, Req("POST", "/api/rebalance", {{"layer", "1"}}, good), 403,
            "started without an admin token"},
           {&page, Req("POST", "/api/rebalance", {{"layer", "1"}}, good), 200, "applied"},
           {&page, Req("POST", "/api/rollback", {{"layer", "1"}}, good), 400, "needs ?to="},
           {&page, Req("POST", "/api/rollback", {{"layer", "1"}, {"to", "9"}}, good), 404,
            "no bias version"},
           {&page, Req("POST", "/api/rollback", {{"layer", "1"}, {"to", "2"}}, good), 200,
            "\"version\":4"},
           {&page, Req("GET", "/nothing", {{"layer", "1"}}), 404, "not found"},
       }) {
    const metrics::HttpResponse r = c.page->Handle(c.req);
    EXPECT_EQ(r.status, c.status) << c.req.method << " " << c.req.path << ": " << r.body;
    EXPECT_NE(r.body.find(c.body), std::string::npos) << c.req.path << ": " << r.body;
  }
  EXPECT_EQ(rebalances, 1);  // only the authorized POST reached the router
}

}  // namespace
}  // namespace moe::router_svc
