#include "attention-svc/replica_picker.h"

#include <limits>

namespace moe::attention_svc {

std::vector<size_t> ReplicasOf(const placement::LayerRoute& route, size_t shard) {
  std::vector<size_t> out = {shard};
  const placement::ShardRef& s = route.shards[shard];
  for (size_t i = 0; i < route.shards.size(); ++i) {
    const placement::ShardRef& r = route.shards[i];
    if (i != shard && r.healthy && r.lo == s.lo && r.hi == s.hi) out.push_back(i);
  }
  return out;
}

size_t ReplicaPicker::Pick(const placement::LayerRoute& route, const std::vector<size_t>& replicas,
                           const std::set<size_t>& tried) {
  std::lock_guard<std::mutex> lock(mu_);
  const Clock::time_point now = Clock::now();
  size_t best = route.shards.size();
  std::pair<bool, int64_t> best_cost = {true, std::numeric_limits<int64_t>::max()};
  // Ties go round: the scan starts one further each time.
  const size_t n = replicas.size();
  const size_t first = n == 0 ? 0 : static_cast<size_t>(turn_++ % n);
  for (size_t k = 0; k < n; ++k) {
    const size_t i = replicas[(first + k) % n];
    if (tried.count(i) != 0) continue;
    const std::string key = Key(route.shards[i]);
    if (quarantined_.count(key) != 0) continue;
    auto a = avoid_until_.find(key);
    const bool avoided = a != avoid_until_.end() && a->second > now;
    auto o = outstanding_.find(key);
    const std::pair<bool, int64_t> cost = {avoided, o == outstanding_.end() ? 0 : o->second};
    if (cost < best_cost) {  // not avoided first, then the least outstanding
      best_cost = cost;
      best = i;
    }
  }
  return best;
}

void ReplicaPicker::Started(const placement::ShardRef& shard) {
  std::lock_guard<std::mutex> lock(mu_);
  ++outstanding_[Key(shard)];
}

void ReplicaPicker::Finished(const placement::ShardRef& shard, bool failed) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string key = Key(shard);
  --outstanding_[key];
  if (failed) avoid_until_[key] = Clock::now() + avoid_;
}

void ReplicaPicker::Quarantine(const placement::ShardRef& shard) {
  std::lock_guard<std::mutex> lock(mu_);
  quarantined_.insert(Key(shard));
}

int64_t ReplicaPicker::outstanding(const placement::ShardRef& shard) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto o = outstanding_.find(Key(shard));
  return o == outstanding_.end() ? 0 : o->second;
}

}  // namespace moe::attention_svc
