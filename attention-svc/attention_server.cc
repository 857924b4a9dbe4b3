// attention-svc's server: the core (attention_core.h) with its fronts around it, router-svc's
// watches fed into it and its statistics reported back. Each front is an adapter over the core
// with one line here: moe.v1.AttentionService (attention_grpc.h) and the Open Inference
// Protocol (oip_service.h) on the gRPC port, the protocol's REST form (oip_rest.h) on
// --http_port.
#include "attention-svc/attention_server.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "attention-svc/attention_core.h"
#include "attention-svc/attention_grpc.h"
#include "attention-svc/oip_rest.h"
#include "attention-svc/oip_service.h"
#include "services/client/router_link.h"
#include "services/common/logging.h"
#include "services/common/secret_file.h"
#include "services/common/status_macros.h"
#include "services/common/version.h"
#include "services/metrics/http_routes.h"
#include "services/metrics/http_server.h"
#include "services/metrics/metrics_server.h"
#include "services/metrics/process_collector.h"
#include "services/metrics/service_metrics.h"
#include "services/transport/grpc_server.h"

namespace moe::attention_svc {

class AttentionServer::Impl {
 public:
  explicit Impl(const AttentionServerOptions& o) : options_(o) {}
  ~Impl() { Shutdown(absl::ZeroDuration()); }

  absl::Status Start();
  void Shutdown(absl::Duration grace);
  int port() const { return server_ != nullptr ? server_->port() : 0; }
  void Wait() {
    if (server_ != nullptr) server_->Wait();
  }

 private:
  absl::Status StartMetrics();
  absl::Status StartHttp();
  OipService::Hooks OipHooks();
  void ReportLoop();
  void ReportNow();
  void SendQuarantine(const v1::QuarantineShardRequest& q);

  AttentionServerOptions options_;
  std::unique_ptr<metrics::MetricsServer> metrics_server_;
  std::unique_ptr<metrics::AttentionMetrics> metrics_;
  std::unique_ptr<AttentionCore> core_;
  // moe_ucx_messages_dropped_total, read from the core's data plane at every scrape (stopped
  // before the core goes).
  std::shared_ptr<metrics::ScrapedCounter> dp_drops_;
  std::unique_ptr<AttentionGrpcFront> grpc_front_;
  std::unique_ptr<OipService> oip_;  // the Open Inference Protocol front
  std::unique_ptr<metrics::HttpServer> http_;
  std::unique_ptr<transport::GrpcServer> server_;
  std::unique_ptr<client::RouterLink> router_;  // placement and bias watches, reports
  std::thread report_thread_;
  std::mutex mu_;
  std::condition_variable stop_cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<v1::QuarantineShardRequest> quarantines_ ABSL_GUARDED_BY(mu_);  // to router-svc
};

absl::Status AttentionServer::Impl::Start() {
  if (options_.router.empty()) {
    return absl::InvalidArgumentError("attention-svc needs --router (placement and bias)");
  }
  if (!options_.cluster_token_file.empty()) {
    MOE_ASSIGN_OR_RETURN(options_.cluster_token, ReadSecretFile(options_.cluster_token_file));
  }
  MOE_ASSIGN_OR_RETURN(core_, AttentionCore::Load(options_));
  MOE_RETURN_IF_ERROR(StartMetrics());
  MOE_RETURN_IF_ERROR(core_->Start(metrics_.get()));
  if (metrics_server_ != nullptr && !core_->data_planes().empty()) {
    dp_drops_ = metrics::UcxMessagesDropped(core_->data_planes());
    metrics_server_->Add(dp_drops_);
  }
  router_ = std::make_unique<client::RouterLink>(options_.router, client::RouterLinkTimings{},
                                                 options_.cluster_token);
  // The fronts: each an adapter over the core, one line each.
  grpc_front_ = std::make_unique<AttentionGrpcFront>(core_.get());
  oip_ = std::make_unique<OipService>(OipHooks());
  MOE_RETURN_IF_ERROR(StartHttp());
  transport::GrpcServerOptions so;
  so.host = options_.host;
  so.port = options_.port;
  so.max_receive_message_bytes = options_.max_message_bytes;
  so.max_send_message_bytes = options_.max_message_bytes;
  so.services = {grpc_front_.get(), oip_.get()};
  MOE_ASSIGN_OR_RETURN(server_, transport::GrpcServer::Start(so));
  // Ready: every hosted layer placed on healthy shards and the last readiness canary matched
  // (readiness_canary.h); a placement and a canary's outcome each may change it.
  core_->OnReadinessChange([this](bool ready) { server_->SetServing(ready); });
  router_->WatchPlacement([this](const v1::Placement& p) {
    core_->ApplyPlacement(p);
    if (server_ != nullptr) server_->SetServing(core_->Ready());
  });
  router_->WatchBias(core_->layers(), [this](const v1::LayerBias& b) { core_->ApplyBias(b); });
  // A shard a twin audit caught: the core stopped sending to it; router-svc hears of it from the
  // report thread at once (not on a request's worker).
  core_->OnQuarantine([this](const ShardQuarantine& q) {
    v1::QuarantineShardRequest req;
    req.set_shard(q.shard.shard);
    req.set_endpoint(q.shard.endpoint);
    req.set_layer(q.layer);
    req.set_evidence(q.evidence.substr(0, 1024));
    req.set_suspect_answers(q.suspect_answers);
    {
      std::lock_guard<std::mutex> lock(mu_);
      quarantines_.push_back(std::move(req));
    }
    stop_cv_.notify_all();
  });
  report_thread_ = std::thread([this] { ReportLoop(); });
  if (!options_.port_file.empty()) {
    MOE_RETURN_IF_ERROR(transport::WritePortFile(options_.port_file, server_->port()));
  }
  return absl::OkStatus();
}

absl::Status AttentionServer::Impl::StartMetrics() {
  if (options_.metrics_port < 0) return absl::OkStatus();
  MOE_ASSIGN_OR_RETURN(metrics_server_,
                       metrics::MetricsServer::Start(options_.host, options_.metrics_port));
  std::vector<int64_t> layers;
  for (int32_t l : core_->layers()) layers.push_back(l);
  metrics_ = std::make_unique<metrics::AttentionMetrics>(metrics_server_->registry(), layers,
                                                         core_->config().num_experts,
                                                         options_.per_expert_metrics);
  if (!options_.metrics_port_file.empty()) {
    MOE_RETURN_IF_ERROR(
        transport::WritePortFile(options_.metrics_port_file, metrics_server_->port()));
  }
  return absl::OkStatus();
}

OipService::Hooks AttentionServer::Impl::OipHooks() {
  const ModelConfig& cfg = core_->config();
  OipService::Hooks hooks;
  hooks.version = BuildVersion();
  hooks.hidden = cfg.hidden;
  hooks.latent = cfg.latent;
  hooks.top_k = cfg.top_k;
  hooks.num_experts = cfg.num_experts;
  hooks.model = cfg.name;
  hooks.default_timeout_ms = options_.default_timeout_ms;
  hooks.layers = core_->layers();
  AttentionCore* core = core_.get();
  hooks.forward = [core](const v1::ForwardRequest& r, absl::Time deadline,
                         v1::ForwardResponse* out) {
    return core->Serve(r, deadline, out, "ModelInfer");
  };
  hooks.submit = [core](std::function<void()> f) { return core->Submit(std::move(f)); };
  hooks.on_error = [core](const char* method, const absl::Status& s) {
    core->CountRefusal(method, s);
  };
  hooks.layer_ready = [core](int32_t layer) {
    return core->LayerReady(layer) && core->CanaryReady();
  };
  return hooks;
}

absl::Status AttentionServer::Impl::StartHttp() {
  if (options_.http_port < 0) return absl::OkStatus();
  // The REST fronts, one line each (http_routes.h): a second flavour is its adapter and a line.
  metrics::HttpRoutes routes;
  routes.Add("v2", std::make_shared<OipRest>(oip_.get(), options_.default_timeout_ms));
  // Event-driven (http_server.h): idle and slow clients hold sockets, not threads. The handler
  // threads each run one ModelInfer at a time; a body may take up to 30 s to arrive.
  metrics::HttpServerOptions ho;
  ho.workers = 16;
  ho.max_body_bytes = static_cast<size_t>(std::max<int64_t>(options_.max_http_body_bytes, 1));
  ho.request_deadline = absl::Seconds(30);
  MOE_ASSIGN_OR_RETURN(
      http_, metrics::HttpServer::Start(options_.host, options_.http_port, routes.AsHandler(), ho));
  MOE_LOG_INFO("Open Inference Protocol REST front on port {}", http_->port());
  if (!options_.http_port_file.empty()) {
    MOE_RETURN_IF_ERROR(transport::WritePortFile(options_.http_port_file, http_->port()));
  }
  return absl::OkStatus();
}

void AttentionServer::Impl::Shutdown(absl::Duration grace) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (router_ != nullptr) router_->Stop();  // ends the watches; reports still go out
  if (core_ != nullptr) core_->OnReadinessChange(nullptr);  // no canary reaches a stopped server
  if (server_ != nullptr) server_->Shutdown(grace);
  if (http_ != nullptr) http_->Stop();  // its inferences wait on the workers: before them
  if (core_ != nullptr) core_->Stop();  // runs what is queued, joins, closes the channels
  if (report_thread_.joinable()) report_thread_.join();
  if (dp_drops_ != nullptr) dp_drops_->Stop();
  ReportNow();  // the last partial window
}

void AttentionServer::Impl::ReportNow() {
  if (core_ == nullptr || router_ == nullptr) return;
  if (absl::Status s = router_->ReportNode(core_->NodeReport()); !s.ok()) {
    MOE_LOG_WARN("ReportNode failed: {}", s.ToString());
  }
  for (const v1::ReportStatsRequest& req : core_->TakeReports()) {
    if (auto r = router_->ReportStats(req); !r.ok()) {
      MOE_LOG_WARN("ReportStats failed: {}", r.status().ToString());
    }
  }
}

void AttentionServer::Impl::ReportLoop() {
  const auto every = std::chrono::milliseconds(options_.report_interval_ms);
  auto next = std::chrono::steady_clock::now() + every;
  for (;;) {
    std::deque<v1::QuarantineShardRequest> quarantines;
    {
      std::unique_lock<std::mutex> lock(mu_);
      stop_cv_.wait_until(lock, next, [&] { return stopping_ || !quarantines_.empty(); });
      if (stopping_) return;
      quarantines.swap(quarantines_);
    }
    for (const v1::QuarantineShardRequest& q : quarantines) SendQuarantine(q);
    if (std::chrono::steady_clock::now() >= next) {
      ReportNow();
      next = std::chrono::steady_clock::now() + every;
    }
  }
}

void AttentionServer::Impl::SendQuarantine(const v1::QuarantineShardRequest& q) {
  absl::StatusOr<v1::QuarantineShardResponse> r = router_->QuarantineShard(q);
  if (r.ok()) {
    MOE_LOG_WARN("router-svc {} shard {}", r->newly_quarantined() ? "quarantined" : "already had",
                 q.shard());
  } else {
    // This node keeps it out either way; router-svc refuses e.g. to take a range's last
    // replica out.
    MOE_LOG_ERROR("router-svc did not quarantine shard {}: {}", q.shard(), r.status().ToString());
  }
}

AttentionServer::AttentionServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
AttentionServer::~AttentionServer() { Shutdown(absl::ZeroDuration()); }

absl::StatusOr<std::unique_ptr<AttentionServer>> AttentionServer::Start(
    const AttentionServerOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  MOE_RETURN_IF_ERROR(impl->Start());
  return std::unique_ptr<AttentionServer>(new AttentionServer(std::move(impl)));
}

int AttentionServer::port() const { return impl_->port(); }
void AttentionServer::Shutdown(absl::Duration grace) { impl_->Shutdown(grace); }
void AttentionServer::Wait() { impl_->Wait(); }

}  // namespace moe::attention_svc
