#include "router-svc/router_proto.h"

#include <cmath>

namespace moe::router_svc {

v1::BiasMode ToProto(BiasMode m) {
  switch (m) {
    case BiasMode::kFrozen:
      return v1::BIAS_MODE_FROZEN;
    case BiasMode::kContinuous:
      return v1::BIAS_MODE_CONTINUOUS;
    case BiasMode::kRebalance:
      break;
  }
  return v1::BIAS_MODE_REBALANCE;
}

v1::LayerBias ToProto(const BiasVersion& v) {
  v1::LayerBias b;
  b.set_layer(v.layer);
  b.set_version(v.version);
  b.set_mode(ToProto(v.mode));
  *b.mutable_bias() = {v.bias.begin(), v.bias.end()};
  b.set_reason(v.reason);
  b.set_created_unix_ms(v.created_unix_ms);
  *b.mutable_budget() = ToProto(v.budget);
  return b;
}

v1::ExpertBudget ToProto(const ExpertBudget& x) {
  v1::ExpertBudget b;
  b.set_k_avg(x.k_avg);
  b.set_k_min(x.k_min);
  *b.mutable_thresholds() = {x.thresholds.begin(), x.thresholds.end()};
  b.set_solved_from_tokens(x.solved_from_tokens);
  b.set_solved_from_version(x.solved_from_version);
  b.set_stale(x.stale);
  b.set_window_floor(x.window_floor);
  return b;
}

ExpertBudget FromProto(const v1::ExpertBudget& b) {
  ExpertBudget x;
  x.k_avg = b.k_avg();
  x.k_min = b.k_min();
  x.thresholds.assign(b.thresholds().begin(), b.thresholds().end());
  x.solved_from_tokens = b.solved_from_tokens();
  x.solved_from_version = b.solved_from_version();
  x.stale = b.stale();
  x.window_floor = std::isfinite(b.window_floor()) ? b.window_floor() : 0.0;
  return x;
}

v1::Placement ToProto(const PlacementSnapshot& s) {
  v1::Placement p;
  p.set_version(s.version);
  for (const ShardEntry& e : s.shards) {
    v1::ShardInfo* info = p.add_shards();
    info->set_shard(e.name);
    info->set_endpoint(e.endpoint);
    for (const LayerRange& r : e.ranges) {
      v1::ExpertRange* pr = info->add_ranges();
      pr->set_layer(r.layer);
      pr->set_expert_lo(r.lo);
      pr->set_expert_hi(r.hi);
    }
    info->set_healthy(e.healthy);
    info->set_last_seen_ms(e.last_seen_ms);
    info->set_data_plane(e.data_plane);
    info->set_data_plane_lanes(e.lanes);
    info->set_quarantined(e.quarantined);
    info->set_quarantine_reason(e.quarantine_reason);
  }
  return p;
}

void FillBalance(const numerics::BalanceMetrics& m, v1::Balance* b) {
  b->set_max_vio(m.max_vio);
  b->set_cv(m.cv);
  b->set_min_over_target(m.min_over_target);
  b->set_dead(m.dead);
  b->set_shard_max_over_mean(m.shard_max_over_mean);
}

absl::StatusOr<BiasMode> FromProto(v1::BiasMode m) {
  switch (m) {
    case v1::BIAS_MODE_FROZEN:
      return BiasMode::kFrozen;
    case v1::BIAS_MODE_REBALANCE:
      return BiasMode::kRebalance;
    case v1::BIAS_MODE_CONTINUOUS:
      return BiasMode::kContinuous;
    default:
      break;
  }
  return absl::InvalidArgumentError("SetBiasMode needs frozen, rebalance or continuous");
}

StatsReport FromProto(const v1::ReportStatsRequest& req) {
  StatsReport r;
  r.node = req.node();
  r.layer = req.layer();
  r.bias_version = req.bias_version();
  r.tokens = req.tokens();
  r.loads.assign(req.loads().begin(), req.loads().end());
  r.qb_histogram = req.qb_histogram();
  r.budget_histogram = req.budget_histogram();
  return r;
}

std::vector<LayerRange> FromProto(const google::protobuf::RepeatedPtrField<v1::ExpertRange>& r) {
  std::vector<LayerRange> out;
  for (const v1::ExpertRange& x : r) out.push_back({x.layer(), x.expert_lo(), x.expert_hi()});
  return out;
}

void FillLoadStats(const BiasLedger& ledger, const LoadWindow& w, const PlacementRegistry& registry,
                   int64_t rebalances, v1::LoadStats* s) {
  s->set_layer(w.layer());
  s->set_bias_version(ledger.current().version);
  s->set_mode(ToProto(ledger.mode()));
  *s->mutable_total_loads() = {w.total_loads().begin(), w.total_loads().end()};
  s->set_total_tokens(w.total_tokens());
  *s->mutable_window_loads() = {w.window_loads().begin(), w.window_loads().end()};
  s->set_window_tokens(w.window_tokens());
  const std::vector<int32_t> shard_of = registry.ShardOfExpert(w.layer());
  if (w.window_tokens() > 0) {
    FillBalance(numerics::ComputeBalance(w.window_loads(), shard_of), s->mutable_window_balance());
  }
  for (const ShardLoad& x : registry.ShardLoads(w.layer(), w.window_loads())) {
    s->add_shard_names(x.name);
    s->add_shard_loads(x.load);
  }
  s->set_rebalances(rebalances);
  for (const BiasVersion& b : ledger.history()) {
    v1::LayerBias* h = s->add_history();
    *h = ToProto(b);
    h->clear_bias();
    h->mutable_budget()->clear_thresholds();
  }
}

}  // namespace moe::router_svc
