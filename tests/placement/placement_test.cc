// Placement: the even split, the range table (JSON round trip, validation with the reason),
// the ordinal rule, host names, and the expert-to-shard map with replicas and health.
#include "services/placement/placement.h"

#include "gtest/gtest.h"

namespace moe::placement {
namespace {

TEST(EvenSplit, TilesTheExpertsWithSizesDifferingByAtMostOne) {
  for (auto [e, n] : std::vector<std::pair<int64_t, int64_t>>{
           {16, 1}, {16, 2}, {16, 3}, {128, 5}, {896, 2}, {896, 7}, {7, 7}}) {
    const std::vector<Range> r = EvenSplit(e, n);
    ASSERT_EQ(static_cast<int64_t>(r.size()), n);
    int64_t next = 0, smallest = e, largest = 0;
    for (const Range& x : r) {
      EXPECT_EQ(x.lo, next);
      next = x.hi;
      smallest = std::min(smallest, x.hi - x.lo);
      largest = std::max(largest, x.hi - x.lo);
    }
    EXPECT_EQ(next, e) << e << "/" << n;
    EXPECT_LE(largest - smallest, 1) << e << "/" << n;
  }
  // The Helm chart's rule, written out: [E i / n, E (i + 1) / n).
  EXPECT_EQ(EvenSplit(16, 3), (std::vector<Range>{{0, 5}, {5, 10}, {10, 16}}));
}

TEST(RangeTable, RoundTripsThroughJson) {
  const RangeTable t = EvenTable(128, 5, 3);
  auto back = ParseRangeTable(RangeTableJson(t));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->num_experts, 128);
  EXPECT_EQ(back->replicas_per_range, 3);
  EXPECT_EQ(back->ranges, t.ranges);
}

TEST(RangeTable, RefusesTablesThatDoNotTileTheExperts) {
  struct Case {
    std::string json, error;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"num_experts": 16, "ranges": [[0, 5], [6, 16]]})", "does not continue at 5"},
           {R"({"num_experts": 16, "ranges": [[0, 8]]})", "end at 8, not at E = 16"},
           {R"({"num_experts": 16, "ranges": [[0, 0], [0, 16]]})", "does not continue at 0"},
           {R"({"num_experts": 16, "ranges": [[0, 16]], "replicas_per_range": 0})",
            "replicas_per_range < 1"},
           {R"({"num_experts": 16, "ranges": [[0, 16, 3]]})", "each range is [lo, hi]"},
           {R"({"ranges": [[0, 16]]})", "expected {"},
           {"not json", "expected {"},
       }) {
    auto t = ParseRangeTable(c.json);
    ASSERT_FALSE(t.ok()) << c.json;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(c.error), absl::string_view::npos)
        << c.json << ": " << t.status();
  }
}

TEST(RangeForOrdinal, ReplicasOfARangeAreConsecutiveOrdinals) {
  auto t = ParseRangeTable(
      R"({"num_experts": 16, "replicas_per_range": 2, "ranges": [[0, 5], [5, 11], [11, 16]]})");
  ASSERT_TRUE(t.ok());
  const std::vector<Range> want = {{0, 5}, {0, 5}, {5, 11}, {5, 11}, {11, 16}, {11, 16}};
  for (int64_t o = 0; o < 6; ++o) {
    auto r = RangeForOrdinal(*t, o);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(*r, want[o]) << "ordinal " << o;
  }
  EXPECT_FALSE(RangeForOrdinal(*t, 6).ok());
  EXPECT_FALSE(RangeForOrdinal(*t, -1).ok());
}

TEST(OrdinalFromHostname, ReadsTheTrailingNumber) {
  EXPECT_EQ(*OrdinalFromHostname("moe-serving-expert-12"), 12);
  EXPECT_EQ(*OrdinalFromHostname("x-0"), 0);
  for (const char* bad : {"localhost", "pod-x", "pod-", ""}) {
    EXPECT_FALSE(OrdinalFromHostname(bad).ok()) << bad;
  }
}

ShardRef Shard(const std::string& name, int32_t lo, int32_t hi, bool healthy = true) {
  return {name, "127.0.0.1:" + std::to_string(5000 + lo), lo, hi, healthy, 0};
}

TEST(BuildRoute, OrdersShardsAndPrefersHealthyReplicas) {
  struct Case {
    std::string name;
    std::vector<ShardRef> shards;
    std::vector<std::string> owner_of;  // per expert of E = 4; "" when nobody
    bool covered;
  };
  const std::vector<Case> cases = {
      {"two ranges, given out of order",
       {Shard("b", 2, 4), Shard("a", 0, 2)},
       {"a", "a", "b", "b"},
       true},
      {"a gap", {Shard("a", 0, 2), Shard("b", 3, 4)}, {"a", "a", "", "b"}, false},
      {"the healthy replica wins",
       {Shard("r0", 0, 4, /*healthy=*/false), Shard("r1", 0, 4)},
       {"r1", "r1", "r1", "r1"},
       true},
      {"equal replicas: the first by name",
       {Shard("z", 0, 4), Shard("m", 0, 4)},
       {"m", "m", "m", "m"},
       true},
      {"only unhealthy", {Shard("a", 0, 4, false)}, {"a", "a", "a", "a"}, false},
      {"a range past E is clipped", {Shard("a", 0, 9)}, {"a", "a", "a", "a"}, true},
      {"nothing placed", {}, {"", "", "", ""}, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const LayerRoute r = BuildRoute(1, 4, c.shards);
    for (size_t i = 1; i < r.shards.size(); ++i) EXPECT_LE(r.shards[i - 1].lo, r.shards[i].lo);
    ASSERT_EQ(r.owner.size(), 4u);
    for (int e = 0; e < 4; ++e) {
      EXPECT_EQ(r.owner[e] < 0 ? "" : r.shards[r.owner[e]].shard, c.owner_of[e]) << "expert " << e;
    }
    EXPECT_EQ(Covered(r), c.covered);
  }
}

// What a shard may serve comes from the deployment: the chart's table by the ordinal the pod
// name ends in, or moe-cli up's explicit names; never the shard's claim.
TEST(ShardAllowance, TheTableOrTheNamesDecideAShardsRange) {
  auto table = ParseShardAllowance(RangeTableJson(EvenTable(896, 2, 2)));  // 2 ranges x 2
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_TRUE(CheckShardRange(*table, "moe-expert-0", {0, 448}).ok());
  EXPECT_TRUE(CheckShardRange(*table, "moe-expert-1", {0, 448}).ok());  // its replica
  EXPECT_TRUE(CheckShardRange(*table, "moe-expert-3", {448, 896}).ok());
  EXPECT_TRUE(CheckShardRange(*table, "moe-expert-2", {500, 600}).ok());  // within
  const absl::Status wide = CheckShardRange(*table, "moe-expert-0", {0, 896});
  EXPECT_EQ(wide.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(wide.message(),
            "shard moe-expert-0 may serve experts [0, 448) (the deployment's ranges file), not "
            "the range [0, 896) it registered");
  EXPECT_EQ(CheckShardRange(*table, "a-evil", {0, 1}).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(CheckShardRange(*table, "moe-expert-4", {0, 1}).code(),
            absl::StatusCode::kPermissionDenied);  // past the table's pods

  auto named = ParseShardAllowance(R"({"shards": {"shard-0": [0, 8], "shard-1": [8, 16]}})");
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_TRUE(CheckShardRange(*named, "shard-1", {8, 16}).ok());
  EXPECT_EQ(CheckShardRange(*named, "shard-1", {0, 16}).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(CheckShardRange(*named, "shard-2", {8, 16}).code(),
            absl::StatusCode::kPermissionDenied);
  for (const char* bad : {R"({"shards": {}})", R"({"shards": {"a": [5, 5]}})",
                          R"({"shards": {"a": "x"}})", R"({"shards": []})", "[]", "not json"}) {
    EXPECT_EQ(ParseShardAllowance(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace moe::placement
