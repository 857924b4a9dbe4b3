// router-svc's core, apart from its gRPC adapter (router_server.cc) and its page: the state
// under one mutex (the placement registry, one bias ledger and load window per layer, the
// durable store) and the operations on it (register, heartbeat, report, rebalance, rollback,
// set mode, restore). Changes go out through sinks called with the core's mutex held, so a
// watcher added inside Subscribe misses no change. The gRPC service and the page both call the
// same operations; the classes it holds are tested one by one in router_state_test.cc.
//
//   MOE_ASSIGN_OR_RETURN(auto core, RouterCore::Load(options));  // checkpoint bias, --state_db
//   core->SetSinks({.placement = push_to_watchers, .bias = push_to_bias_watchers});
//   MOE_RETURN_IF_ERROR(core->Rebalance(layer, /*dry_run=*/false, "rebalance", &resp));
#ifndef MOE_ROUTER_SVC_ROUTER_CORE_H_
#define MOE_ROUTER_SVC_ROUTER_CORE_H_

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "moe/v1/router.pb.h"
#include "router-svc/bias_ledger.h"
#include "router-svc/load_balance_page.h"
#include "router-svc/load_window.h"
#include "router-svc/placement_registry.h"
#include "router-svc/router_server.h"
#include "router-svc/state_store.h"
#include "services/common/model_config.h"
#include "services/placement/placement.h"

namespace prometheus {
class Registry;
}
namespace moe::metrics {
class RouterMetrics;
}

namespace moe::router_svc {

// A shard whose heartbeats stop for this many intervals is unhealthy, and its lease dead: its
// name is free for another registration from then on.
inline constexpr int kMissedHeartbeats = 3;

// INVALID_ARGUMENT unless name is a member name (transport::IsMemberName), saying what is wrong.
absl::Status CheckShardName(const std::string& name);

// Milliseconds since the Unix epoch (the time stamps of ledgers, leases and the state's origin).
int64_t UnixMs();

struct LayerState {
  BiasLedger ledger;
  LoadWindow window;
  int64_t rebalances = 0;
  BudgetActivity budget;  // dynamic k as the attention nodes report it
};

// Where changes go; each runs with the core's mutex held (it must not call back into the core).
struct RouterCoreSinks {
  std::function<void(const v1::Placement&)> placement;
  std::function<void(const v1::LayerBias&)> bias;
};

// The router's state at this start: its store ("sqlite", "etcd", "memory"), and whether it
// was "restored", "initialized" (a new cluster's, --initialize) or is "in_memory" (lost on
// restart); the time the state was first made (0: in memory).
struct StateOrigin {
  std::string store = "memory";
  std::string start = "in_memory";
  int64_t initialized_unix_ms = 0;
};

class RouterCore {
 public:
  // The checkpoint's config and bias per layer; with --state_db, the stored state restored.
  static absl::StatusOr<std::unique_ptr<RouterCore>> Load(const RouterServerOptions& options);
  ~RouterCore();

  void SetSinks(RouterCoreSinks sinks);
  // The registry's metrics to count into from now (null: the core's own, not exported); set
  // once, before traffic (the layers' and shards' series start).
  void SetMetrics(metrics::RouterMetrics* metrics);
  // Where the router counts (the adapters' errors too); never null.
  metrics::RouterMetrics* metrics() const { return metrics_; }
  // The shard holding a lease ("" for none).
  std::string LeaseOwner(uint64_t lease) const;
  // Where this router's state lives and how it began at this start.
  StateOrigin Origin() const;

  absl::Status Register(const v1::RegisterExpertServerRequest& req,
                        v1::RegisterExpertServerResponse* resp);
  absl::Status Heartbeat(const v1::HeartbeatRequest& req);
  absl::Status ReportStats(const v1::ReportStatsRequest& req, v1::ReportStatsResponse* resp);
  absl::Status Rebalance(int32_t layer, bool dry_run, const std::string& reason,
                         v1::RebalanceResponse* resp);
  absl::Status Rollback(int32_t layer, uint64_t to, v1::LayerBias* resp);
  absl::Status SetMode(const v1::SetBiasModeRequest& req, v1::LayerBias* resp);
  // Dynamic k: the layer's budget k_avg (1..k) as a new version with the current bias and
  // thresholds solved from the window's budget histograms (or the current version's, when the
  // window has none). FAILED_PRECONDITION for k_avg < k with neither.
  absl::Status SetBudget(int32_t layer, int32_t k_avg, const std::string& reason,
                         v1::LayerBias* resp);
  // An attention node's report of a shard caught answering wrong bytes (reporter: its identity
  // from its certificate, "" without mutual TLS): the shard is quarantined (placement_registry.h)
  // and the placement published; the evidence is logged.
  absl::Status Quarantine(const v1::QuarantineShardRequest& req, const std::string& reporter,
                          v1::QuarantineShardResponse* resp);
  // Lifts a quarantine (admin); whether there was one.
  bool Release(const std::string& shard);
  // An attention node's own state (its canary and twin audits) for the page; INVALID_ARGUMENT
  // for a malformed one, RESOURCE_EXHAUSTED past kMaxNodes nodes heard within a minute.
  absl::Status ReportNode(const v1::ReportNodeRequest& req);
  v1::Placement Placement() const;
  absl::StatusOr<v1::LayerBias> Bias(int32_t layer) const;
  absl::Status LoadStats(int32_t layer, v1::LoadStats* resp) const;
  // Runs f with the current placement and every layer's bias under the core's mutex: a watcher
  // registered inside f gets every later change through the sinks, none twice, none lost.
  void Subscribe(
      const std::function<void(const v1::Placement&, const std::vector<v1::LayerBias>&)>& f);
  // A new leader (etcd): the stored state restored, then the placement published.
  absl::Status Restore(std::unique_ptr<StateStore> store);
  // Shards whose heartbeats stopped longer than `stale` become unhealthy (published).
  void ExpireStale(std::chrono::milliseconds stale);
  // The page's calls (load_balance_page.h), on the same operations.
  PageCallbacks PageApi();

 private:
  using Clock = std::chrono::steady_clock;
  explicit RouterCore(const RouterServerOptions& o);
  absl::StatusOr<LayerState*> LayerLocked(int32_t layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // NOT_FOUND naming the layer and the managed ones.
  absl::Status UnknownLayerLocked(int32_t layer) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RebalanceLocked(LayerState& l, bool dry_run, const std::string& reason,
                               v1::RebalanceResponse* resp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new current bias version: stored, the window restarts, watchers and metrics hear of it.
  absl::Status PublishBiasLocked(LayerState& l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The current budget with thresholds solved from the window, when it holds budget histograms
  // (*solved: whether it did).
  ExpertBudget SolveBudgetLocked(const LayerState& l, bool* solved) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A budget about to be published with `bias`: stale when the bias moved by more than
  // --budget_stale_bias since the version its thresholds were solved under, and its window's
  // noise floor at its k_avg. Returns what to add to the version's reason ("" when nothing).
  std::string StampBudgetLocked(const LayerState& l, const std::vector<float>& bias,
                                ExpertBudget* budget) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stale thresholds of a budget in use (k_avg < k) solved again from the current window once
  // it holds enough tokens, as a new version with the same bias.
  absl::Status ResolveStaleBudgetLocked(LayerState& l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PersistLocked(const LayerState& l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Opens the store's state and restores ledgers and registrations from it.
  absl::Status RestoreLocked(std::unique_ptr<StateStore> store) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new placement version to the sink (and the shard gauges).
  void PublishPlacementLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateLayerMetricsLocked(const LayerState& l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const RouterServerOptions options_;
  ModelConfig cfg_;
  std::unique_ptr<prometheus::Registry> own_registry_;  // metrics not exported
  std::unique_ptr<metrics::RouterMetrics> own_metrics_;
  metrics::RouterMetrics* metrics_ = nullptr;  // never null after Load
  RouterCoreSinks sinks_;
  mutable std::mutex mu_;
  std::unique_ptr<PlacementRegistry> registry_ ABSL_GUARDED_BY(mu_);
  // From options.ranges_file; null: any range may be registered.
  std::unique_ptr<placement::ShardAllowance> allowance_;
  std::unique_ptr<StateStore> store_ ABSL_GUARDED_BY(mu_);  // null: nothing survives a restart
  StateOrigin origin_ ABSL_GUARDED_BY(mu_);
  std::map<int32_t, LayerState> layers_ ABSL_GUARDED_BY(mu_);
  // The attention nodes' last ReportNode and when it came (the page's node table).
  static constexpr size_t kMaxNodes = 64;
  struct NodeReport {
    v1::ReportNodeRequest report;
    int64_t unix_ms = 0;
  };
  std::map<std::string, NodeReport> nodes_ ABSL_GUARDED_BY(mu_);
  nlohmann::json NodesJsonLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace moe::router_svc

#endif  // MOE_ROUTER_SVC_ROUTER_CORE_H_
