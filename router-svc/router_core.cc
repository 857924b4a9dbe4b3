#include "router-svc/router_core.h"

#include <cmath>
#include <fstream>
#include <iterator>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "prometheus/registry.h"
#include "router-svc/router_proto.h"
#include "services/common/logging.h"
#include "services/common/status_macros.h"
#include "services/metrics/service_metrics.h"
#include "services/numerics/dynamic_k.h"
#include "services/transport/security.h"

namespace moe::router_svc {

int64_t UnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A shard's name: transport::IsMemberName (what a StatefulSet pod name may be).
absl::Status CheckShardName(const std::string& name) {
  if (transport::IsMemberName(name)) return absl::OkStatus();
  if (name.empty() || name.size() > transport::kMaxMemberNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a shard name of ", name.size(), " bytes (1 to ",
                                                   transport::kMaxMemberNameBytes, ")"));
  }
  return absl::InvalidArgumentError("a shard name has letters, digits, '-', '.' and '_' only");
}

RouterCore::RouterCore(const RouterServerOptions& o) : options_(o) {}
RouterCore::~RouterCore() = default;

absl::StatusOr<std::unique_ptr<RouterCore>> RouterCore::Load(const RouterServerOptions& o) {
  auto core = std::unique_ptr<RouterCore>(new RouterCore(o));
  const RouterServerOptions& options_ = core->options_;
  ModelConfig& cfg_ = core->cfg_;
  if (options_.checkpoint.empty()) {
    return absl::InvalidArgumentError("router-svc needs --checkpoint (config and routing bias)");
  }
  const BiasMode mode = options_.bias_mode;
  MOE_ASSIGN_OR_RETURN(auto biases, CheckpointBiases(options_.checkpoint, options_.layers, &cfg_));
  std::lock_guard<std::mutex> lock(core->mu_);
  core->registry_ = std::make_unique<PlacementRegistry>(
      cfg_.num_experts, options_.max_shards,
      std::chrono::milliseconds(kMissedHeartbeats * options_.heartbeat_interval_ms));
  if (!options_.ranges_file.empty()) {
    std::ifstream f(options_.ranges_file);
    if (!f) {
      return absl::NotFoundError(absl::StrCat("cannot read --ranges_file ", options_.ranges_file));
    }
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    MOE_ASSIGN_OR_RETURN(placement::ShardAllowance a, placement::ParseShardAllowance(text));
    core->allowance_ = std::make_unique<placement::ShardAllowance>(std::move(a));
  } else {
    MOE_LOG_WARN(
        "no --ranges_file: any member may register any expert range (development only; the "
        "chart and moe-cli up pass the deployment's table)");
  }
  if (options_.budget_k_min < 1 || options_.budget_k_min > cfg_.top_k) {
    return absl::InvalidArgumentError(absl::StrCat("--budget_k_min ", options_.budget_k_min,
                                                   " outside [1, top-k = ", cfg_.top_k, "]"));
  }
  ExpertBudget full;  // no budget: every token keeps its top-k
  full.k_avg = static_cast<int32_t>(cfg_.top_k);
  full.k_min = static_cast<int32_t>(options_.budget_k_min);
  for (auto& [l, bias] : biases) {
    core->layers_.emplace(
        l,
        LayerState{BiasLedger(l, std::move(bias), mode, options_.continuous_tokens, UnixMs(), full),
                   LoadWindow(l, cfg_.num_experts, cfg_.top_k, options_.window_tokens), 0,
                   BudgetActivity{}});
  }
  // Counted from the start, exported once SetMetrics hands a registry's: a value, never null.
  std::vector<int64_t> layers;
  for (const auto& [l, state] : core->layers_) layers.push_back(l);
  core->own_registry_ = std::make_unique<prometheus::Registry>();
  core->own_metrics_ = std::make_unique<metrics::RouterMetrics>(*core->own_registry_, layers);
  core->metrics_ = core->own_metrics_.get();
  if (!options_.state_db.empty()) {
    MOE_ASSIGN_OR_RETURN(auto sqlite, OpenSqliteStore(options_.state_db, options_.initialize));
    MOE_RETURN_IF_ERROR(core->RestoreLocked(std::move(sqlite)));
  }
  return core;
}

void RouterCore::SetSinks(RouterCoreSinks sinks) {
  std::lock_guard<std::mutex> lock(mu_);
  sinks_ = std::move(sinks);
}

void RouterCore::SetMetrics(metrics::RouterMetrics* metrics) {
  std::lock_guard<std::mutex> lock(mu_);
  metrics_ = metrics != nullptr ? metrics : own_metrics_.get();
  for (const auto& [l, state] : layers_) UpdateLayerMetricsLocked(state);
  metrics_->State(origin_.store, origin_.start, origin_.initialized_unix_ms);
  metrics_->Shards(0, 0);
}

v1::Placement RouterCore::Placement() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ToProto(registry_->Snapshot(Clock::now()));
}

absl::StatusOr<v1::LayerBias> RouterCore::Bias(int32_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = layers_.find(layer);
  if (it == layers_.end()) {
    return UnknownLayerLocked(layer);
  }
  return ToProto(it->second.ledger.current());
}

absl::Status RouterCore::LoadStats(int32_t layer, v1::LoadStats* resp) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = layers_.find(layer);
  if (it == layers_.end()) return UnknownLayerLocked(layer);
  FillLoadStats(it->second.ledger, it->second.window, *registry_, it->second.rebalances, resp);
  return absl::OkStatus();
}

void RouterCore::Subscribe(
    const std::function<void(const v1::Placement&, const std::vector<v1::LayerBias>&)>& f) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<v1::LayerBias> biases;
  for (const auto& [l, state] : layers_) biases.push_back(ToProto(state.ledger.current()));
  f(ToProto(registry_->Snapshot(Clock::now())), biases);
}

absl::Status RouterCore::Restore(std::unique_ptr<StateStore> store) {
  std::lock_guard<std::mutex> lock(mu_);
  MOE_RETURN_IF_ERROR(RestoreLocked(std::move(store)));
  PublishPlacementLocked();
  return absl::OkStatus();
}

absl::Status RouterCore::Rebalance(int32_t layer, bool dry_run, const std::string& reason,
                                   v1::RebalanceResponse* resp) {
  std::lock_guard<std::mutex> lock(mu_);
  MOE_ASSIGN_OR_RETURN(LayerState * l, LayerLocked(layer));
  return RebalanceLocked(*l, dry_run, reason, resp);
}

absl::Status RouterCore::RestoreLocked(std::unique_ptr<StateStore> store) {
  store_ = std::move(store);
  MOE_ASSIGN_OR_RETURN(StoredState state, store_->Load());
  const bool etcd = !options_.etcd.empty();
  const std::string where =
      etcd ? absl::StrCat("etcd ", options_.etcd, " ", options_.etcd_prefix) : options_.state_db;
  origin_.store = etcd ? "etcd" : "sqlite";
  origin_.start = "restored";
  origin_.initialized_unix_ms = state.initialized_unix_ms;
  if (state.initialized_unix_ms == 0) {
    if (!state.layers.empty() || !state.shards.empty()) {
      // Written before stores were marked: a cluster's state all the same.
      origin_.initialized_unix_ms = UnixMs();
      MOE_RETURN_IF_ERROR(store_->MarkInitialized(origin_.initialized_unix_ms));
    } else if (!options_.initialize) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the router state ", where,
          " is empty: refusing to start a new cluster's state in its place (every layer's bias "
          "would silently go back to the checkpoint's, version 0). Restore it from a backup "
          "(docs/operations.md), or start router-svc once with --initialize if this is a new "
          "cluster"));
    } else {
      origin_.start = "initialized";
      origin_.initialized_unix_ms = UnixMs();
      MOE_RETURN_IF_ERROR(store_->MarkInitialized(origin_.initialized_unix_ms));
      MOE_LOG_WARN(
          "--initialize: a new router state in {}: every layer starts at its checkpoint bias "
          "(version 0), no shard registered",
          where);
    }
  } else if (options_.initialize) {
    MOE_LOG_INFO("--initialize ignored: {} holds the state made at unix ms {}", where,
                 state.initialized_unix_ms);
  }
  for (auto& [l, layer] : layers_) {
    auto it = state.layers.find(l);
    if (it == state.layers.end()) {  // new here: its version 0 and mode, from now on
      MOE_RETURN_IF_ERROR(PersistLocked(layer));
      continue;
    }
    StoredLayer& stored = it->second;
    if (stored.history[0].bias != layer.ledger.current().bias) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the router state ", options_.state_db, " was written for another checkpoint (layer ", l,
          "'s version 0 differs from ", options_.checkpoint,
          "'s bias): remove it or use another --state_db"));
    }
    MOE_LOG_INFO("layer {}: restored {} bias versions (current {}), mode {}", l,
                 stored.history.size(), stored.history.size() - 1, BiasModeName(stored.mode));
    // Versions stored before dynamic k have no budget: the full top-k, this router's k_min.
    for (BiasVersion& v : stored.history) {
      if (v.budget.k_avg == 0 && v.budget.thresholds.empty()) {
        v.budget.k_avg = static_cast<int32_t>(cfg_.top_k);
        v.budget.k_min = static_cast<int32_t>(options_.budget_k_min);
      }
    }
    layer.ledger = BiasLedger(l, std::move(stored.history), stored.mode, stored.continuous_tokens);
  }
  // A shard's channel to the new router reconnects with backoff (up to 1 s): its restored
  // registration counts as seen a little ahead, so it is not expired before its first
  // heartbeat can arrive.
  const Clock::time_point seen =
      Clock::now() +
      std::max<Clock::duration>(std::chrono::seconds(2),
                                5 * std::chrono::milliseconds(options_.heartbeat_interval_ms));
  for (const StoredShard& s : state.shards) {
    MOE_RETURN_IF_ERROR(
        registry_->Restore(s.name, s.endpoint, s.ranges, s.lease, seen, s.data_plane));
    MOE_LOG_INFO("shard {} restored at {} (its heartbeats go on under its lease)", s.name,
                 s.endpoint);
  }
  return absl::OkStatus();
}

absl::Status RouterCore::PersistLocked(const LayerState& l) {
  if (store_ == nullptr) return absl::OkStatus();
  MOE_RETURN_IF_ERROR(store_->PutBiasVersion(l.ledger.current()));
  return store_->PutMode(l.window.layer(), l.ledger.mode(), l.ledger.continuous_tokens());
}

absl::Status RouterCore::UnknownLayerLocked(int32_t layer) const {
  std::string known;
  for (const auto& [l, s] : layers_) absl::StrAppend(&known, known.empty() ? "" : ",", l);
  return absl::NotFoundError(
      absl::StrCat("layer ", layer, " is not managed by this router (layers ", known, ")"));
}

absl::StatusOr<LayerState*> RouterCore::LayerLocked(int32_t layer) {
  auto it = layers_.find(layer);
  if (it == layers_.end()) return UnknownLayerLocked(layer);
  return &it->second;
}

absl::Status RouterCore::ReportStats(const v1::ReportStatsRequest& req,
                                     v1::ReportStatsResponse* resp) {
  const StatsReport r = FromProto(req);
  if (req.auto_budget() < 0 || req.auto_budget() > cfg_.top_k || req.budget_checks() < 0 ||
      req.budget_checks() > (int64_t{1} << 40) || !std::isfinite(req.budget_rel_diff_sum()) ||
      req.budget_rel_diff_sum() < 0 ||
      req.budget_rel_diff_sum() > 1e3 * static_cast<double>(req.budget_checks()) ||
      !(req.budget_mass_kept_sum() >= 0) ||
      req.budget_mass_kept_sum() > static_cast<double>(req.budget_checks()) ||
      !(req.budget_top1_agree_sum() >= 0) ||
      req.budget_top1_agree_sum() > static_cast<double>(req.budget_checks())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "report from ", r.node, ": auto_budget ", req.auto_budget(), " (0..", cfg_.top_k,
        "), budget_checks ", req.budget_checks(), ", budget_rel_diff_sum ",
        req.budget_rel_diff_sum(), ", budget_mass_kept_sum ", req.budget_mass_kept_sum(),
        ", budget_top1_agree_sum ", req.budget_top1_agree_sum(), " out of range"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  MOE_ASSIGN_OR_RETURN(LayerState * l, LayerLocked(req.layer()));
  MOE_ASSIGN_OR_RETURN(ReportResult result, l->window.Add(r, l->ledger.current().version,
                                                          l->ledger.current().budget.k_min));
  resp->set_current_bias_version(l->ledger.current().version);
  resp->set_accepted_for_window(result == ReportResult::kCurrent);
  l->budget.Cap(r.node, req.auto_budget(), UnixMs());
  if (result == ReportResult::kCurrent) {
    l->budget.checks += req.budget_checks();
    l->budget.rel_diff_sum += req.budget_rel_diff_sum();
    l->budget.mass_kept_sum += req.budget_mass_kept_sum();
    l->budget.top1_sum += req.budget_top1_agree_sum();
  }
  metrics_->Report(result == ReportResult::kCurrent);
  if (result == ReportResult::kStale) return absl::OkStatus();
  MOE_RETURN_IF_ERROR(ResolveStaleBudgetLocked(*l));
  if (l->ledger.mode() == BiasMode::kContinuous &&
      l->window.window_tokens() >= l->ledger.continuous_tokens()) {
    v1::RebalanceResponse ignored;
    MOE_RETURN_IF_ERROR(RebalanceLocked(*l, /*dry_run=*/false, "continuous", &ignored));
  }
  UpdateLayerMetricsLocked(*l);
  return absl::OkStatus();
}

absl::Status RouterCore::PublishBiasLocked(LayerState& l) {
  // Stored before anyone routes with it: a version that was served is never lost.
  MOE_RETURN_IF_ERROR(PersistLocked(l));
  l.window.Clear();
  l.budget.checks = 0;  // what a budget costs is measured per version
  l.budget.rel_diff_sum = 0;
  l.budget.mass_kept_sum = 0;
  l.budget.top1_sum = 0;
  const BiasVersion& cur = l.ledger.current();
  MOE_LOG_INFO("layer {} bias version {} ({})", cur.layer, cur.version, cur.reason);
  if (sinks_.bias) sinks_.bias(ToProto(cur));
  UpdateLayerMetricsLocked(l);
  return absl::OkStatus();
}

void RouterCore::UpdateLayerMetricsLocked(const LayerState& l) {
  // An empty window has no imbalance to speak of: NaN (a gap in a graph), never a false 0.
  const bool empty = l.window.window_tokens() == 0;
  const std::vector<int32_t> shard_of = registry_->ShardOfExpert(l.window.layer());
  const numerics::BalanceMetrics b = numerics::ComputeBalance(l.window.window_loads(), shard_of);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  metrics_->Window(l.window.layer(), empty ? nan : b.max_vio, l.window.window_tokens());
  // Shard balancedness as vLLM's EPLB exports it: mean / max tokens per shard.
  metrics_->Balancedness(l.window.layer(), empty || shard_of.empty() || !(b.shard_max_over_mean > 0)
                                               ? nan
                                               : 1.0 / b.shard_max_over_mean);
  metrics_->BiasVersion(l.window.layer(), l.ledger.current().version);
  metrics_->ExpertBudget(l.window.layer(), l.ledger.current().budget.k_avg);
  metrics_->BudgetThresholds(l.window.layer(), l.ledger.current().budget.stale,
                             l.ledger.current().budget.window_floor);
}

absl::Status RouterCore::RebalanceLocked(LayerState& l, bool dry_run, const std::string& reason,
                                         v1::RebalanceResponse* resp) {
  const int32_t layer = l.window.layer();
  if (!dry_run && l.ledger.mode() == BiasMode::kFrozen) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer, " is frozen (checkpoint bias): SetBiasMode to rebalance first"));
  }
  if (l.window.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, ": no traffic reported with bias version ",
                     l.ledger.current().version, " yet; nothing to balance"));
  }
  MOE_ASSIGN_OR_RETURN(RebalancePlan plan,
                       PlanRebalance(l.window, registry_->ShardOfExpert(layer)));
  resp->set_layer(layer);
  resp->set_window_tokens(plan.window_tokens);
  FillBalance(plan.before, resp->mutable_before());
  FillBalance(plan.predicted_after, resp->mutable_predicted_after());
  resp->set_noise_floor_max_vio(plan.noise_floor_max_vio);
  if (dry_run) {
    bool solved = false;
    BiasVersion next{
        layer, l.ledger.history().size(),    l.ledger.mode(), std::move(plan.bias), "dry run",
        0,     SolveBudgetLocked(l, &solved)};
    *resp->mutable_new_bias() = ToProto(next);
    resp->set_applied(false);
    return absl::OkStatus();
  }
  bool solved = false;
  ExpertBudget budget = SolveBudgetLocked(l, &solved);
  const std::string note = StampBudgetLocked(l, plan.bias, &budget);
  l.ledger.Append(std::move(plan.bias), std::move(budget),
                  absl::StrCat(reason, " from ", plan.window_tokens, " tokens", note), UnixMs());
  ++l.rebalances;
  metrics_->Rebalanced(layer);
  MOE_RETURN_IF_ERROR(PublishBiasLocked(l));
  *resp->mutable_new_bias() = ToProto(l.ledger.current());
  resp->set_applied(true);
  return absl::OkStatus();
}

absl::Status RouterCore::Rollback(int32_t layer, uint64_t to, v1::LayerBias* resp) {
  std::lock_guard<std::mutex> lock(mu_);
  MOE_ASSIGN_OR_RETURN(LayerState * l, LayerLocked(layer));
  MOE_ASSIGN_OR_RETURN(const BiasVersion* v, l->ledger.Rollback(to, UnixMs()));
  MOE_RETURN_IF_ERROR(PublishBiasLocked(*l));
  *resp = ToProto(*v);
  return absl::OkStatus();
}

absl::Status RouterCore::SetMode(const v1::SetBiasModeRequest& req, v1::LayerBias* resp) {
  MOE_ASSIGN_OR_RETURN(BiasMode mode, FromProto(req.mode()));
  std::lock_guard<std::mutex> lock(mu_);
  MOE_ASSIGN_OR_RETURN(LayerState * l, LayerLocked(req.layer()));
  MOE_ASSIGN_OR_RETURN(bool new_version,
                       l->ledger.SetMode(mode, req.continuous_tokens(), UnixMs()));
  if (new_version) {
    // The checkpoint's bias again: thresholds solved under another one may be stale.
    const std::vector<float> bias = l->ledger.current().bias;
    (void)StampBudgetLocked(*l, bias, l->ledger.mutable_current_budget());
    MOE_RETURN_IF_ERROR(PublishBiasLocked(*l));
  } else {
    MOE_RETURN_IF_ERROR(PersistLocked(*l));
    if (sinks_.bias) sinks_.bias(ToProto(l->ledger.current()));
  }
  *resp = ToProto(l->ledger.current());
  return absl::OkStatus();
}

std::string RouterCore::LeaseOwner(uint64_t lease) const {
  std::lock_guard<std::mutex> lock(mu_);
  return registry_->ShardOfLease(lease);
}

StateOrigin RouterCore::Origin() const {
  std::lock_guard<std::mutex> lock(mu_);
  return origin_;
}

PageCallbacks RouterCore::PageApi() {
  PageCallbacks cb;
  cb.layers = [this] {
    std::lock_guard<std::mutex> lock(mu_);
    nlohmann::json j;
    j["layers"] = nlohmann::json::array();
    for (const auto& [l, state] : layers_) j["layers"].push_back(l);
    j["state"] = {{"store", origin_.store},
                  {"start", origin_.start},
                  {"initialized_unix_ms", origin_.initialized_unix_ms}};
    j["experts"] = cfg_.num_experts;
    j["top_k"] = cfg_.top_k;
    return j;
  };
  cb.state = [this](int32_t layer) -> absl::StatusOr<nlohmann::json> {
    std::lock_guard<std::mutex> lock(mu_);
    MOE_ASSIGN_OR_RETURN(LayerState * l, LayerLocked(layer));
    nlohmann::json j =
        LayerStateJson(l->ledger, l->window, registry_->ShardLoads(layer, l->window.window_loads()),
                       registry_->ShardOfExpert(layer), l->rebalances, l->budget);
    j["nodes"] = NodesJsonLocked();
    return j;
  };
  cb.rebalance = [this](int32_t layer) -> absl::StatusOr<nlohmann::json> {
    std::lock_guard<std::mutex> lock(mu_);
    MOE_ASSIGN_OR_RETURN(LayerState * l, LayerLocked(layer));
    v1::RebalanceResponse r;
    MOE_RETURN_IF_ERROR(RebalanceLocked(*l, /*dry_run=*/false, "rebalance (page)", &r));
    return nlohmann::json{{"applied", r.applied()},
                          {"version", r.new_bias().version()},
                          {"window_tokens", r.window_tokens()},
                          {"before_max_vio", r.before().max_vio()},
                          {"predicted_max_vio", r.predicted_after().max_vio()}};
  };
  cb.budget = [this](int32_t layer, int32_t k_avg) -> absl::StatusOr<nlohmann::json> {
    v1::LayerBias out;
    MOE_RETURN_IF_ERROR(SetBudget(layer, k_avg, "budget (page)", &out));
    return nlohmann::json{
        {"version", out.version()}, {"k_avg", out.budget().k_avg()}, {"reason", out.reason()}};
  };
  cb.rollback = [this](int32_t layer, uint64_t to) -> absl::StatusOr<nlohmann::json> {
    v1::LayerBias out;
    MOE_RETURN_IF_ERROR(Rollback(layer, to, &out));
    return nlohmann::json{{"version", out.version()}, {"reason", out.reason()}};
  };
  return cb;
}

}  // namespace moe::router_svc
