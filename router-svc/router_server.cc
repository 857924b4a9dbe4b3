// The gRPC adapter of router-svc over its core (router_core.h): RPCs in, membership and admin
// checks, the watch streams (fed by the core's sinks), leadership among several routers (etcd),
// the health thread, the metrics and the page.
#include "router-svc/router_server.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "moe/v1/router.grpc.pb.h"
#include "router-svc/etcd_store.h"
#include "router-svc/load_balance_page.h"
#include "router-svc/router_core.h"
#include "router-svc/watch_reactor.h"
#include "services/common/logging.h"
#include "services/common/secret_file.h"
#include "services/common/status_macros.h"
#include "services/metrics/http_server.h"
#include "services/metrics/metrics_server.h"
#include "services/metrics/service_metrics.h"
#include "services/transport/grpc_server.h"
#include "services/transport/security.h"
#include "services/transport/status_convert.h"

namespace moe::router_svc {

namespace {

// How often the health of the shards is checked.
constexpr std::chrono::milliseconds kHealthCheckInterval(100);
// Watches never end by themselves: at shutdown they get at most this long, then are cancelled.
constexpr absl::Duration kWatchShutdownGrace = absl::Milliseconds(200);

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
    // Its own name only: the token names the shard (transport::ExpertMemberToken), and with
    // mutual TLS so does the certificate.
    absl::Status s = CheckExpert(ctx, "RegisterExpertServer", req->shard());
    if (s.ok()) {
      s = transport::CheckPeerMember(
          *ctx, "expert", req->shard(),
          "RegisterExpertServer of shard " + req->shard().substr(0, 128));
    }
    return Done(ctx, "RegisterExpertServer", s.ok() ? core_->Register(*req, resp) : s);
  }
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const v1::HeartbeatRequest* req,
                                      v1::HeartbeatResponse*) override {
    // ... and heartbeats only its own lease: the token (and certificate) of the lease's owner.
    // A lease nobody holds is NOT_FOUND for any caller with a token (64 random bits: nothing to
    // learn), so that a shard whose lease the router lost registers again.
    absl::Status s = CheckMember(ctx, "Heartbeat", "expert");
    const std::string owner = s.ok() ? core_->LeaseOwner(req->lease_id()) : "";
    if (!owner.empty()) {
      s = CheckExpert(ctx, "Heartbeat", owner);
      if (s.ok()) {
        s = transport::CheckPeerMember(*ctx, "expert", owner, "Heartbeat of shard " + owner);
      }
    }
    return Done(ctx, "Heartbeat", s.ok() ? core_->Heartbeat(*req) : s);
  }
  grpc::ServerUnaryReactor* GetPlacement(grpc::CallbackServerContext* ctx,
                                         const v1::GetPlacementRequest*,
                                         v1::Placement* resp) override {
    if (absl::Status s = Standby(); !s.ok()) return Done(ctx, "GetPlacement", s);
    *resp = core_->Placement();
    return Done(ctx, "GetPlacement", absl::OkStatus());
  }
  grpc::ServerWriteReactor<v1::Placement>* WatchPlacement(grpc::CallbackServerContext* ctx,
                                                          const v1::GetPlacementRequest*) override {
    WatchReactor<v1::Placement>* r = nullptr;
    // Under the core's mutex (then ours): no placement published in between is missed.
    core_->Subscribe([&](const v1::Placement& p, const std::vector<v1::LayerBias>&) {
      std::lock_guard<std::mutex> lock(watch_mu_);
      r = new WatchReactor<v1::Placement>(&watch_mu_, &placement_watchers_, nullptr, nullptr,
                                          &watch_budget_, ctx);
      placement_watchers_.insert(r);
      if (absl::Status s = AdmitWatcherLocked(); !s.ok()) {
        r->Refuse(s);
        return;
      }
      r->Push(p);
    });
    return r;
  }
  grpc::ServerUnaryReactor* GetBias(grpc::CallbackServerContext* ctx, const v1::GetBiasRequest* req,
                                    v1::LayerBias* resp) override {
    if (absl::Status s = Standby(); !s.ok()) return Done(ctx, "GetBias", s);
    absl::StatusOr<v1::LayerBias> b = core_->Bias(req->layer());
    if (b.ok()) *resp = std::move(*b);
    return Done(ctx, "GetBias", b.status());
  }
  grpc::ServerWriteReactor<v1::LayerBias>* WatchBias(grpc::CallbackServerContext* ctx,
                                                     const v1::WatchBiasRequest* req) override {
    std::set<int32_t> wanted(req->layers().begin(), req->layers().end());
    WatchReactor<v1::LayerBias>* r = nullptr;
    core_->Subscribe([&](const v1::Placement&, const std::vector<v1::LayerBias>& biases) {
      std::lock_guard<std::mutex> lock(watch_mu_);
      r = new WatchReactor<v1::LayerBias>(
          &watch_mu_, &bias_watchers_,
          [wanted](const v1::LayerBias& b) { return wanted.empty() || wanted.count(b.layer()); },
          [](const v1::LayerBias& b) { return int64_t{b.layer()}; }, &watch_budget_, ctx);
      bias_watchers_.insert(r);
      if (absl::Status s = AdmitWatcherLocked(); !s.ok()) {
        r->Refuse(s);
        return;
      }
      for (const v1::LayerBias& b : biases) r->Push(b);
    });
    return r;
  }
  grpc::ServerUnaryReactor* ReportStats(grpc::CallbackServerContext* ctx,
                                        const v1::ReportStatsRequest* req,
                                        v1::ReportStatsResponse* resp) override {
    absl::Status s = CheckMember(ctx, "ReportStats", "attention");
    if (s.ok()) s = transport::CheckPeerMember(*ctx, "attention", "", "ReportStats");
    return Done(ctx, "ReportStats", s.ok() ? core_->ReportStats(*req, resp) : s);
  }
  grpc::ServerUnaryReactor* Rebalance(grpc::CallbackServerContext* ctx,
                                      const v1::RebalanceRequest* req,
                                      v1::RebalanceResponse* resp) override {
    absl::Status s = req->dry_run() ? Standby() : CheckAdmin(ctx, "Rebalance");
    if (s.ok()) s = core_->Rebalance(req->layer(), req->dry_run(), "rebalance", resp);
    return Done(ctx, "Rebalance", s);
  }
  grpc::ServerUnaryReactor* RollbackBias(grpc::CallbackServerContext* ctx,
                                         const v1::RollbackBiasRequest* req,
                                         v1::LayerBias* resp) override {
    absl::Status s = CheckAdmin(ctx, "RollbackBias");
    if (s.ok()) s = core_->Rollback(req->layer(), req->to_version(), resp);
    return Done(ctx, "RollbackBias", s);
  }
  grpc::ServerUnaryReactor* SetBiasMode(grpc::CallbackServerContext* ctx,
                                        const v1::SetBiasModeRequest* req,
                                        v1::LayerBias* resp) override {
    absl::Status s = CheckAdmin(ctx, "SetBiasMode");
    if (s.ok()) s = core_->SetMode(*req, resp);
    return Done(ctx, "SetBiasMode", s);
  }
  grpc::ServerUnaryReactor* SetExpertBudget(grpc::CallbackServerContext* ctx,
                                            const v1::SetExpertBudgetRequest* req,
                                            v1::LayerBias* resp) override {
    absl::Status s = CheckAdmin(ctx, "SetExpertBudget");
    if (s.ok()) s = core_->SetBudget(req->layer(), req->k_avg(), "budget", resp);
    return Done(ctx, "SetExpertBudget", s);
  }
  grpc::ServerUnaryReactor* QuarantineShard(grpc::CallbackServerContext* ctx,
                                            const v1::QuarantineShardRequest* req,
                                            v1::QuarantineShardResponse* resp) override {
    std::string who;
    absl::Status s = CheckMember(ctx, "QuarantineShard", "attention");
    if (s.ok()) s = transport::CheckPeerMember(*ctx, "attention", "", "QuarantineShard", &who);
    if (s.ok()) s = core_->Quarantine(*req, who, resp);
    return Done(ctx, "QuarantineShard", s);
  }
  grpc::ServerUnaryReactor* ReleaseShard(grpc::CallbackServerContext* ctx,
                                         const v1::ReleaseShardRequest* req,
                                         v1::ReleaseShardResponse* resp) override {
    absl::Status s = CheckAdmin(ctx, "ReleaseShard");
    if (s.ok()) resp->set_released(core_->Release(req->shard()));
    return Done(ctx, "ReleaseShard", s);
  }
  grpc::ServerUnaryReactor* ReportNode(grpc::CallbackServerContext* ctx,
                                       const v1::ReportNodeRequest* req,
                                       v1::ReportNodeResponse*) override {
    absl::Status s = CheckMember(ctx, "ReportNode", "attention");
    // As ReportStats: any attention member (the node name is its word; docs/security.md).
    if (s.ok()) s = transport::CheckPeerMember(*ctx, "attention", "", "ReportNode");
    if (s.ok()) s = core_->ReportNode(*req);
    return Done(ctx, "ReportNode", s);
  }
  grpc::ServerUnaryReactor* GetLoadStats(grpc::CallbackServerContext* ctx,
                                         const v1::GetLoadStatsRequest* req,
                                         v1::LoadStats* resp) override {
    if (absl::Status s = Standby(); !s.ok()) return Done(ctx, "GetLoadStats", s);
    return Done(ctx, "GetLoadStats", core_->LoadStats(req->layer(), resp));
  }

 private:
  grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const char* method,
                                 const absl::Status& s) {
    if (!s.ok()) core_->metrics()->common.Error(method, absl::StatusCodeToString(s.code()));
    auto* r = ctx->DefaultReactor();
    r->Finish(transport::ToGrpc(s));
    return r;
  }

  absl::Status CheckAdmin(grpc::CallbackServerContext* ctx, const char* what) const;
  // A member token at all (role "expert": any token; the name is checked by CheckExpert), or
  // the role's (role "attention": transport::MemberRoleToken of the cluster secret).
  absl::Status CheckMember(grpc::CallbackServerContext* ctx, const char* what,
                           const char* role) const;
  // The expert member token of this shard name (transport::ExpertMemberToken) and, with mutual
  // TLS, a certificate naming it.
  absl::Status CheckExpert(grpc::CallbackServerContext* ctx, const char* what,
                           const std::string& shard) const;
  // etcd: campaigns until this router leads, then restores and serves; exits if it loses the
  // lease (a router that may be stale must not serve).
  void CampaignLoop();
  // UNAVAILABLE while a standby (etcd, another router leads).
  absl::Status Standby() const;
  // Whether one more watch stream (already counted) may stay: not on a standby, and at most
  // --max_watchers of them.
  absl::Status AdmitWatcherLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(watch_mu_);
  void HealthLoop();

  RouterServerOptions options_;
  std::string attention_token_;  // the attention tier's member token (Load)
  // The experts that presented their own token, by its SHA-256: a token of one used under
  // another's name is told apart from a stranger's (PERMISSION_DENIED, not UNAUTHENTICATED).
  static constexpr size_t kMaxKnownExpertTokens = 65536;
  mutable std::mutex token_mu_;
  mutable std::map<std::string, std::string> expert_token_owner_ ABSL_GUARDED_BY(token_mu_);
  std::unique_ptr<RouterCore> core_;
  std::unique_ptr<transport::GrpcServer> server_;
  std::unique_ptr<metrics::MetricsServer> metrics_server_;
  std::unique_ptr<metrics::RouterMetrics> metrics_;
  std::unique_ptr<LoadBalancePage> page_;
  std::unique_ptr<metrics::HttpServer> web_;

  EtcdStore* etcd_ = nullptr;              // with --etcd: the store, until it is the core's
  std::unique_ptr<EtcdStore> etcd_owned_;  // until elected
  std::atomic<bool> standby_{false};
  std::atomic<bool> campaign_stop_{false};
  std::thread campaign_thread_;
  // The watch streams; taken after the core's mutex (the sinks run under it), never before.
  mutable std::mutex watch_mu_;
  WatchSet<v1::Placement> placement_watchers_ ABSL_GUARDED_BY(watch_mu_);
  WatchSet<v1::LayerBias> bias_watchers_ ABSL_GUARDED_BY(watch_mu_);
  WatchBudget watch_budget_;  // the bytes all watchers hold unread (--max_watch_bytes)
  std::mutex stop_mu_;
  bool stopping_ ABSL_GUARDED_BY(stop_mu_) = false;
  std::condition_variable stop_cv_;
  std::thread health_thread_;
};

absl::Status RouterServer::Impl::Load() {
  watch_budget_.max_bytes = options_.max_watch_bytes;
  if (!options_.admin_token_file.empty()) {
    MOE_ASSIGN_OR_RETURN(options_.admin_token, ReadSecretFile(options_.admin_token_file));
  }
  if (!options_.cluster_token_file.empty()) {
    MOE_ASSIGN_OR_RETURN(options_.cluster_token, ReadSecretFile(options_.cluster_token_file));
  }
  if (!options_.cluster_token.empty()) {
    attention_token_ = transport::MemberRoleToken(options_.cluster_token, "attention");
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
  if (!options_.etcd.empty() && !options_.state_db.empty()) {
    return absl::InvalidArgumentError("--etcd and --state_db: one store, not both");
  }
  MOE_ASSIGN_OR_RETURN(core_, RouterCore::Load(options_));
  core_->SetSinks(RouterCoreSinks{[this](const v1::Placement& p) {
                                    const auto bytes = static_cast<int64_t>(p.ByteSizeLong());
                                    std::lock_guard<std::mutex> lock(watch_mu_);
                                    for (WatchReactor<v1::Placement>* w : placement_watchers_)
                                      w->Push(p, bytes);
                                  },
                                  [this](const v1::LayerBias& b) {
                                    const auto bytes = static_cast<int64_t>(b.ByteSizeLong());
                                    std::lock_guard<std::mutex> lock(watch_mu_);
                                    for (WatchReactor<v1::LayerBias>* w : bias_watchers_)
                                      w->Push(b, bytes);
                                  }});
  if (!options_.etcd.empty()) {
    MOE_ASSIGN_OR_RETURN(etcd_owned_, EtcdStore::Connect(options_.etcd, options_.etcd_prefix));
    etcd_ = etcd_owned_.get();
    standby_ = true;  // until elected
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
  const absl::Status s = core_->Restore(std::move(etcd_owned_));
  if (!s.ok()) {
    MOE_LOG_ERROR("leader {} cannot restore the state from etcd: {}; exiting", options_.name,
                  s.ToString());
    spdlog::default_logger()->flush();
    std::_Exit(3);
  }
  standby_ = false;
  server_->SetServing(true);
  MOE_LOG_INFO("{} leads (etcd {})", options_.name, options_.etcd);
}

void RouterServer::Impl::HealthLoop() {
  std::unique_lock<std::mutex> lock(stop_mu_);
  const auto stale = std::chrono::milliseconds(kMissedHeartbeats * options_.heartbeat_interval_ms);
  while (!stop_cv_.wait_for(lock, kHealthCheckInterval, [&] { return stopping_; })) {
    core_->ExpireStale(stale);
  }
}

absl::Status RouterServer::Impl::StartServing() {
  // Metrics and the page first: the gRPC port file tells a launcher that everything is up.
  if (options_.metrics_port >= 0) {
    MOE_ASSIGN_OR_RETURN(metrics_server_,
                         metrics::MetricsServer::Start(options_.host, options_.metrics_port));
    std::vector<int64_t> layers;
    core_->Subscribe([&](const v1::Placement&, const std::vector<v1::LayerBias>& biases) {
      for (const v1::LayerBias& b : biases) layers.push_back(b.layer());
    });
    metrics_ = std::make_unique<metrics::RouterMetrics>(metrics_server_->registry(), layers);
    core_->SetMetrics(metrics_.get());
  }
  if (metrics_server_ != nullptr && !options_.metrics_port_file.empty()) {
    MOE_RETURN_IF_ERROR(
        transport::WritePortFile(options_.metrics_port_file, metrics_server_->port()));
  }
  if (options_.web_port >= 0) {
    page_ = std::make_unique<LoadBalancePage>(options_.admin_token, core_->PageApi());
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
    std::lock_guard<std::mutex> lock(stop_mu_);
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

absl::Status RouterServer::Impl::CheckMember(grpc::CallbackServerContext* ctx, const char* what,
                                             const char* role) const {
  MOE_RETURN_IF_ERROR(Standby());
  if (options_.cluster_token.empty()) {
    return absl::PermissionDeniedError(
        absl::StrCat(what,
                     " needs the cluster token, and router-svc was started without one "
                     "(--cluster_token_file): membership is closed"));
  }
  const bool expert = std::string_view(role) == "expert";
  if (expert ? ctx->client_metadata().count(transport::kClusterTokenMetadata) > 0
             : transport::HasSecretMetadata(*ctx, transport::kClusterTokenMetadata,
                                            attention_token_)) {
    return absl::OkStatus();
  }
  return absl::UnauthenticatedError(absl::StrCat(what, " needs the cluster token of an ", role,
                                                 " member in the x-moe-cluster-token metadata"));
}

absl::Status RouterServer::Impl::CheckExpert(grpc::CallbackServerContext* ctx, const char* what,
                                             const std::string& shard) const {
  MOE_RETURN_IF_ERROR(CheckMember(ctx, what, "expert"));
  MOE_RETURN_IF_ERROR(CheckShardName(shard));
  const std::string own = transport::ExpertMemberToken(options_.cluster_token, shard);
  if (transport::HasSecretMetadata(*ctx, transport::kClusterTokenMetadata, own)) {
    std::lock_guard<std::mutex> lock(token_mu_);
    if (expert_token_owner_.size() < kMaxKnownExpertTokens) {
      expert_token_owner_.emplace(transport::MemberTokenDigest(own), shard);
    }
    return absl::OkStatus();
  }
  const std::string name = shard.substr(0, transport::kMaxMemberNameBytes);
  // Another expert's token (one that registered before: looked up by its digest) is a member
  // acting as someone else; any other token is no member's.
  const auto md = ctx->client_metadata().find(transport::kClusterTokenMetadata);
  const std::string digest =
      transport::MemberTokenDigest(std::string(md->second.data(), md->second.size()));
  std::lock_guard<std::mutex> lock(token_mu_);
  if (auto it = expert_token_owner_.find(digest); it != expert_token_owner_.end()) {
    return absl::PermissionDeniedError(
        absl::StrCat(what, " of shard ", name, " with the member token of shard ", it->second,
                     ": a member acts only as itself (each expert's token names it)"));
  }
  return absl::UnauthenticatedError(
      absl::StrCat(what, " of shard ", name,
                   " needs the cluster token of an expert member, that shard's own (each "
                   "expert's token names it), in the x-moe-cluster-token metadata"));
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
