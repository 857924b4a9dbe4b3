#include "services/placement/placement.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace moe::placement {

std::vector<Range> EvenSplit(int64_t num_experts, int64_t n) {
  std::vector<Range> out;
  for (int64_t i = 0; i < n; ++i) out.push_back({num_experts * i / n, num_experts * (i + 1) / n});
  return out;
}

RangeTable EvenTable(int64_t num_experts, int64_t shards, int64_t replicas_per_range) {
  return {num_experts, replicas_per_range, EvenSplit(num_experts, shards)};
}

absl::StatusOr<RangeTable> ParseRangeTable(const std::string& json) {
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("ranges") || !j["ranges"].is_array() ||
      !j.contains("num_experts") || !j["num_experts"].is_number_integer()) {
    return absl::InvalidArgumentError(
        "ranges file: expected {\"num_experts\": E, \"replicas_per_range\": R, \"ranges\": "
        "[[lo, hi], ...]}");
  }
  RangeTable t;
  t.num_experts = j["num_experts"].get<int64_t>();
  t.replicas_per_range =
      j.contains("replicas_per_range") && j["replicas_per_range"].is_number_integer()
          ? j["replicas_per_range"].get<int64_t>()
          : 1;
  if (t.replicas_per_range < 1) {
    return absl::InvalidArgumentError("ranges file: replicas_per_range < 1");
  }
  int64_t next = 0;
  for (const auto& r : j["ranges"]) {
    if (!r.is_array() || r.size() != 2 || !r[0].is_number_integer() || !r[1].is_number_integer()) {
      return absl::InvalidArgumentError("ranges file: each range is [lo, hi]");
    }
    const int64_t lo = r[0].get<int64_t>(), hi = r[1].get<int64_t>();
    if (lo != next || hi <= lo) {
      return absl::InvalidArgumentError(absl::StrCat("ranges file: range [", lo, ", ", hi,
                                                     ") does not continue at ", next,
                                                     " (ranges must tile [0, E) in order)"));
    }
    t.ranges.push_back({lo, hi});
    next = hi;
  }
  if (next != t.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("ranges file: the ranges end at ", next, ", not at E = ", t.num_experts));
  }
  return t;
}

std::string RangeTableJson(const RangeTable& t) {
  nlohmann::json ranges = nlohmann::json::array();
  for (const Range& r : t.ranges) ranges.push_back({r.lo, r.hi});
  return nlohmann::json{{"num_experts", t.num_experts},
                        {"replicas_per_range", t.replicas_per_range},
                        {"ranges", ranges}}
      .dump();
}

absl::StatusOr<Range> RangeForOrdinal(const RangeTable& t, int64_t ordinal) {
  const int64_t pods = static_cast<int64_t>(t.ranges.size()) * t.replicas_per_range;
  if (ordinal < 0 || ordinal >= pods) {
    return absl::InvalidArgumentError(absl::StrCat("ordinal ", ordinal, " outside [0, ", pods,
                                                   ") (", t.ranges.size(), " ranges x ",
                                                   t.replicas_per_range, " replicas)"));
  }
  return t.ranges[static_cast<size_t>(ordinal / t.replicas_per_range)];
}

absl::StatusOr<int64_t> OrdinalFromHostname(const std::string& hostname) {
  const size_t dash = hostname.rfind('-');
  int64_t ordinal = -1;
  if (dash == std::string::npos ||
      !absl::SimpleAtoi(absl::string_view(hostname).substr(dash + 1), &ordinal) || ordinal < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read a StatefulSet ordinal from the host name '", hostname, "'"));
  }
  return ordinal;
}

absl::StatusOr<Range> PodRange(const std::string& ranges_json, int64_t ordinal,
                               const std::string& hostname) {
  if (ordinal < 0) {
    absl::StatusOr<int64_t> o = OrdinalFromHostname(hostname);
    if (!o.ok()) return o.status();
    ordinal = *o;
  }
  absl::StatusOr<RangeTable> table = ParseRangeTable(ranges_json);
  if (!table.ok()) return table.status();
  return RangeForOrdinal(*table, ordinal);
}

LayerRoute BuildRoute(int32_t layer, int32_t num_experts, std::vector<ShardRef> shards) {
  LayerRoute route;
  route.layer = layer;
  route.shards = std::move(shards);
  std::sort(route.shards.begin(), route.shards.end(), [](const ShardRef& a, const ShardRef& b) {
    return a.lo != b.lo ? a.lo < b.lo : a.shard < b.shard;
  });
  route.owner.assign(static_cast<size_t>(num_experts), -1);
  for (size_t i = 0; i < route.shards.size(); ++i) {
    const ShardRef& s = route.shards[i];
    for (int32_t e = std::max(0, s.lo); e < std::min(s.hi, num_experts); ++e) {
      int32_t& o = route.owner[e];
      // A healthy replica wins over an unhealthy one; among equals the first (lowest lo).
      if (o < 0 || (!route.shards[o].healthy && s.healthy)) o = static_cast<int32_t>(i);
    }
  }
  return route;
}

bool Covered(const LayerRoute& route) {
  for (int32_t o : route.owner) {
    if (o < 0 || !route.shards[o].healthy) return false;
  }
  return true;
}

absl::StatusOr<ShardAllowance> ParseShardAllowance(const std::string& json) {
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  ShardAllowance a;
  if (j.is_object() && j.contains("shards")) {
    if (!j["shards"].is_object() || j["shards"].empty()) {
      return absl::InvalidArgumentError(
          "ranges file: \"shards\" must map each shard name to [lo, hi]");
    }
    for (const auto& [name, r] : j["shards"].items()) {
      if (!r.is_array() || r.size() != 2 || !r[0].is_number_integer() ||
          !r[1].is_number_integer() || r[0].get<int64_t>() < 0 ||
          r[1].get<int64_t>() <= r[0].get<int64_t>()) {
        return absl::InvalidArgumentError(
            absl::StrCat("ranges file: shard ", name, ": expected [lo, hi] with 0 <= lo < hi"));
      }
      a.by_name.emplace_back(name, Range{r[0].get<int64_t>(), r[1].get<int64_t>()});
    }
    return a;
  }
  absl::StatusOr<RangeTable> t = ParseRangeTable(json);
  if (!t.ok()) return t.status();
  a.table = *std::move(t);
  return a;
}

absl::Status CheckShardRange(const ShardAllowance& a, const std::string& shard, Range claimed) {
  absl::StatusOr<Range> allowed = absl::NotFoundError("");
  if (!a.by_name.empty()) {
    for (const auto& [name, r] : a.by_name) {
      if (name == shard) allowed = r;
    }
  } else {
    absl::StatusOr<int64_t> ordinal = OrdinalFromHostname(shard);
    if (ordinal.ok()) allowed = RangeForOrdinal(a.table, *ordinal);
  }
  if (!allowed.ok()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "shard ", shard, " may serve no experts: the deployment's ranges file names no such shard",
        a.by_name.empty() ? " (a StatefulSet pod name ending in an ordinal of the table)" : ""));
  }
  if (claimed.lo < allowed->lo || claimed.hi > allowed->hi) {
    return absl::PermissionDeniedError(
        absl::StrCat("shard ", shard, " may serve experts [", allowed->lo, ", ", allowed->hi,
                     ") (the deployment's ranges file), not the range [", claimed.lo, ", ",
                     claimed.hi, ") it registered"));
  }
  return absl::OkStatus();
}

}  // namespace moe::placement
