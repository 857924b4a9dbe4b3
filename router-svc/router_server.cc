// The gRPC adapter and wiring of router-svc: RPCs in, domain calls under one mutex, changes out
// to the watch streams, the metrics and the page. The state lives in the classes it wires:
// PlacementRegistry (placement_registry.h), one BiasLedger and one LoadWindow per layer
// (bias_ledger.h, load_window.h), LoadBalancePage (load_balance_page.h).
#include "router-svc/router_server.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "moe/v1/router.grpc.pb.h"
#include "router-svc/bias_ledger.h"
#include "router-svc/etcd_store.h"
#include "router-svc/load_balance_page.h"
#include "router-svc/load_window.h"
#include "router-svc/placement_registry.h"
#include "router-svc/router_proto.h"
#include "router-svc/state_store.h"
#include "router-svc/watch_reactor.h"
#include "services/common/logging.h"
#include "services/common/secret_file.h"
#include "services/common/status_macros.h"
#include "services/metrics/http_server.h"
#include "services/metrics/metrics_server.h"
#include "services/metrics/service_metrics.h"
#include "services/transport/grpc_server.h"
#include "services/transport/status_convert.h"

namespace moe::router_svc {

namespace {

// A shard whose heartbeats stop for this many intervals is unhealthy.
constexpr int kMissedHeartbeats = 3;
// How often the health of the shards is checked.
constexpr std::chrono::milliseconds kHealthCheckInterval(100);
// Watches never end by themselves: at shutdown they get at most this long, then are cancelled.
constexpr absl::Duration kWatchShutdownGrace = absl::Milliseconds(200);

int64_t UnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct LayerState {
  BiasLedger ledger;
  LoadWindow window;
  int64_t rebalances = 0;
};

}  // namespace

class RouterServer::Impl final : public v1::RouterService::CallbackService {
 public:
  explicit Impl(const RouterServerOptions& o) : options_(o) {}

  absl::Status Load();
  absl::Status StartServing();
  void Shutdown(absl::Duration grace);
  int port() const { return server_ != nullptr ? server_->port() : 0; }
  void Wait() {
    if (server_ != nullptr) server_->Wait();
  }

  // RPCs (callback API; each handler is short and never blocks on I/O).
  grpc::ServerUnaryReactor* RegisterExpertServer(grpc::CallbackServerContext* ctx,
                                                 const v1::RegisterExpertServerRequest* req,
                                                 v1::RegisterExpertServerResponse* resp) override {
    absl::Status s = CheckMember(ctx, "RegisterExpertServer");
    return Done(ctx, "RegisterExpertServer", s.ok() ? DoRegister(*req, resp) : s);
  }
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const v1::HeartbeatRequest* req,
                                      v1::HeartbeatResponse*) override {
    absl::Status s = CheckMember(ctx, "Heartbeat");
    return Done(ctx, "Heartbeat", s.ok() ? DoHeartbeat(*req) : s);
  }
  grpc::ServerUnaryReactor* GetPlacement(grpc::CallbackServerContext* ctx,
                                         const v1::GetPlacementRequest*,
                                         v1::Placement* resp) override {
    if (absl::Status s = Standby(); !s.ok()) return Done(ctx, "GetPlacement", s);
    std::lock_guard<std::mutex> lock(mu_);
    *resp = ToProto(registry_->Snapshot(Clock::now()));
    return Done(ctx, "GetPlacement", absl::OkStatus());
  }
  grpc::ServerWriteReactor<v1::Placement>* WatchPlacement(grpc::CallbackServerContext*,
                                                          const v1::GetPlacementRequest*) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto* r = new WatchReactor<v1::Placement>(&mu_, &placement_watchers_, nullptr);
    placement_watchers_.insert(r);
    if (absl::Status s = AdmitWatcherLocked(); !s.ok()) {
      r->Refuse(s);
      return r;
    }
    r->Push(ToProto(registry_->Snapshot(Clock::now())));
    return r;
  }
  grpc::ServerUnaryReactor* GetBias(grpc::CallbackServerContext* ctx, const v1::GetBiasRequest* req,
                                    v1::LayerBias* resp) override {
    if (absl::Status s = Standby(); !s.ok()) return Done(ctx, "GetBias", s);
    std::lock_guard<std::mutex> lock(mu_);
    auto layer = LayerLocked(req->layer());
    if (layer.ok()) *resp = ToProto((*layer)->ledger.current());
    return Done(ctx, "GetBias", layer.status());
  }
  grpc::ServerWriteReactor<v1::LayerBias>* WatchBias(grpc::CallbackServerContext*,
                                                     const v1::WatchBiasRequest* req) override {
    std::set<int32_t> wanted(req->layers().begin(), req->layers().end());
    std::lock_guard<std::mutex> lock(mu_);
    auto* r = new WatchReactor<v1::LayerBias>(
        &mu_, &bias_watchers_,
        [wanted](const v1::LayerBias& b) { return wanted.empty() || wanted.count(b.layer()); },
        [](const v1::LayerBias& b) { return int64_t{b.layer()}; });
    bias_watchers_.insert(r);
    if (absl::Status s = AdmitWatcherLocked(); !s.ok()) {
      r->Refuse(s);
      return r;
    }
    for (const auto& [l, state] : layers_) r->Push(ToProto(state.ledger.current()));
    return r;
  }
  grpc::ServerUnaryReactor* ReportStats(grpc::CallbackServerContext* ctx,
                                        const v1::ReportStatsRequest* req,
                                        v1::ReportStatsResponse* resp) override {
    absl::Status s = CheckMember(ctx, "ReportStats");
    return Done(ctx, "ReportStats", s.ok() ? DoReportStats(*req, resp) : s);
  }
  grpc::ServerUnaryReactor* Rebalance(grpc::CallbackServerContext* ctx,
                                      const v1::RebalanceRequest* req,
                                      v1::RebalanceResponse* resp) override {
    absl::Status s = req->dry_run() ? absl::OkStatus() : CheckAdmin(ctx, "Rebalance");
    if (s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      auto layer = LayerLocked(req->layer());
      s = layer.ok() ? RebalanceLocked(**layer, req->dry_run(), "rebalance", resp) : layer.status();
    }
    return Done(ctx, "Rebalance", s);
  }
  grpc::ServerUnaryReactor* RollbackBias(grpc::CallbackServerContext* ctx,
                                         const v1::RollbackBiasRequest* req,
                                         v1::LayerBias* resp) override {
    absl::Status s = CheckAdmin(ctx, "RollbackBias");
    if (s.ok()) s = DoRollback(req->layer(), req->to_version(), resp);
    return Done(ctx, "RollbackBias", s);
  }
  grpc::ServerUnaryReactor* SetBiasMode(grpc::CallbackServerContext* ctx,
                                        const v1::SetBiasModeRequest* req,
                                        v1::LayerBias* resp) override {
    absl::Status s = CheckAdmin(ctx, "SetBiasMode");
    if (s.ok()) s = DoSetMode(*req, resp);
    return Done(ctx, "SetBiasMode", s);
  }
  grpc::ServerUnaryReactor* GetLoadStats(grpc::CallbackServerContext* ctx,
                                         const v1::GetLoadStatsRequest* req,
                                         v1::LoadStats* resp) override {
    if (absl::Status s = Standby(); !s.ok()) return Done(ctx, "GetLoadStats", s);
    std::lock_guard<std::mutex> lock(mu_);
    auto layer = LayerLocked(req->layer());
    if (layer.ok()) {
      FillLoadStats((*layer)->ledger, (*layer)->window, *registry_, (*layer)->rebalances, resp);
    }
    return Done(ctx, "GetLoadStats", layer.status());
  }

 private:
  grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const char* method,
                                 const absl::Status& s) {
    if (!s.ok() && metrics_ != nullptr) {
      metrics_->common.Error(method, absl::StatusCodeToString(s.code()));
    }
    auto* r = ctx->DefaultReactor();
    r->Finish(transport::ToGrpc(s));
    return r;
  }

  absl::Status CheckAdmin(grpc::CallbackServerContext* ctx, const char* what) const;
  absl::Status CheckMember(grpc::CallbackServerContext* ctx, const char* what) const;
  absl::StatusOr<LayerState*> LayerLocked(int32_t layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status DoRegister(const v1::RegisterExpertServerRequest& req,
                          v1::RegisterExpertServerResponse* resp);
  absl::Status DoHeartbeat(const v1::HeartbeatRequest& req);
  absl::Status DoReportStats(const v1::ReportStatsRequest& req, v1::ReportStatsResponse* resp);
  absl::Status DoRollback(int32_t layer, uint64_t to, v1::LayerBias* resp);
  absl::Status DoSetMode(const v1::SetBiasModeRequest& req, v1::LayerBias* resp);
  absl::Status RebalanceLocked(LayerState& l, bool dry_run, const std::string& reason,
                               v1::RebalanceResponse* resp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new current bias version: the window restarts, watchers and metrics hear of it.
  // Stores the layer's current version and mode, then sends it to the bias watchers.
  absl::Status PublishBiasLocked(LayerState& l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PersistLocked(const LayerState& l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Opens --state_db and restores ledgers and registrations from it.
  absl::Status RestoreLocked(std::unique_ptr<StateStore> store) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // etcd: campaigns until this router leads, then restores and serves; exits if it loses the
  // lease (a router that may be stale must not serve).
  void CampaignLoop();
  // UNAVAILABLE while a standby (etcd, another router leads).
  absl::Status Standby() const;
  // Whether one more watch stream (already counted) may stay: not on a standby, and at most
  // --max_watchers of them.
  absl::Status AdmitWatcherLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new placement version to every watcher (and the shard gauges).
  void PublishPlacementLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateLayerMetricsLocked(const LayerState& l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  PageCallbacks PageApi();
  void HealthLoop();

  RouterServerOptions options_;
  ModelConfig cfg_;
  std::unique_ptr<transport::GrpcServer> server_;
  std::unique_ptr<metrics::MetricsServer> metrics_server_;
  std::unique_ptr<metrics::RouterMetrics> metrics_;
  std::unique_ptr<LoadBalancePage> page_;
  std::unique_ptr<metrics::HttpServer> web_;

  mutable std::mutex mu_;
  std::unique_ptr<PlacementRegistry> registry_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<StateStore> store_ ABSL_GUARDED_BY(mu_);  // null: nothing survives a restart
  EtcdStore* etcd_ = nullptr;              // with --etcd: the store, before it is store_
  std::unique_ptr<EtcdStore> etcd_owned_;  // until elected
  std::atomic<bool> standby_{false};
  std::atomic<bool> campaign_stop_{false};
  std::thread campaign_thread_;
  std::map<int32_t, LayerState> layers_ ABSL_GUARDED_BY(mu_);
  WatchSet<v1::Placement> placement_watchers_ ABSL_GUARDED_BY(mu_);
  WatchSet<v1::LayerBias> bias_watchers_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::condition_variable stop_cv_;
  std::thread health_thread_;
};

absl::Status RouterServer::Impl::Load() {
  if (!options_.admin_token_file.empty()) {
    MOE_ASSIGN_OR_RETURN(options_.admin_token, ReadSecretFile(options_.admin_token_file));
  }
  if (!options_.cluster_token_file.empty()) {
    MOE_ASSIGN_OR_RETURN(options_.cluster_token, ReadSecretFile(options_.cluster_token_file));
  }
  if (options_.cluster_token.empty()) {
    MOE_LOG_WARN(
        "no cluster token: registrations, heartbeats and reports are refused "
        "(--cluster_token_file)");
  }
  if (options_.admin_token.empty()) {
    MOE_LOG_WARN(
        "no admin token: Rebalance, rollback and mode changes are refused (--admin_token_file)");
  }
  if (options_.checkpoint.empty()) {
    return absl::InvalidArgumentError("router-svc needs --checkpoint (config and routing bias)");
  }
  const BiasMode mode = options_.bias_mode;
  MOE_ASSIGN_OR_RETURN(auto biases, CheckpointBiases(options_.checkpoint, options_.layers, &cfg_));
  std::lock_guard<std::mutex> lock(mu_);
  registry_ = std::make_unique<PlacementRegistry>(cfg_.num_experts);
  for (auto& [l, bias] : biases) {
    layers_.emplace(
        l, LayerState{BiasLedger(l, std::move(bias), mode, options_.continuous_tokens, UnixMs()),
                      LoadWindow(l, cfg_.num_experts, cfg_.top_k, options_.window_tokens), 0});
  }
  if (!options_.etcd.empty() && !options_.state_db.empty()) {
    return absl::InvalidArgumentError("--etcd and --state_db: one store, not both");
  }
  if (!options_.etcd.empty()) {
    MOE_ASSIGN_OR_RETURN(etcd_owned_, EtcdStore::Connect(options_.etcd, options_.etcd_prefix));
    etcd_ = etcd_owned_.get();
    standby_ = true;  // until elected
  } else if (!options_.state_db.empty()) {
    MOE_ASSIGN_OR_RETURN(auto sqlite, OpenSqliteStore(options_.state_db));
    MOE_RETURN_IF_ERROR(RestoreLocked(std::move(sqlite)));
  }
  return absl::OkStatus();
}

absl::Status RouterServer::Impl::Standby() const {
  if (!standby_.load()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("router-svc ", options_.name,
                                             " is a standby: another router leads (etcd ",
                                             options_.etcd, ")"));
}

absl::Status RouterServer::Impl::AdmitWatcherLocked() const {
  MOE_RETURN_IF_ERROR(Standby());
  if (static_cast<int>(placement_watchers_.size() + bias_watchers_.size()) >
      options_.max_watchers) {
    return absl::ResourceExhaustedError(
        absl::StrCat(options_.max_watchers, " watch streams are open already (--max_watchers)"));
  }
  return absl::OkStatus();
}

void RouterServer::Impl::CampaignLoop() {
  MOE_LOG_INFO("standby: campaigning for leadership as {} (etcd {})", options_.name, options_.etcd);
  absl::StatusOr<bool> won = absl::UnavailableError("not yet");
  while (!campaign_stop_.load()) {
    won = etcd_->Campaign(
        options_.name, /*ttl_seconds=*/3, [this] { return campaign_stop_.load(); },
        [name = options_.name] {
          MOE_LOG_ERROR("{} lost its etcd lease: another router may lead now; exiting", name);
          spdlog::default_logger()->flush();
          std::_Exit(3);
        });
    if (won.ok()) break;
    MOE_LOG_WARN("etcd campaign: {}", won.status().ToString());
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  if (!won.ok() || !*won) return;  // stopping
  std::lock_guard<std::mutex> lock(mu_);
  const absl::Status s = RestoreLocked(std::move(etcd_owned_));
  if (!s.ok()) {
    MOE_LOG_ERROR("leader {} cannot restore the state from etcd: {}; exiting", options_.name,
                  s.ToString());
    spdlog::default_logger()->flush();
    std::_Exit(3);
  }
  standby_ = false;
  PublishPlacementLocked();
  server_->SetServing(true);
  MOE_LOG_INFO("{} leads (etcd {})", options_.name, options_.etcd);
}

absl::Status RouterServer::Impl::RestoreLocked(std::unique_ptr<StateStore> store) {
  store_ = std::move(store);
  MOE_ASSIGN_OR_RETURN(StoredState state, store_->Load());
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

absl::Status RouterServer::Impl::PersistLocked(const LayerState& l) {
  if (store_ == nullptr) return absl::OkStatus();
  MOE_RETURN_IF_ERROR(store_->PutBiasVersion(l.ledger.current()));
  return store_->PutMode(l.window.layer(), l.ledger.mode(), l.ledger.continuous_tokens());
}

absl::Status RouterServer::Impl::StartServing() {
  // Metrics and the page first: the gRPC port file tells a launcher that everything is up.
  if (options_.metrics_port >= 0) {
    MOE_ASSIGN_OR_RETURN(metrics_server_,
                         metrics::MetricsServer::Start(options_.host, options_.metrics_port));
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int64_t> layers;
    for (const auto& [l, state] : layers_) layers.push_back(l);
    metrics_ = std::make_unique<metrics::RouterMetrics>(metrics_server_->registry(), layers);
    for (const auto& [l, state] : layers_) UpdateLayerMetricsLocked(state);
    metrics_->Shards(0, 0);
  }
  if (metrics_server_ != nullptr && !options_.metrics_port_file.empty()) {
    MOE_RETURN_IF_ERROR(
        transport::WritePortFile(options_.metrics_port_file, metrics_server_->port()));
  }
  if (options_.web_port >= 0) {
    page_ = std::make_unique<LoadBalancePage>(options_.admin_token, PageApi());
    MOE_ASSIGN_OR_RETURN(web_, metrics::HttpServer::Start(options_.host, options_.web_port,
                                                          [this](const metrics::HttpRequest& r) {
                                                            return page_->Handle(r);
                                                          }));
    if (!options_.web_port_file.empty()) {
      MOE_RETURN_IF_ERROR(transport::WritePortFile(options_.web_port_file, web_->port()));
    }
  }
  transport::GrpcServerOptions so;
  so.host = options_.host;
  so.port = options_.port;
  so.services = {this};
  MOE_ASSIGN_OR_RETURN(server_, transport::GrpcServer::Start(so));
  if (options_.name.empty()) options_.name = server_->endpoint();
  server_->SetServing(!standby_.load());  // a standby is live, not ready
  if (!options_.port_file.empty()) {
    MOE_RETURN_IF_ERROR(transport::WritePortFile(options_.port_file, server_->port()));
  }
  health_thread_ = std::thread([this] { HealthLoop(); });
  if (etcd_ != nullptr) campaign_thread_ = std::thread([this] { CampaignLoop(); });
  return absl::OkStatus();
}

void RouterServer::Impl::Shutdown(absl::Duration grace) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    stop_cv_.notify_all();
  }
  if (health_thread_.joinable()) health_thread_.join();
  campaign_stop_ = true;
  if (campaign_thread_.joinable()) campaign_thread_.join();
  if (web_ != nullptr) web_->Stop();
  if (server_ != nullptr) server_->Shutdown(std::min(grace, kWatchShutdownGrace));
}

absl::Status RouterServer::Impl::CheckMember(grpc::CallbackServerContext* ctx,
                                             const char* what) const {
  MOE_RETURN_IF_ERROR(Standby());
  if (options_.cluster_token.empty()) {
    return absl::PermissionDeniedError(
        absl::StrCat(what,
                     " needs the cluster token, and router-svc was started without one "
                     "(--cluster_token_file): membership is closed"));
  }
  if (transport::HasSecretMetadata(*ctx, transport::kClusterTokenMetadata,
                                   options_.cluster_token)) {
    return absl::OkStatus();
  }
  return absl::UnauthenticatedError(
      absl::StrCat(what, " needs the cluster token in the x-moe-cluster-token metadata"));
}

absl::Status RouterServer::Impl::CheckAdmin(grpc::CallbackServerContext* ctx,
                                            const char* what) const {
  MOE_RETURN_IF_ERROR(Standby());
  if (options_.admin_token.empty()) {
    return absl::PermissionDeniedError(absl::StrCat(
        what,
        " is an admin call, and admin calls are disabled: router-svc was started without "
        "an admin token (--admin_token_file)"));
  }
  if (transport::HasSecretMetadata(*ctx, transport::kAdminTokenMetadata, options_.admin_token)) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      absl::StrCat(what,
                   " is an admin call: send the router's admin token in the "
                   "x-moe-admin-token metadata"));
}

absl::StatusOr<LayerState*> RouterServer::Impl::LayerLocked(int32_t layer) {
  auto it = layers_.find(layer);
  if (it == layers_.end()) {
    std::string known;
    for (const auto& [l, s] : layers_) absl::StrAppend(&known, known.empty() ? "" : ",", l);
    return absl::NotFoundError(
        absl::StrCat("layer ", layer, " is not managed by this router (layers ", known, ")"));
  }
  return &it->second;
}

absl::Status RouterServer::Impl::DoRegister(const v1::RegisterExpertServerRequest& req,
                                            v1::RegisterExpertServerResponse* resp) {
  const std::vector<LayerRange> ranges = FromProto(req.ranges());
  const std::string data_plane = req.data_plane().empty() ? "grpc" : req.data_plane();
  std::lock_guard<std::mutex> lock(mu_);
  MOE_ASSIGN_OR_RETURN(uint64_t lease, registry_->Register(req.shard(), req.endpoint(), ranges,
                                                           Clock::now(), data_plane));
  if (store_ != nullptr) {
    MOE_RETURN_IF_ERROR(store_->PutShard({req.shard(), req.endpoint(), data_plane, lease, ranges}));
  }
  resp->set_lease_id(lease);
  resp->set_heartbeat_interval_ms(options_.heartbeat_interval_ms);
  PublishPlacementLocked();
  MOE_LOG_INFO("shard {} registered at {}", req.shard(), req.endpoint());
  return absl::OkStatus();
}

absl::Status RouterServer::Impl::DoHeartbeat(const v1::HeartbeatRequest& req) {
  std::lock_guard<std::mutex> lock(mu_);
  MOE_ASSIGN_OR_RETURN(bool revived, registry_->Heartbeat(req.lease_id(), Clock::now()));
  if (revived) PublishPlacementLocked();
  return absl::OkStatus();
}

void RouterServer::Impl::HealthLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  const auto stale = std::chrono::milliseconds(kMissedHeartbeats * options_.heartbeat_interval_ms);
  while (!stop_cv_.wait_for(lock, kHealthCheckInterval, [&] { return stopping_; })) {
    const std::vector<std::string> expired = registry_->ExpireStale(Clock::now(), stale);
    for (const std::string& name : expired) {
      MOE_LOG_WARN("shard {} missed its heartbeats, unhealthy", name);
    }
    if (!expired.empty()) PublishPlacementLocked();
  }
}

void RouterServer::Impl::PublishPlacementLocked() {
  const v1::Placement p = ToProto(registry_->Snapshot(Clock::now()));
  for (WatchReactor<v1::Placement>* w : placement_watchers_) w->Push(p);
  if (metrics_ != nullptr) metrics_->Shards(registry_->shards(), registry_->healthy_shards());
}

absl::Status RouterServer::Impl::DoReportStats(const v1::ReportStatsRequest& req,
                                               v1::ReportStatsResponse* resp) {
  const StatsReport r = FromProto(req);
  std::lock_guard<std::mutex> lock(mu_);
  MOE_ASSIGN_OR_RETURN(LayerState * l, LayerLocked(req.layer()));
  MOE_ASSIGN_OR_RETURN(ReportResult result, l->window.Add(r, l->ledger.current().version));
  resp->set_current_bias_version(l->ledger.current().version);
  resp->set_accepted_for_window(result == ReportResult::kCurrent);
  if (metrics_ != nullptr) metrics_->Report(result == ReportResult::kCurrent);
  if (result == ReportResult::kStale) return absl::OkStatus();
  if (l->ledger.mode() == BiasMode::kContinuous &&
      l->window.window_tokens() >= l->ledger.continuous_tokens()) {
    v1::RebalanceResponse ignored;
    MOE_RETURN_IF_ERROR(RebalanceLocked(*l, /*dry_run=*/false, "continuous", &ignored));
  }
  UpdateLayerMetricsLocked(*l);
  return absl::OkStatus();
}

absl::Status RouterServer::Impl::PublishBiasLocked(LayerState& l) {
  // Stored before anyone routes with it: a version that was served is never lost.
  MOE_RETURN_IF_ERROR(PersistLocked(l));
  l.window.Clear();
  const BiasVersion& cur = l.ledger.current();
  MOE_LOG_INFO("layer {} bias version {} ({})", cur.layer, cur.version, cur.reason);
  const v1::LayerBias b = ToProto(cur);
  for (WatchReactor<v1::LayerBias>* w : bias_watchers_) w->Push(b);
  UpdateLayerMetricsLocked(l);
  return absl::OkStatus();
}

void RouterServer::Impl::UpdateLayerMetricsLocked(const LayerState& l) {
  if (metrics_ == nullptr) return;
  // An empty window has no imbalance to speak of: NaN (a gap in a graph), never a false 0.
  const double max_vio = l.window.window_tokens() > 0
                             ? numerics::ComputeBalance(l.window.window_loads()).max_vio
                             : std::numeric_limits<double>::quiet_NaN();
  metrics_->Window(l.window.layer(), max_vio, l.window.window_tokens());
  metrics_->BiasVersion(l.window.layer(), l.ledger.current().version);
}

absl::Status RouterServer::Impl::RebalanceLocked(LayerState& l, bool dry_run,
                                                 const std::string& reason,
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
    BiasVersion next{
        layer, l.ledger.history().size(), l.ledger.mode(), std::move(plan.bias), "dry run", 0};
    *resp->mutable_new_bias() = ToProto(next);
    resp->set_applied(false);
    return absl::OkStatus();
  }
  l.ledger.Append(std::move(plan.bias),
                  absl::StrCat(reason, " from ", plan.window_tokens, " tokens"), UnixMs());
  ++l.rebalances;
  if (metrics_ != nullptr) metrics_->Rebalanced(layer);
  MOE_RETURN_IF_ERROR(PublishBiasLocked(l));
  *resp->mutable_new_bias() = ToProto(l.ledger.current());
  resp->set_applied(true);
  return absl::OkStatus();
}

absl::Status RouterServer::Impl::DoRollback(int32_t layer, uint64_t to, v1::LayerBias* resp) {
  std::lock_guard<std::mutex> lock(mu_);
  MOE_ASSIGN_OR_RETURN(LayerState * l, LayerLocked(layer));
  MOE_ASSIGN_OR_RETURN(const BiasVersion* v, l->ledger.Rollback(to, UnixMs()));
  MOE_RETURN_IF_ERROR(PublishBiasLocked(*l));
  *resp = ToProto(*v);
  return absl::OkStatus();
}

absl::Status RouterServer::Impl::DoSetMode(const v1::SetBiasModeRequest& req, v1::LayerBias* resp) {
  MOE_ASSIGN_OR_RETURN(BiasMode mode, FromProto(req.mode()));
  std::lock_guard<std::mutex> lock(mu_);
  MOE_ASSIGN_OR_RETURN(LayerState * l, LayerLocked(req.layer()));
  MOE_ASSIGN_OR_RETURN(bool new_version,
                       l->ledger.SetMode(mode, req.continuous_tokens(), UnixMs()));
  if (new_version) {
    MOE_RETURN_IF_ERROR(PublishBiasLocked(*l));
  } else {
    MOE_RETURN_IF_ERROR(PersistLocked(*l));
    const v1::LayerBias b = ToProto(l->ledger.current());
    for (WatchReactor<v1::LayerBias>* w : bias_watchers_) w->Push(b);
  }
  *resp = ToProto(l->ledger.current());
  return absl::OkStatus();
}

PageCallbacks RouterServer::Impl::PageApi() {
  PageCallbacks cb;
  cb.layers = [this] {
    std::lock_guard<std::mutex> lock(mu_);
    nlohmann::json j;
    j["layers"] = nlohmann::json::array();
    for (const auto& [l, state] : layers_) j["layers"].push_back(l);
    j["experts"] = cfg_.num_experts;
    j["top_k"] = cfg_.top_k;
    return j;
  };
  cb.state = [this](int32_t layer) -> absl::StatusOr<nlohmann::json> {
    std::lock_guard<std::mutex> lock(mu_);
    MOE_ASSIGN_OR_RETURN(LayerState * l, LayerLocked(layer));
    return LayerStateJson(l->ledger, l->window,
                          registry_->ShardLoads(layer, l->window.window_loads()),
                          registry_->ShardOfExpert(layer), l->rebalances);
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
  cb.rollback = [this](int32_t layer, uint64_t to) -> absl::StatusOr<nlohmann::json> {
    v1::LayerBias out;
    MOE_RETURN_IF_ERROR(DoRollback(layer, to, &out));
    return nlohmann::json{{"version", out.version()}, {"reason", out.reason()}};
  };
  return cb;
}

RouterServer::RouterServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RouterServer::~RouterServer() { Shutdown(absl::ZeroDuration()); }

absl::StatusOr<std::unique_ptr<RouterServer>> RouterServer::Start(
    const RouterServerOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  MOE_RETURN_IF_ERROR(impl->Load());
  MOE_RETURN_IF_ERROR(impl->StartServing());
  return std::unique_ptr<RouterServer>(new RouterServer(std::move(impl)));
}

int RouterServer::port() const { return impl_->port(); }
void RouterServer::Shutdown(absl::Duration grace) { impl_->Shutdown(grace); }
void RouterServer::Wait() { impl_->Wait(); }

}  // namespace moe::router_svc
