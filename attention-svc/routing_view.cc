#include "attention-svc/routing_view.h"

#include <algorithm>

namespace moe::attention_svc {

void RoutingView::Host(int32_t layer, std::vector<float> checkpoint_bias) {
  auto entry = std::make_shared<BiasEntry>();
  entry->bias = std::move(checkpoint_bias);
  entry->k_avg = static_cast<int32_t>(top_k_);
  std::lock_guard<std::mutex> lock(mu_);
  bias_[layer] = std::move(entry);
}

std::vector<int32_t> RoutingView::layers() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int32_t> out;
  for (const auto& [l, b] : bias_) out.push_back(l);
  return out;
}

bool RoutingView::hosts(int32_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return bias_.count(layer) != 0;
}

bool RoutingView::ApplyPlacement(const v1::Placement& p) {
  bool covered = true;
  std::map<int32_t, std::shared_ptr<const LayerRoute>> routes;
  for (int32_t layer : layers()) {
    std::vector<ShardRef> shards;
    for (const v1::ShardInfo& s : p.shards()) {
      for (const v1::ExpertRange& r : s.ranges()) {
        if (r.layer() != layer) continue;
        shards.push_back(
            {s.shard(), s.endpoint(), r.expert_lo(), r.expert_hi(), s.healthy(), s.last_seen_ms()});
      }
    }
    auto route = std::make_shared<LayerRoute>(
        BuildRoute(layer, static_cast<int32_t>(num_experts_), std::move(shards)));
    covered &= Covered(*route);
    routes[layer] = std::move(route);
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [layer, route] : routes) covered_[layer] = Covered(*route);
  placement_ = p;
  routes_ = std::move(routes);
  return covered && !bias_.empty();
}

bool RoutingView::ApplyBias(const v1::LayerBias& b) {
  if (!hosts(b.layer()) || b.bias_size() != num_experts_) return false;
  auto entry = std::make_shared<BiasEntry>();
  entry->version = b.version();
  entry->bias.assign(b.bias().begin(), b.bias().end());
  const v1::ExpertBudget& budget = b.budget();
  entry->k_avg = budget.k_avg() >= 1 && budget.k_avg() <= top_k_ ? budget.k_avg()
                                                                 : static_cast<int32_t>(top_k_);
  entry->k_min = std::clamp<int32_t>(budget.k_min(), 0, static_cast<int32_t>(top_k_));
  if (budget.thresholds_size() == (top_k_ - 1) * num_experts_) {
    entry->thresholds.assign(budget.thresholds().begin(), budget.thresholds().end());
  }
  entry->stale = budget.stale();
  entry->solved_from_version = budget.solved_from_version();
  std::lock_guard<std::mutex> lock(mu_);
  bias_[b.layer()] = std::move(entry);
  return true;
}

RoutingView::Snapshot RoutingView::Get(int32_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  Snapshot s;
  auto b = bias_.find(layer);
  if (b != bias_.end()) s.bias = b->second;
  auto r = routes_.find(layer);
  if (r != routes_.end()) s.route = r->second;
  return s;
}

bool RoutingView::LayerReady(int32_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = covered_.find(layer);
  return it != covered_.end() && it->second;
}

bool RoutingView::AllReady() const {
  std::lock_guard<std::mutex> lock(mu_);
  bool ready = !bias_.empty();
  for (const auto& [l, b] : bias_) {
    auto it = covered_.find(l);
    ready &= it != covered_.end() && it->second;
  }
  return ready;
}

v1::Placement RoutingView::placement() const {
  std::lock_guard<std::mutex> lock(mu_);
  return placement_;
}

bool RoutingView::Placed(const std::string& shard_at_endpoint) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [layer, route] : routes_) {
    for (const ShardRef& s : route->shards) {
      if (shard_at_endpoint == s.shard + "@" + s.endpoint) return true;
    }
  }
  return false;
}

int32_t RoutingView::BudgetCeiling() const {
  std::lock_guard<std::mutex> lock(mu_);
  int32_t ceiling = 1;
  for (const auto& [layer, b] : bias_) {
    ceiling = std::max(ceiling, !b->usable() ? static_cast<int32_t>(top_k_) : b->k_avg);
  }
  return ceiling;
}

}  // namespace moe::attention_svc
