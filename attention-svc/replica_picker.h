// Which replica of an expert range serves a message. Shards that host the same range of a layer
// are replicas of each other; a message may go to any healthy one. The picker sends it to the
// one with the least outstanding work here (ties in turn), and keeps away for a while from one
// whose call just failed (UNAVAILABLE: gone or restarting), so that the attention node fails over
// to another replica within the request's deadline instead of failing the request.
//
//   std::vector<size_t> replicas = ReplicasOf(route, message.shard);
//   size_t target = picker.Pick(route, replicas, /*tried=*/{});
//   picker.Started(route.shards[target]);  ...  picker.Finished(route.shards[target], ok);
#ifndef MOE_ATTENTION_SVC_REPLICA_PICKER_H_
#define MOE_ATTENTION_SVC_REPLICA_PICKER_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "services/placement/placement.h"

namespace moe::attention_svc {

// The healthy shards of route with the same [lo, hi) as route.shards[shard], that one first.
std::vector<size_t> ReplicasOf(const placement::LayerRoute& route, size_t shard);

class ReplicaPicker {
 public:
  using Clock = std::chrono::steady_clock;
  explicit ReplicaPicker(Clock::duration avoid_after_failure = std::chrono::seconds(2))
      : avoid_(avoid_after_failure) {}

  // The replica (an index of route.shards) not in `tried` with the least outstanding calls,
  // preferring ones that did not just fail, never a quarantined one; route.shards.size() when
  // every one was tried.
  size_t Pick(const placement::LayerRoute& route, const std::vector<size_t>& replicas,
              const std::set<size_t>& tried);
  void Started(const placement::ShardRef& shard);
  // failed: the call ended UNAVAILABLE (the replica is avoided for a while).
  void Finished(const placement::ShardRef& shard, bool failed);
  int64_t outstanding(const placement::ShardRef& shard) const;
  // A replica caught answering wrong bytes (twin_audit.h): never picked again at this endpoint
  // (a shard restarted elsewhere is a new endpoint; router-svc's quarantine keeps its name out).
  void Quarantine(const placement::ShardRef& shard);

 private:
  static std::string Key(const placement::ShardRef& s) { return s.shard + "@" + s.endpoint; }
  const Clock::duration avoid_;
  mutable std::mutex mu_;
  std::map<std::string, int64_t> outstanding_;
  std::map<std::string, Clock::time_point> avoid_until_;
  std::set<std::string> quarantined_;
  uint64_t turn_ = 0;
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_REPLICA_PICKER_H_
