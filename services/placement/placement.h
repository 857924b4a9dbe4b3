// Placement: the one model of which expert servers serve which experts of which layers. Every
// component derives its view from here, so they cannot disagree:
//  * the range table: [0, E) cut into contiguous ranges, each served by replicas_per_range
//    servers; EvenSplit is the default rule, RangeTable its JSON form (the Helm chart's
//    ranges.json, rendered by the chart with the same integer rule and checked against
//    `moe-tool ranges` by tests/deploy/chart_test.sh);
//  * the ordinal rule: StatefulSet pod o serves ranges[o / replicas_per_range] (expert-svc);
//  * the expert-to-shard map of one layer, with replicas and health (LayerRoute: attention-svc
//    routes every expert to one healthy shard).
// router-svc keeps the registry of which shard serves what and its health; this library holds
// no state and has no wire types.
//
//   const RangeTable t = EvenTable(/*num_experts=*/896, /*shards=*/2, /*replicas=*/1);
//   MOE_ASSIGN_OR_RETURN(Range r, RangeForOrdinal(t, /*ordinal=*/1));  // [448, 896)
//   LayerRoute route = BuildRoute(layer, E, shards);  // shards: from router-svc's placement
#ifndef MOE_SERVICES_PLACEMENT_PLACEMENT_H_
#define MOE_SERVICES_PLACEMENT_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::placement {

// Experts [lo, hi).
struct Range {
  int64_t lo = 0, hi = 0;
  bool operator==(const Range& o) const { return lo == o.lo && hi == o.hi; }
};

// [0, E) in n contiguous ranges [E i / n, E (i + 1) / n), sizes differing by at most one.
std::vector<Range> EvenSplit(int64_t num_experts, int64_t n);

struct RangeTable {
  int64_t num_experts = 0;
  int64_t replicas_per_range = 1;
  std::vector<Range> ranges;  // tile [0, E) in order
};

RangeTable EvenTable(int64_t num_experts, int64_t shards, int64_t replicas_per_range);
// {"num_experts": E, "replicas_per_range": R, "ranges": [[lo, hi], ...]}; the ranges must be
// non-empty and tile [0, E) in order (INVALID_ARGUMENT says where they do not).
absl::StatusOr<RangeTable> ParseRangeTable(const std::string& json);
std::string RangeTableJson(const RangeTable& t);
// The range StatefulSet pod `ordinal` serves: ranges[ordinal / replicas_per_range].
absl::StatusOr<Range> RangeForOrdinal(const RangeTable& t, int64_t ordinal);
// "moe-serving-expert-7" -> 7 (a StatefulSet pod's host name ends in its ordinal).
absl::StatusOr<int64_t> OrdinalFromHostname(const std::string& hostname);
// The range of one pod from the table's JSON (ranges.json) and its ordinal; ordinal < 0 reads
// it from the host name (expert-svc and the pod's synthetic-checkpoint init container).
absl::StatusOr<Range> PodRange(const std::string& ranges_json, int64_t ordinal,
                               const std::string& hostname);

// Which experts a shard may serve, from the deployment (router-svc --ranges_file), never from
// the shard's own claim: the range table by the StatefulSet ordinal its name ends in (the
// chart's ranges.json, pod "<release>-expert-<o>"), or, where the file names the shards
// ({"shards": {"shard-0": [lo, hi], ...}}, what `moe-cli up` writes), by name.
struct ShardAllowance {
  RangeTable table;  // used when by_name is empty
  std::vector<std::pair<std::string, Range>> by_name;
};
absl::StatusOr<ShardAllowance> ParseShardAllowance(const std::string& json);
// OK when [claimed.lo, claimed.hi) lies in what the shard may serve; PERMISSION_DENIED naming
// the shard, the claimed range and the allowed one (or that the name has none).
absl::Status CheckShardRange(const ShardAllowance& a, const std::string& shard, Range claimed);

// One expert server's range of one layer as the control plane reports it.
struct ShardRef {
  std::string shard, endpoint;
  int32_t lo = 0, hi = 0;  // experts [lo, hi)
  bool healthy = false;
  int64_t last_seen_ms = 0;
};

// Which shard serves each expert of one layer, from one placement version.
struct LayerRoute {
  int32_t layer = 0;
  std::vector<ShardRef> shards;  // ascending expert_lo, then name (the partial-sum order)
  std::vector<int32_t> owner;    // [E] index into shards, -1: nobody hosts it
};

// A layer's route from the shards that host some of its experts (any order): a healthy shard
// wins an expert over an unhealthy one; among equals the first by (lo, name).
LayerRoute BuildRoute(int32_t layer, int32_t num_experts, std::vector<ShardRef> shards);
// Whether every expert has a healthy owner.
bool Covered(const LayerRoute& route);

}  // namespace moe::placement

#endif  // MOE_SERVICES_PLACEMENT_PLACEMENT_H_
