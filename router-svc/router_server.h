// router-svc: the control plane (RouterService in proto/moe/v1/router.proto).
//
//  * Placement: expert servers register their (layer, expert range) and heartbeat; a shard whose
//    heartbeats stop for 3 intervals is marked unhealthy. WatchPlacement streams every change.
//  * Bias per layer, versioned: version 0 is the checkpoint's e_score_correction_bias; modes
//    frozen / rebalance / continuous; every change is a new version with a reason, and
//    RollbackBias makes an old one current again. WatchBias streams every new version.
//  * Load statistics: attention nodes report QB histograms and loads; the current window holds
//    the reports routed with the current bias version (bounded to window_tokens tokens).
//  * Rebalance runs Quantile Balancing (the histogram form, docs/quantile-balancing.md) on the
//  pooled window.
//
//   RouterServerOptions o; o.checkpoint = "out/mid";
//   MOE_ASSIGN_OR_RETURN(auto router, RouterServer::Start(o));
#ifndef MOE_ROUTER_SVC_ROUTER_SERVER_H_
#define MOE_ROUTER_SVC_ROUTER_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "router-svc/bias_ledger.h"

namespace moe::router_svc {

struct RouterServerOptions {
  // config.json and the per-layer bias come from here.
  std::string checkpoint;
  // The durable control plane (state_store.h): bias versions, modes and registrations in this
  // SQLite file, restored at start (empty: in memory only, lost on restart).
  std::string state_db;
  // A store (state_db or etcd) that holds no cluster's state (a missing or empty file, an empty
  // etcd prefix) is refused at start unless this is set: a lost state never silently becomes a
  // new cluster at bias version 0. Set it for a cluster's first start only; with a state
  // present it changes nothing.
  bool initialize = false;
  // Several routers with one leader: the state in etcd (host:port of its client URL) under
  // etcd_prefix instead of state_db. A router that does not lead is a standby: NOT_SERVING and
  // every call UNAVAILABLE, until it wins the election and restores the state from etcd.
  std::string etcd;
  std::string etcd_prefix = "/moe/router";
  std::string name;             // this router in the election (default: host:port)
  std::vector<int64_t> layers;  // empty: every MoE layer whose bias the checkpoint holds

  std::string host = "127.0.0.1";
  int port = 0;
  std::string port_file;  // written last, after the metrics and web port files
  int metrics_port = -1;  // Prometheus /metrics: -1 off, 0 any free port
  std::string metrics_port_file;
  int web_port = -1;  // the load-balance page and its JSON API: -1 off, 0 any free port
  std::string web_port_file;

  // Every layer's mode at start (frozen, rebalance, continuous: bias_ledger.h).
  BiasMode bias_mode = BiasMode::kRebalance;
  int64_t continuous_tokens = 16384;  // continuous mode: rebalance after this many tokens
  int64_t window_tokens = 65536;      // the QB / imbalance window keeps the newest reports
  int64_t heartbeat_interval_ms = 500;
  // Dynamic k (docs/math.md section 4.1): every token keeps at least its first budget_k_min
  // selections under any budget. For layers whose stored state has no budget yet.
  int64_t budget_k_min = 1;
  // A window whose thresholds leave a kept-load noise floor above this (BudgetWindowFloor at the
  // layer's budget) is flagged: the version's reason, the log, moe_budget_window_floor.
  double budget_window_floor = 0.2;
  // Thresholds solved under a bias are stale once the bias moved by more than this on some
  // expert (measured: 0.01 keeps the budget within about 1% and the kept-load MaxVio within
  // 0.1 of fresh thresholds; 0.1 misses by 28%): not applied until solved again.
  double budget_stale_bias = 0.01;
  // Admin calls (Rebalance, RollbackBias, SetBiasMode, the page's buttons) need the metadata
  // x-moe-admin-token equal to this token. Without one they are refused: nothing that changes
  // the bias is open to an unauthenticated caller. admin_token_file (chmod 600, or a Secret
  // mount) is read at start and wins over admin_token, which `ps` would show.
  std::string admin_token;
  std::string admin_token_file;
  // Membership: RegisterExpertServer, Heartbeat and ReportStats need the metadata
  // x-moe-cluster-token equal to this token (every expert-svc and attention-svc of the cluster
  // has it). Without one they are refused: nobody joins the placement or changes the
  // statistics unauthenticated. cluster_token_file wins over cluster_token.
  std::string cluster_token;
  std::string cluster_token_file;
  // Open WatchPlacement / WatchBias streams at once; beyond: RESOURCE_EXHAUSTED. (Each watcher
  // holds at most one queued message per key: watch_reactor.h.)
  int max_watchers = 1024;
  // Bytes all watch streams together may hold unread (queued or in flight); a push past it ends
  // that stream RESOURCE_EXHAUSTED.
  int64_t max_watch_bytes = int64_t{256} << 20;
  // Which experts each shard may serve (services/placement ShardAllowance: the chart's
  // ranges.json, or {"shards": {name: [lo, hi]}}): a registration outside it is
  // PERMISSION_DENIED naming the range. Empty: any range (development; logged at start).
  std::string ranges_file;
  // Registered shards at most (RESOURCE_EXHAUSTED beyond); a registration silent for longer
  // than shard_expiry_seconds is removed (from the placement, the page, the store).
  int64_t max_shards = 1024;
  int64_t shard_expiry_seconds = 60;
};

class RouterServer {
 public:
  static absl::StatusOr<std::unique_ptr<RouterServer>> Start(const RouterServerOptions& options);
  ~RouterServer();

  int port() const;
  void Shutdown(absl::Duration grace = absl::Seconds(2));
  void Wait();

  class Impl;

 private:
  explicit RouterServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::router_svc

#endif  // MOE_ROUTER_SVC_ROUTER_SERVER_H_
