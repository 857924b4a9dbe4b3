// router-svc's registry of expert servers: which shard serves which expert ranges of which
// layers, under which lease, and whether its heartbeats still arrive. It owns that state and
// nothing else; the gRPC adapter (router_server.cc) holds the lock, passes the time in, and
// publishes each new snapshot to the WatchPlacement streams.
//
//   PlacementRegistry reg(/*num_experts=*/128);
//   MOE_ASSIGN_OR_RETURN(uint64_t lease, reg.Register("shard-0", "10.0.0.1:5001", ranges, now));
//   reg.Heartbeat(lease, now);                  // true when the shard came back to health
//   reg.ExpireStale(now, std::chrono::milliseconds(1500));  // names that just went unhealthy
#ifndef MOE_ROUTER_SVC_PLACEMENT_REGISTRY_H_
#define MOE_ROUTER_SVC_PLACEMENT_REGISTRY_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe::router_svc {

using Clock = std::chrono::steady_clock;

struct LayerRange {
  int32_t layer = 0;
  int32_t lo = 0, hi = 0;  // experts [lo, hi)
};

struct ShardEntry {
  std::string name, endpoint;
  std::vector<LayerRange> ranges;
  uint64_t lease = 0;
  bool healthy = true;
  int64_t last_seen_ms = 0;  // ago, at the snapshot
  std::string data_plane;    // what the shard offers: "ucx" or "grpc"
  std::string lanes;         // the UCX lanes it reports ("shm (posix)"), "" before any
  bool quarantined = false;  // caught answering wrong bytes (healthy is then false)
  std::string quarantine_reason;
};

struct PlacementSnapshot {
  uint64_t version = 0;
  std::vector<ShardEntry> shards;  // by name
};

// The window's routed rows on one registered range.
struct ShardLoad {
  std::string name;
  int32_t lo = 0, hi = 0;
  int64_t load = 0;
  bool healthy = false;
  std::string data_plane;
  std::string lanes;
  bool quarantined = false;
};

class PlacementRegistry {
 public:
  // lease_lifetime: how long a lease lives after its last heartbeat (the router's missed
  // heartbeats times their interval); while it lives, no other registration takes its name.
  explicit PlacementRegistry(int64_t num_experts, int64_t max_shards = 4096,
                             Clock::duration lease_lifetime = std::chrono::milliseconds(1500))
      : num_experts_(num_experts), max_shards_(max_shards), lease_lifetime_(lease_lifetime) {}

  // A new shard, or one whose lease has died (no heartbeat for lease_lifetime, or expired):
  // a re-registration replaces its ranges and lease (a restarted pod). Returns the lease id;
  // INVALID_ARGUMENT for a missing name or endpoint or an invalid range, RESOURCE_EXHAUSTED for
  // a new shard past max_shards, ALREADY_EXISTS while the name's lease lives (a second process
  // under a live shard's name never displaces it; the same shard restarted registers once its
  // old lease has died, within lease_lifetime).
  absl::StatusOr<uint64_t> Register(const std::string& shard, const std::string& endpoint,
                                    const std::vector<LayerRange>& ranges, Clock::time_point now,
                                    const std::string& data_plane = "grpc");
  // A registration from before a restart (its lease kept, so its heartbeats go on), healthy
  // until `seen` (which may lie ahead: a grace for the shards' channels to reconnect), then
  // expired like any other if no heartbeat comes.
  absl::Status Restore(const std::string& shard, const std::string& endpoint,
                       const std::vector<LayerRange>& ranges, uint64_t lease, Clock::time_point now,
                       const std::string& data_plane);
  // The lease of a registered shard (0: none), and the shard of a lease ("": none).
  uint64_t LeaseOf(const std::string& shard) const;
  std::string ShardOfLease(uint64_t lease) const;
  // NOT_FOUND for an unknown lease; true when the shard was unhealthy and is healthy again, or
  // reports other lanes than before (a new placement version). lanes: at most 128 bytes of
  // letters, digits, spaces and ( ) , . _ -, else INVALID_ARGUMENT; "" keeps what was reported.
  absl::StatusOr<bool> Heartbeat(uint64_t lease, Clock::time_point now,
                                 const std::string& lanes = "");
  // Marks shards silent for longer than `stale` unhealthy; returns their names.
  std::vector<std::string> ExpireStale(Clock::time_point now, Clock::duration stale);
  // Removes shards silent for longer than `gone` (their lease is then unknown: a heartbeat gets
  // NOT_FOUND and the shard registers again); returns their names.
  std::vector<std::string> RemoveGone(Clock::time_point now, Clock::duration gone);

  // A shard caught answering wrong bytes leaves the placement under its name (unhealthy while
  // its lease lives on; across heartbeats, re-registrations and removal) until Release. Returns
  // whether it was newly quarantined; NOT_FOUND for an unregistered name; FAILED_PRECONDITION
  // when an expert of one of its ranges would be left without another healthy replica.
  absl::StatusOr<bool> Quarantine(const std::string& shard, const std::string& reason);
  // Whether a quarantine was lifted.
  bool Release(const std::string& shard);
  int64_t quarantined_shards() const { return static_cast<int64_t>(quarantine_.size()); }

  // Every change (registration, health, quarantine) makes a new version.
  uint64_t version() const { return version_; }
  PlacementSnapshot Snapshot(Clock::time_point now) const;
  int64_t shards() const { return static_cast<int64_t>(shards_.size()); }
  int64_t healthy_shards() const;

  // Expert -> shard id of one layer (names[id] when names is given), by placement::BuildRoute
  // (a healthy replica first); empty unless every expert is covered.
  std::vector<int32_t> ShardOfExpert(int32_t layer,
                                     std::vector<std::string>* names = nullptr) const;
  // loads [E] summed over every registered range of the layer.
  std::vector<ShardLoad> ShardLoads(int32_t layer, const std::vector<int64_t>& loads) const;

 private:
  struct Shard {
    std::string endpoint;
    std::vector<LayerRange> ranges;
    uint64_t lease = 0;
    Clock::time_point last_seen;
    bool healthy = true;
    std::string data_plane;
    std::string lanes;
  };
  const int64_t num_experts_;
  const int64_t max_shards_;
  const Clock::duration lease_lifetime_;
  std::map<std::string, Shard> shards_;
  std::map<std::string, std::string> quarantine_;  // name -> why
  // Alive (heartbeats arrive) and not quarantined: what the placement calls healthy.
  bool Serving(const std::string& name, const Shard& s) const {
    return s.healthy && quarantine_.count(name) == 0;
  }
  // Leases are random 64-bit numbers (never 0, never one in use): a lease cannot be guessed,
  // and one from before a restart does not name another shard's registration after it.
  uint64_t NewLease() const;
  uint64_t version_ = 1;
};

}  // namespace moe::router_svc

#endif  // MOE_ROUTER_SVC_PLACEMENT_REGISTRY_H_
