#include "router-svc/placement_registry.h"

#include <algorithm>
#include <mutex>
#include <random>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/placement/placement.h"

namespace moe::router_svc {

absl::StatusOr<uint64_t> PlacementRegistry::Register(const std::string& shard,
                                                     const std::string& endpoint,
                                                     const std::vector<LayerRange>& ranges,
                                                     Clock::time_point now,
                                                     const std::string& data_plane) {
  if (shard.empty() || endpoint.empty()) {
    return absl::InvalidArgumentError("registration needs a shard name and an endpoint");
  }
  if (ranges.empty()) return absl::InvalidArgumentError("registration without ranges");
  // grpc or a backend of expert-svc's registry (ucx, shm, fake): a short lowercase name; the
  // router only shows it.
  const bool named = !data_plane.empty() && data_plane.size() <= 16 &&
                     std::all_of(data_plane.begin(), data_plane.end(), [](char c) {
                       return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
                     });
  if (!named) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard ", shard, ": data plane '", absl::CHexEscape(data_plane.substr(0, 32)),
                     "' is not a backend's name (grpc, ucx, shm: up to 16 of a-z, 0-9, _)"));
  }
  for (const LayerRange& r : ranges) {
    if (r.lo < 0 || r.lo >= r.hi || r.hi > num_experts_) {
      return absl::InvalidArgumentError(absl::StrCat("shard ", shard, ": range [", r.lo, ", ", r.hi,
                                                     ") of layer ", r.layer, " is invalid"));
    }
  }
  if (shards_.count(shard) == 0 && static_cast<int64_t>(shards_.size()) >= max_shards_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("registration of ", shard, ": ", max_shards_, " shards registered already"));
  }
  if (shard.size() > 253 || endpoint.size() > 1024 || ranges.size() > 1024) {
    return absl::InvalidArgumentError("registration: shard name, endpoint or ranges too long");
  }
  if (auto live = shards_.find(shard); live != shards_.end() && live->second.healthy &&
                                       now - live->second.last_seen <= lease_lifetime_) {
    const auto ms = [](Clock::duration d) {
      return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
    };
    return absl::AlreadyExistsError(absl::StrCat(
        "shard ", shard, " is registered at ", live->second.endpoint,
        " under a live lease (last heartbeat ", ms(now - live->second.last_seen),
        " ms ago): no other registration takes its name until its heartbeats stop for ",
        ms(lease_lifetime_), " ms"));
  }
  Shard& s = shards_[shard];
  s.endpoint = endpoint;
  s.ranges = ranges;
  s.lease = NewLease();
  s.last_seen = now;
  s.healthy = true;
  s.data_plane = data_plane;
  ++version_;
  return s.lease;
}

absl::Status PlacementRegistry::Restore(const std::string& shard, const std::string& endpoint,
                                        const std::vector<LayerRange>& ranges, uint64_t lease,
                                        Clock::time_point now, const std::string& data_plane) {
  if (lease == 0) return absl::DataLossError(absl::StrCat("shard ", shard, ": lease 0"));
  for (const auto& [name, s] : shards_) {
    if (s.lease == lease) {
      return absl::DataLossError(absl::StrCat("shards ", name, " and ", shard, " share a lease"));
    }
  }
  MOE_ASSIGN_OR_RETURN(uint64_t fresh, Register(shard, endpoint, ranges, now, data_plane));
  (void)fresh;
  shards_[shard].lease = lease;
  return absl::OkStatus();
}

uint64_t PlacementRegistry::LeaseOf(const std::string& shard) const {
  auto it = shards_.find(shard);
  return it == shards_.end() ? 0 : it->second.lease;
}

std::string PlacementRegistry::ShardOfLease(uint64_t lease) const {
  for (const auto& [name, s] : shards_) {
    if (s.lease == lease && lease != 0) return name;
  }
  return "";
}

uint64_t PlacementRegistry::NewLease() const {
  static std::mutex mu;
  static std::random_device device;  // the kernel's CSPRNG
  std::lock_guard<std::mutex> lock(mu);
  for (;;) {
    const uint64_t lease = (static_cast<uint64_t>(device()) << 32) ^ device();
    bool used = lease == 0;
    for (const auto& [name, s] : shards_) used |= s.lease == lease;
    if (!used) return lease;
  }
}

absl::StatusOr<bool> PlacementRegistry::Heartbeat(uint64_t lease, Clock::time_point now,
                                                  const std::string& lanes) {
  if (lanes.size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("data_plane_lanes of ", lanes.size(), " bytes (at most 128)"));
  }
  // What UcxLanes::Describe writes: letters, digits, spaces and ( ) , . _ - (nothing a page
  // could take for markup).
  for (char c : lanes) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == ' ' || c == '(' || c == ')' || c == ',' || c == '.' || c == '_' ||
                    c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          "data_plane_lanes may hold letters, digits, spaces and ( ) , . _ - only");
    }
  }
  for (auto& [name, s] : shards_) {
    if (s.lease != lease) continue;
    s.last_seen = now;
    const bool new_lanes = !lanes.empty() && lanes != s.lanes;
    if (new_lanes) s.lanes = lanes;
    if (s.healthy && !new_lanes) return false;
    s.healthy = true;
    ++version_;
    return true;
  }
  return absl::NotFoundError(absl::StrCat("lease ", lease, " is unknown: register"));
}

std::vector<std::string> PlacementRegistry::ExpireStale(Clock::time_point now,
                                                        Clock::duration stale) {
  std::vector<std::string> expired;
  for (auto& [name, s] : shards_) {
    if (s.healthy && now - s.last_seen > stale) {
      s.healthy = false;
      expired.push_back(name);
    }
  }
  if (!expired.empty()) ++version_;
  return expired;
}

PlacementSnapshot PlacementRegistry::Snapshot(Clock::time_point now) const {
  PlacementSnapshot p;
  p.version = version_;
  for (const auto& [name, s] : shards_) {
    auto q = quarantine_.find(name);
    p.shards.push_back(
        {name, s.endpoint, s.ranges, s.lease, Serving(name, s),
         std::max<int64_t>(
             0, std::chrono::duration_cast<std::chrono::milliseconds>(now - s.last_seen).count()),
         s.data_plane, s.lanes, q != quarantine_.end(), q != quarantine_.end() ? q->second : ""});
  }
  return p;
}

int64_t PlacementRegistry::healthy_shards() const {
  int64_t n = 0;
  for (const auto& [name, s] : shards_) n += Serving(name, s) ? 1 : 0;
  return n;
}

absl::StatusOr<bool> PlacementRegistry::Quarantine(const std::string& shard,
                                                   const std::string& reason) {
  auto it = shards_.find(shard);
  if (it == shards_.end()) {
    return absl::NotFoundError(absl::StrCat("shard ", shard, " is not registered"));
  }
  if (quarantine_.count(shard) != 0) return false;
  // Every expert of its ranges keeps another serving replica.
  for (const LayerRange& r : it->second.ranges) {
    for (int32_t e = r.lo; e < r.hi; ++e) {
      bool covered = false;
      for (const auto& [name, o] : shards_) {
        if (name == shard || !Serving(name, o)) continue;
        for (const LayerRange& x : o.ranges) {
          covered |= x.layer == r.layer && x.lo <= e && e < x.hi;
        }
        if (covered) break;
      }
      if (!covered) {
        return absl::FailedPreconditionError(absl::StrCat(
            "shard ", shard, " is the last healthy replica of expert ", e, " of layer ", r.layer,
            ": not quarantined (one report takes a replica "
            "out, never a range down)"));
      }
    }
  }
  quarantine_[shard] = reason;
  ++version_;
  return true;
}

bool PlacementRegistry::Release(const std::string& shard) {
  if (quarantine_.erase(shard) == 0) return false;
  ++version_;
  return true;
}

std::vector<int32_t> PlacementRegistry::ShardOfExpert(int32_t layer,
                                                      std::vector<std::string>* names) const {
  // The same expert-to-shard rule as the attention nodes (services/placement).
  std::vector<placement::ShardRef> refs;
  for (const auto& [name, s] : shards_) {
    for (const LayerRange& r : s.ranges) {
      if (r.layer == layer) refs.push_back({name, s.endpoint, r.lo, r.hi, Serving(name, s), 0});
    }
  }
  const placement::LayerRoute route =
      placement::BuildRoute(layer, static_cast<int32_t>(num_experts_), std::move(refs));
  if (names != nullptr) names->clear();
  for (int32_t o : route.owner) {
    if (o < 0) return {};
  }
  if (names != nullptr) {
    for (const placement::ShardRef& s : route.shards) names->push_back(s.shard);
  }
  return route.owner;
}

std::vector<ShardLoad> PlacementRegistry::ShardLoads(int32_t layer,
                                                     const std::vector<int64_t>& loads) const {
  std::vector<ShardLoad> out;
  for (const auto& [name, s] : shards_) {
    for (const LayerRange& r : s.ranges) {
      if (r.layer != layer) continue;
      int64_t load = 0;
      for (int32_t e = r.lo; e < r.hi; ++e) load += loads[e];
      out.push_back({name, r.lo, r.hi, load, Serving(name, s), s.data_plane, s.lanes,
                     quarantine_.count(name) != 0});
    }
  }
  return out;
}

std::vector<std::string> PlacementRegistry::RemoveGone(Clock::time_point now,
                                                       Clock::duration gone) {
  std::vector<std::string> removed;
  for (auto it = shards_.begin(); it != shards_.end();) {
    if (now - it->second.last_seen > gone) {
      removed.push_back(it->first);
      it = shards_.erase(it);
    } else {
      ++it;
    }
  }
  if (!removed.empty()) ++version_;
  return removed;
}

}  // namespace moe::router_svc
