// router-svc: flags -> RouterServerOptions -> start -> wait for SIGTERM/SIGINT.
#include "router-svc/router_server.h"
#include "services/common/status_macros.h"
#include "services/common/svc_main.h"
#include "services/transport/security.h"

int main(int argc, char** argv) {
  moe::router_svc::RouterServerOptions o;
  moe::SvcFlags flags("router-svc", "Control plane: placement, routing bias, load balancing.");
  flags.String("checkpoint", &o.checkpoint, "checkpoint directory (config and bias)");
  flags.IntList("layers", &o.layers, "MoE layers (empty: all whose bias is in the checkpoint)");
  flags.String("etcd", &o.etcd,
               "etcd client endpoint host:port: the state there, one leader among the routers");
  flags.String("etcd_prefix", &o.etcd_prefix, "key prefix of this deployment's state in etcd");
  flags.String("name", &o.name, "this router's name in the leader election (default host:port)");
  flags.String("state_db", &o.state_db,
               "SQLite file of bias versions, modes and registrations, kept across restarts "
               "(empty: in memory)");
  flags.Bool("initialize", &o.initialize,
             "a cluster's first start: make a new state where --state_db / --etcd holds none "
             "(without it an empty or missing state is refused: restore the backup)");
  moe::AddServingFlags(flags, &o);
  flags.Int("web_port", &o.web_port, "load-balance page port (-1: off, 0: any)");
  flags.String("web_port_file", &o.web_port_file, "write the page's port here");
  flags.Enum("bias_mode", &o.bias_mode, moe::router_svc::kBiasModes,
             "every layer's mode at start (bias_ledger.h)");
  flags.Int64("continuous_tokens", &o.continuous_tokens, "continuous mode period in tokens");
  flags.Int64("window_tokens", &o.window_tokens, "load/QB window in tokens");
  flags.Int64("heartbeat_interval_ms", &o.heartbeat_interval_ms, "expert-svc heartbeat period");
  flags.Int64("budget_k_min", &o.budget_k_min,
              "dynamic k: experts every token keeps under any expert budget (1..top-k)");
  flags.Double("budget_window_floor", &o.budget_window_floor,
               "dynamic k: flag thresholds from a window whose kept-load noise floor (MaxVio) at "
               "the layer's budget is above this");
  flags.Double("budget_stale_bias", &o.budget_stale_bias,
               "dynamic k: thresholds are stale (not applied; solved again from the next window) "
               "once the bias moved by more than this on some expert since they were solved");
  flags.String("admin_token_file", &o.admin_token_file,
               "file holding the admin token (chmod 600); without a token admin calls are refused");
  flags.String("cluster_token_file", &o.cluster_token_file,
               "file holding the cluster token (chmod 600) that expert and attention nodes send "
               "to register, heartbeat and report; without one they are refused");
  flags.Int("max_watchers", &o.max_watchers, "open WatchPlacement/WatchBias streams at once");
  flags.String("ranges_file", &o.ranges_file,
               "the deployment's placement table (ranges.json, or {\"shards\": {name: [lo, hi]}}): "
               "a shard may register only its range (empty: any range, development only)");
  flags.Int64("max_shards", &o.max_shards, "registered expert shards at most");
  flags.Int64("max_watch_bytes", &o.max_watch_bytes,
              "bytes all WatchPlacement/WatchBias streams together may hold unread");
  flags.Int64("shard_expiry_seconds", &o.shard_expiry_seconds,
              "a registration silent this long is removed (placement, page, store)");
  moe::transport::TlsOptions tls;
  moe::AddTlsFlags(flags, &tls);
  if (int rc = flags.Parse(argc, argv); rc >= 0) return rc;
  return moe::RunServer(
      "router-svc", [&]() -> absl::StatusOr<std::unique_ptr<moe::router_svc::RouterServer>> {
        MOE_RETURN_IF_ERROR(moe::transport::ConfigureProcessTls(tls, /*server=*/true));
        return moe::router_svc::RouterServer::Start(o);
      });
}
