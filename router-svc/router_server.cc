#include "router-svc/router_server.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "moe/v1/router.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/k3_names.h"
#include "services/common/status_macros.h"
#include "services/metrics/http_server.h"
#include "services/metrics/metrics_server.h"
#include "services/metrics/service_metrics.h"
#include "services/numerics/qb.h"
#include "services/transport/grpc_server.h"
#include "services/transport/status_convert.h"

namespace moe::router_svc {

// The page's files, embedded at build time from router-svc/web/ (cmake/embed_file.cmake).
namespace web {
extern const char kIndexHtml[];
extern const std::size_t kIndexHtmlSize;
extern const char kAppJs[];
extern const std::size_t kAppJsSize;
extern const char kStyleCss[];
extern const std::size_t kStyleCssSize;
}  // namespace web

namespace {

using Clock = std::chrono::steady_clock;
using numerics::QbHistogram;

int64_t UnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

absl::StatusOr<v1::BiasMode> ParseMode(const std::string& s) {
  if (s == "frozen") return v1::BIAS_MODE_FROZEN;
  if (s == "rebalance") return v1::BIAS_MODE_REBALANCE;
  if (s == "continuous") return v1::BIAS_MODE_CONTINUOUS;
  return absl::InvalidArgumentError(
      absl::StrCat("bias mode '", s, "' is not one of frozen, rebalance, continuous"));
}

void FillBalance(const numerics::BalanceMetrics& m, v1::Balance* b) {
  b->set_max_vio(m.max_vio);
  b->set_cv(m.cv);
  b->set_min_over_target(m.min_over_target);
  b->set_dead(m.dead);
  b->set_shard_max_over_mean(m.shard_max_over_mean);
}

template <typename Msg>
class WatchReactor;

// The streams watching placement or bias. Guarded by the router's mutex.
template <typename Msg>
using WatchSet = std::set<WatchReactor<Msg>*>;

// A server-streaming watch: Push queues a message (called with the router's mutex held),
// writes go out one at a time, and the stream ends when the client cancels or the server shuts
// down. OnDone removes the reactor from its set under the router's mutex before deleting it.
template <typename Msg>
class WatchReactor final : public grpc::ServerWriteReactor<Msg> {
 public:
  WatchReactor(std::mutex* router_mu, WatchSet<Msg>* set, std::function<bool(const Msg&)> filter)
      : router_mu_(router_mu), set_(set), filter_(std::move(filter)) {}

  void Push(const Msg& m) {
    if (filter_ && !filter_(m)) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    outbox_.push_back(m);
    if (!writing_) {
      writing_ = true;
      this->StartWrite(&outbox_.front());
    }
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    outbox_.pop_front();
    if (!ok) done_ = true;
    if (!done_ && !outbox_.empty()) {
      this->StartWrite(&outbox_.front());
      return;
    }
    writing_ = false;
    MaybeFinishLocked();
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    MaybeFinishLocked();
  }

  void OnDone() override {
    {
      std::lock_guard<std::mutex> lock(*router_mu_);
      set_->erase(this);
    }
    delete this;
  }

 private:
  void MaybeFinishLocked() {
    if (done_ && !writing_ && !finished_) {
      finished_ = true;
      this->Finish(grpc::Status::OK);
    }
  }

  std::mutex* router_mu_;
  WatchSet<Msg>* set_;
  std::function<bool(const Msg&)> filter_;
  std::mutex mu_;
  std::deque<Msg> outbox_;
  bool writing_ = false, done_ = false, finished_ = false;
};

struct Report {
  QbHistogram hist;
  std::vector<int64_t> loads;
  int64_t tokens = 0;
};

struct LayerState {
  int32_t layer = 0;
  int64_t experts = 0;
  int64_t top_k = 0;
  v1::BiasMode mode = v1::BIAS_MODE_REBALANCE;
  int64_t continuous_tokens = 0;
  std::vector<v1::LayerBias> history;  // history.back() is current; version == index
  std::deque<Report> window;
  int64_t window_tokens = 0;
  std::vector<int64_t> window_loads;
  std::vector<int64_t> total_loads;
  int64_t total_tokens = 0;
  int64_t rebalances = 0;

  const v1::LayerBias& current() const { return history.back(); }
};

struct Shard {
  std::string endpoint;
  std::vector<v1::ExpertRange> ranges;
  uint64_t lease = 0;
  Clock::time_point last_seen;
  bool healthy = true;
};

constexpr int kMaxWindowReports = 32;

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
    return Done(ctx, "RegisterExpertServer", DoRegister(*req, resp));
  }
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const v1::HeartbeatRequest* req,
                                      v1::HeartbeatResponse*) override {
    return Done(ctx, "Heartbeat", DoHeartbeat(*req));
  }
  grpc::ServerUnaryReactor* GetPlacement(grpc::CallbackServerContext* ctx,
                                         const v1::GetPlacementRequest*,
                                         v1::Placement* resp) override {
    std::lock_guard<std::mutex> lock(mu_);
    *resp = PlacementLocked();
    return Done(ctx, "GetPlacement", absl::OkStatus());
  }
  grpc::ServerWriteReactor<v1::Placement>* WatchPlacement(grpc::CallbackServerContext*,
                                                          const v1::GetPlacementRequest*) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto* r = new WatchReactor<v1::Placement>(&mu_, &placement_watchers_, nullptr);
    placement_watchers_.insert(r);
    r->Push(PlacementLocked());
    return r;
  }
  grpc::ServerUnaryReactor* GetBias(grpc::CallbackServerContext* ctx, const v1::GetBiasRequest* req,
                                    v1::LayerBias* resp) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto layer = LayerLocked(req->layer());
    if (layer.ok()) *resp = (*layer)->current();
    return Done(ctx, "GetBias", layer.status());
  }
  grpc::ServerWriteReactor<v1::LayerBias>* WatchBias(grpc::CallbackServerContext*,
                                                     const v1::WatchBiasRequest* req) override {
    std::set<int32_t> wanted(req->layers().begin(), req->layers().end());
    std::lock_guard<std::mutex> lock(mu_);
    auto* r = new WatchReactor<v1::LayerBias>(
        &mu_, &bias_watchers_,
        [wanted](const v1::LayerBias& b) { return wanted.empty() || wanted.count(b.layer()); });
    bias_watchers_.insert(r);
    for (const auto& [l, state] : layers_) r->Push(state.current());
    return r;
  }
  grpc::ServerUnaryReactor* ReportStats(grpc::CallbackServerContext* ctx,
                                        const v1::ReportStatsRequest* req,
                                        v1::ReportStatsResponse* resp) override {
    return Done(ctx, "ReportStats", DoReportStats(*req, resp));
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
    if (s.ok()) s = DoRollback(*req, resp);
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
    std::lock_guard<std::mutex> lock(mu_);
    auto layer = LayerLocked(req->layer());
    if (layer.ok()) FillLoadStatsLocked(**layer, resp);
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
  absl::StatusOr<LayerState*> LayerLocked(int32_t layer);
  absl::Status DoRegister(const v1::RegisterExpertServerRequest& req,
                          v1::RegisterExpertServerResponse* resp);
  absl::Status DoHeartbeat(const v1::HeartbeatRequest& req);
  absl::Status DoReportStats(const v1::ReportStatsRequest& req, v1::ReportStatsResponse* resp);
  absl::Status DoRollback(const v1::RollbackBiasRequest& req, v1::LayerBias* resp);
  absl::Status DoSetMode(const v1::SetBiasModeRequest& req, v1::LayerBias* resp);
  absl::Status RebalanceLocked(LayerState& l, bool dry_run, const std::string& reason,
                               v1::RebalanceResponse* resp);
  void AppendVersionLocked(LayerState& l, std::vector<float> bias, const std::string& reason);
  v1::Placement PlacementLocked() const;
  // A new placement version to every watcher (and the shard gauges).
  void PublishPlacementLocked();
  // Expert -> shard index for a layer (empty unless every expert is covered).
  std::vector<int32_t> ShardOfExpertLocked(const LayerState& l,
                                           std::vector<std::string>* names) const;
  // The window's routed tokens on each registered expert range of a layer.
  struct ShardLoad {
    std::string name;
    int32_t lo = 0, hi = 0;
    int64_t load = 0;
    bool healthy = false;
  };
  std::vector<ShardLoad> ShardLoadsLocked(const LayerState& l) const;
  void FillLoadStatsLocked(const LayerState& l, v1::LoadStats* s) const;
  void HealthLoop();

  // The load-balance page and its JSON API (web_port).
  metrics::HttpResponse HandleHttp(const metrics::HttpRequest& req);
  // Window figures of a layer as the page shows them.
  nlohmann::json StateJsonLocked(const LayerState& l) const;
  void UpdateLayerMetricsLocked(const LayerState& l);
  void UpdateShardMetricsLocked();

  RouterServerOptions options_;
  ModelConfig cfg_;
  std::unique_ptr<transport::GrpcServer> server_;
  std::unique_ptr<metrics::MetricsServer> metrics_server_;
  std::unique_ptr<metrics::RouterMetrics> metrics_;
  std::unique_ptr<metrics::HttpServer> web_;

  mutable std::mutex mu_;
  std::map<int32_t, LayerState> layers_;
  std::map<std::string, Shard> shards_;
  uint64_t next_lease_ = 1;
  uint64_t placement_version_ = 1;
  WatchSet<v1::Placement> placement_watchers_;
  WatchSet<v1::LayerBias> bias_watchers_;
  bool stopping_ = false;
  std::condition_variable stop_cv_;
  std::thread health_thread_;
};

absl::Status RouterServer::Impl::Load() {
  if (options_.checkpoint.empty()) {
    return absl::InvalidArgumentError("router-svc needs --checkpoint (config and routing bias)");
  }
  MOE_ASSIGN_OR_RETURN(v1::BiasMode mode, ParseMode(options_.bias_mode));
  MOE_ASSIGN_OR_RETURN(auto ckpt, checkpoint::Checkpoint::Open(options_.checkpoint));
  MOE_ASSIGN_OR_RETURN(cfg_, ckpt->LoadConfig());
  std::vector<int64_t> layers = options_.layers;
  if (layers.empty()) {
    for (int64_t l : cfg_.MoeLayers()) {
      if (ckpt->Contains(checkpoint::GateBiasName(l))) layers.push_back(l);
    }
  }
  if (layers.empty()) return absl::NotFoundError("the checkpoint holds no MoE layer's bias");
  for (int64_t layer : layers) {
    if (!cfg_.IsMoeLayer(layer)) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " is not a MoE layer"));
    }
    MOE_ASSIGN_OR_RETURN(checkpoint::TensorRef t, ckpt->Get(checkpoint::GateBiasName(layer)));
    if (t.data.size() != static_cast<size_t>(cfg_.num_experts) * 4) {
      return absl::InvalidArgumentError(absl::StrCat(checkpoint::GateBiasName(layer), " has ",
                                                     t.data.size(), " bytes, expected ",
                                                     cfg_.num_experts * 4));
    }
    std::vector<float> bias(static_cast<size_t>(cfg_.num_experts));
    std::memcpy(bias.data(), t.data.data(), t.data.size());
    for (size_t j = 0; j < bias.size(); ++j) {
      if (!std::isfinite(bias[j])) {
        return absl::InvalidArgumentError(
            absl::StrCat(checkpoint::GateBiasName(layer), "[", j, "] is not finite"));
      }
    }
    LayerState& s = layers_[static_cast<int32_t>(layer)];
    s.layer = static_cast<int32_t>(layer);
    s.experts = cfg_.num_experts;
    s.top_k = cfg_.top_k;
    s.mode = mode;
    s.continuous_tokens = options_.continuous_tokens;
    s.window_loads.assign(static_cast<size_t>(cfg_.num_experts), 0);
    s.total_loads.assign(static_cast<size_t>(cfg_.num_experts), 0);
    v1::LayerBias b;
    b.set_layer(s.layer);
    b.set_version(0);
    b.set_mode(mode);
    *b.mutable_bias() = {bias.begin(), bias.end()};
    b.set_reason("checkpoint");
    b.set_created_unix_ms(UnixMs());
    s.history.push_back(std::move(b));
  }
  return absl::OkStatus();
}

absl::Status RouterServer::Impl::StartServing() {
  // Metrics and the page first: the gRPC port file tells a launcher that everything is up.
  if (options_.metrics_port >= 0) {
    MOE_ASSIGN_OR_RETURN(metrics_server_,
                         metrics::MetricsServer::Start(options_.host, options_.metrics_port));
    std::vector<int64_t> layers;
    for (const auto& [l, state] : layers_) layers.push_back(l);
    metrics_ = std::make_unique<metrics::RouterMetrics>(metrics_server_->registry(), layers);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [l, state] : layers_) UpdateLayerMetricsLocked(state);
      metrics_->Shards(0, 0);
    }
    if (!options_.metrics_port_file.empty()) {
      MOE_RETURN_IF_ERROR(
          transport::WritePortFile(options_.metrics_port_file, metrics_server_->port()));
    }
  }
  if (options_.web_port >= 0) {
    MOE_ASSIGN_OR_RETURN(web_, metrics::HttpServer::Start(options_.host, options_.web_port,
                                                          [this](const metrics::HttpRequest& r) {
                                                            return HandleHttp(r);
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
  server_->SetServing(true);
  if (!options_.port_file.empty()) {
    MOE_RETURN_IF_ERROR(transport::WritePortFile(options_.port_file, server_->port()));
  }
  health_thread_ = std::thread([this] { HealthLoop(); });
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
  if (web_ != nullptr) web_->Stop();
  // Watches never end by themselves: a short grace, then the server cancels them.
  if (server_ != nullptr) server_->Shutdown(std::min(grace, absl::Milliseconds(200)));
}

absl::Status RouterServer::Impl::CheckAdmin(grpc::CallbackServerContext* ctx,
                                            const char* what) const {
  if (options_.admin_token.empty()) return absl::OkStatus();
  const auto& md = ctx->client_metadata();
  auto it = md.find("x-moe-admin-token");
  if (it != md.end() && std::string(it->second.data(), it->second.size()) == options_.admin_token) {
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
  if (req.shard().empty() || req.endpoint().empty()) {
    return absl::InvalidArgumentError("registration needs a shard name and an endpoint");
  }
  if (req.ranges_size() == 0) return absl::InvalidArgumentError("registration without ranges");
  for (const v1::ExpertRange& r : req.ranges()) {
    if (r.expert_lo() < 0 || r.expert_lo() >= r.expert_hi() || r.expert_hi() > cfg_.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat("shard ", req.shard(), ": range [",
                                                     r.expert_lo(), ", ", r.expert_hi(),
                                                     ") of layer ", r.layer(), " is invalid"));
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  Shard& s = shards_[req.shard()];
  s.endpoint = req.endpoint();
  s.ranges.assign(req.ranges().begin(), req.ranges().end());
  s.lease = next_lease_++;
  s.last_seen = Clock::now();
  s.healthy = true;
  resp->set_lease_id(s.lease);
  resp->set_heartbeat_interval_ms(options_.heartbeat_interval_ms);
  PublishPlacementLocked();
  std::fprintf(stderr, "router-svc: shard %s registered at %s (lease %llu)\n", req.shard().c_str(),
               req.endpoint().c_str(), static_cast<unsigned long long>(s.lease));
  return absl::OkStatus();
}

absl::Status RouterServer::Impl::DoHeartbeat(const v1::HeartbeatRequest& req) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [name, s] : shards_) {
    if (s.lease == req.lease_id()) {
      s.last_seen = Clock::now();
      if (!s.healthy) {
        s.healthy = true;
        PublishPlacementLocked();
      }
      return absl::OkStatus();
    }
  }
  return absl::NotFoundError(absl::StrCat("lease ", req.lease_id(), " is unknown: register"));
}

void RouterServer::Impl::HealthLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  const auto stale = std::chrono::milliseconds(3 * options_.heartbeat_interval_ms);
  while (!stop_cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stopping_; })) {
    bool changed = false;
    const auto now = Clock::now();
    for (auto& [name, s] : shards_) {
      if (s.healthy && now - s.last_seen > stale) {
        s.healthy = false;
        changed = true;
        std::fprintf(stderr, "router-svc: shard %s missed its heartbeats, unhealthy\n",
                     name.c_str());
      }
    }
    if (changed) {
      PublishPlacementLocked();
    }
  }
}

void RouterServer::Impl::PublishPlacementLocked() {
  ++placement_version_;
  const v1::Placement p = PlacementLocked();
  for (WatchReactor<v1::Placement>* w : placement_watchers_) {
    w->Push(p);
  }
  if (metrics_ != nullptr) {
    int64_t healthy = 0;
    for (const auto& [name, shard] : shards_) healthy += shard.healthy ? 1 : 0;
    metrics_->Shards(static_cast<int64_t>(shards_.size()), healthy);
  }
}

v1::Placement RouterServer::Impl::PlacementLocked() const {
  v1::Placement p;
  p.set_version(placement_version_);
  const auto now = Clock::now();
  for (const auto& [name, s] : shards_) {
    v1::ShardInfo* info = p.add_shards();
    info->set_shard(name);
    info->set_endpoint(s.endpoint);
    *info->mutable_ranges() = {s.ranges.begin(), s.ranges.end()};
    info->set_healthy(s.healthy);
    info->set_last_seen_ms(
        std::chrono::duration_cast<std::chrono::milliseconds>(now - s.last_seen).count());
  }
  return p;
}

std::vector<int32_t> RouterServer::Impl::ShardOfExpertLocked(
    const LayerState& l, std::vector<std::string>* names) const {
  std::vector<int32_t> of(static_cast<size_t>(l.experts), -1);
  names->clear();
  for (const auto& [name, s] : shards_) {
    for (const v1::ExpertRange& r : s.ranges) {
      if (r.layer() != l.layer) continue;
      const int32_t id = static_cast<int32_t>(names->size());
      names->push_back(name);
      for (int32_t e = r.expert_lo(); e < r.expert_hi(); ++e) of[e] = id;
    }
  }
  for (int32_t v : of) {
    if (v < 0) return {};
  }
  return of;
}

absl::Status RouterServer::Impl::DoReportStats(const v1::ReportStatsRequest& req,
                                               v1::ReportStatsResponse* resp) {
  std::lock_guard<std::mutex> lock(mu_);
  MOE_ASSIGN_OR_RETURN(LayerState * l, LayerLocked(req.layer()));
  if (req.loads_size() != l->experts) {
    return absl::InvalidArgumentError(absl::StrCat("report from ", req.node(), ": ",
                                                   req.loads_size(), " loads, layer ", l->layer,
                                                   " has ", l->experts, " experts"));
  }
  int64_t sum = 0;
  for (int64_t v : req.loads()) {
    if (v < 0) return absl::InvalidArgumentError("negative load in a report");
    sum += v;
  }
  if (req.tokens() < 0 || sum != req.tokens() * l->top_k) {
    return absl::InvalidArgumentError(
        absl::StrCat("report from ", req.node(), ": loads sum to ", sum,
                     ", expected tokens * k = ", req.tokens() * l->top_k));
  }
  resp->set_current_bias_version(l->current().version());
  if (req.bias_version() != l->current().version() || req.tokens() == 0) {
    for (int64_t j = 0; j < l->experts; ++j) l->total_loads[j] += req.loads(static_cast<int>(j));
    l->total_tokens += req.tokens();
    resp->set_accepted_for_window(false);
    if (metrics_ != nullptr) metrics_->Report(false);
    return absl::OkStatus();
  }
  // Everything is checked before anything is counted: a refused report changes nothing.
  MOE_ASSIGN_OR_RETURN(QbHistogram h, QbHistogram::Deserialize(req.qb_histogram()));
  if (h.window().layer != l->layer || h.window().bias_version != req.bias_version() ||
      h.num_experts() != l->experts || h.tokens() != req.tokens() || h.window().top_k != l->top_k) {
    return absl::InvalidArgumentError(
        absl::StrCat("report from ", req.node(), ": histogram (layer ", h.window().layer,
                     ", version ", h.window().bias_version, ", experts ", h.num_experts(),
                     ", tokens ", h.tokens(), ") does not match the report"));
  }
  if (!std::equal(h.loads().begin(), h.loads().end(), req.loads().begin(), req.loads().end())) {
    return absl::InvalidArgumentError(
        absl::StrCat("report from ", req.node(), ": loads differ from the histogram's"));
  }
  Report r{std::move(h), {req.loads().begin(), req.loads().end()}, req.tokens()};
  if (!l->window.empty()) {
    // Merge checks window id, version, range and shape against the window's first report.
    QbHistogram probe = l->window.front().hist;
    MOE_RETURN_IF_ERROR(probe.Merge(r.hist));
  }
  for (int64_t j = 0; j < l->experts; ++j) l->total_loads[j] += r.loads[j];
  l->total_tokens += r.tokens;
  for (int64_t j = 0; j < l->experts; ++j) l->window_loads[j] += r.loads[j];
  l->window_tokens += r.tokens;
  l->window.push_back(std::move(r));
  auto drop_front = [&] {
    for (int64_t j = 0; j < l->experts; ++j) l->window_loads[j] -= l->window.front().loads[j];
    l->window_tokens -= l->window.front().tokens;
    l->window.pop_front();
  };
  while (l->window.size() > 1 &&
         l->window_tokens - l->window.front().tokens >= options_.window_tokens) {
    drop_front();
  }
  if (l->window.size() > kMaxWindowReports) {  // bound memory: fold the two oldest together
    Report& a = l->window[0];
    const Report& b = l->window[1];
    MOE_RETURN_IF_ERROR(a.hist.Merge(b.hist));
    for (int64_t j = 0; j < l->experts; ++j) a.loads[j] += b.loads[j];
    a.tokens += b.tokens;
    l->window.erase(l->window.begin() + 1);
  }
  resp->set_accepted_for_window(true);
  if (metrics_ != nullptr) metrics_->Report(true);
  if (l->mode == v1::BIAS_MODE_CONTINUOUS && l->window_tokens >= l->continuous_tokens) {
    v1::RebalanceResponse ignored;
    MOE_RETURN_IF_ERROR(RebalanceLocked(*l, /*dry_run=*/false, "continuous", &ignored));
  }
  UpdateLayerMetricsLocked(*l);
  return absl::OkStatus();
}

void RouterServer::Impl::AppendVersionLocked(LayerState& l, std::vector<float> bias,
                                             const std::string& reason) {
  v1::LayerBias b;
  b.set_layer(l.layer);
  b.set_version(l.history.size());
  b.set_mode(l.mode);
  *b.mutable_bias() = {bias.begin(), bias.end()};
  b.set_reason(reason);
  b.set_created_unix_ms(UnixMs());
  l.history.push_back(std::move(b));
  l.window.clear();
  l.window_tokens = 0;
  std::fill(l.window_loads.begin(), l.window_loads.end(), 0);
  std::fprintf(stderr, "router-svc: layer %d bias version %llu (%s)\n", l.layer,
               static_cast<unsigned long long>(l.current().version()), reason.c_str());
  for (WatchReactor<v1::LayerBias>* w : bias_watchers_) {
    w->Push(l.current());
  }
  UpdateLayerMetricsLocked(l);
}

void RouterServer::Impl::UpdateLayerMetricsLocked(const LayerState& l) {
  if (metrics_ == nullptr) return;
  // An empty window has no imbalance to speak of: NaN (a gap in a graph), never a false 0.
  const double max_vio = l.window_tokens > 0 ? numerics::ComputeBalance(l.window_loads).max_vio
                                             : std::numeric_limits<double>::quiet_NaN();
  metrics_->Window(l.layer, max_vio, l.window_tokens);
  metrics_->BiasVersion(l.layer, l.current().version());
}

absl::Status RouterServer::Impl::RebalanceLocked(LayerState& l, bool dry_run,
                                                 const std::string& reason,
                                                 v1::RebalanceResponse* resp) {
  if (!dry_run && l.mode == v1::BIAS_MODE_FROZEN) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", l.layer, " is frozen (checkpoint bias): SetBiasMode to rebalance first"));
  }
  if (l.window.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", l.layer, ": no traffic reported with bias version ",
                     l.current().version(), " yet; nothing to balance"));
  }
  QbHistogram pooled = l.window.front().hist;
  for (size_t i = 1; i < l.window.size(); ++i) MOE_RETURN_IF_ERROR(pooled.Merge(l.window[i].hist));
  std::vector<float> next = pooled.Solve();
  std::vector<std::string> names;
  const std::vector<int32_t> shard_of = ShardOfExpertLocked(l, &names);
  resp->set_layer(l.layer);
  resp->set_window_tokens(l.window_tokens);
  FillBalance(numerics::ComputeBalance(l.window_loads, shard_of), resp->mutable_before());
  const std::vector<double> predicted = pooled.PredictLoads(next);
  std::vector<int64_t> predicted_loads(predicted.size());
  for (size_t j = 0; j < predicted.size(); ++j) predicted_loads[j] = std::llround(predicted[j]);
  FillBalance(numerics::ComputeBalance(predicted_loads, shard_of), resp->mutable_predicted_after());
  resp->set_noise_floor_max_vio(numerics::NoiseFloorMaxVio(
      l.experts, static_cast<double>(l.window_tokens) * l.top_k / l.experts));
  if (dry_run) {
    v1::LayerBias* b = resp->mutable_new_bias();
    b->set_layer(l.layer);
    b->set_version(l.history.size());
    b->set_mode(l.mode);
    *b->mutable_bias() = {next.begin(), next.end()};
    b->set_reason("dry run");
    resp->set_applied(false);
    return absl::OkStatus();
  }
  AppendVersionLocked(l, std::move(next),
                      absl::StrCat(reason, " from ", resp->window_tokens(), " tokens"));
  ++l.rebalances;
  if (metrics_ != nullptr) metrics_->Rebalanced(l.layer);
  *resp->mutable_new_bias() = l.current();
  resp->set_applied(true);
  return absl::OkStatus();
}

absl::Status RouterServer::Impl::DoRollback(const v1::RollbackBiasRequest& req,
                                            v1::LayerBias* resp) {
  std::lock_guard<std::mutex> lock(mu_);
  MOE_ASSIGN_OR_RETURN(LayerState * l, LayerLocked(req.layer()));
  if (l->mode == v1::BIAS_MODE_FROZEN) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", l->layer, " is frozen: SetBiasMode first"));
  }
  if (req.to_version() >= l->history.size()) {
    return absl::NotFoundError(absl::StrCat("layer ", l->layer, " has no bias version ",
                                            req.to_version(), " (newest ", l->current().version(),
                                            ")"));
  }
  const v1::LayerBias& old = l->history[req.to_version()];
  AppendVersionLocked(*l, {old.bias().begin(), old.bias().end()},
                      absl::StrCat("rollback to ", req.to_version()));
  *resp = l->current();
  return absl::OkStatus();
}

absl::Status RouterServer::Impl::DoSetMode(const v1::SetBiasModeRequest& req, v1::LayerBias* resp) {
  std::lock_guard<std::mutex> lock(mu_);
  MOE_ASSIGN_OR_RETURN(LayerState * l, LayerLocked(req.layer()));
  if (req.mode() == v1::BIAS_MODE_UNSPECIFIED || !v1::BiasMode_IsValid(req.mode())) {
    return absl::InvalidArgumentError("SetBiasMode needs frozen, rebalance or continuous");
  }
  if (req.continuous_tokens() < 0) {
    return absl::InvalidArgumentError("continuous_tokens must be >= 0");
  }
  l->mode = req.mode();
  if (req.continuous_tokens() > 0) l->continuous_tokens = req.continuous_tokens();
  const auto& ckpt = l->history.front().bias();
  const auto& cur = l->current().bias();
  if (req.mode() == v1::BIAS_MODE_FROZEN &&
      !std::equal(ckpt.begin(), ckpt.end(), cur.begin(), cur.end())) {
    AppendVersionLocked(*l, {ckpt.begin(), ckpt.end()}, "frozen: checkpoint bias");
  } else {
    l->history.back().set_mode(l->mode);
    for (WatchReactor<v1::LayerBias>* w : bias_watchers_) {
      w->Push(l->current());
    }
  }
  *resp = l->current();
  return absl::OkStatus();
}

std::vector<RouterServer::Impl::ShardLoad> RouterServer::Impl::ShardLoadsLocked(
    const LayerState& l) const {
  std::vector<ShardLoad> out;
  for (const auto& [name, shard] : shards_) {
    for (const v1::ExpertRange& r : shard.ranges) {
      if (r.layer() != l.layer) continue;
      int64_t load = 0;
      for (int32_t e = r.expert_lo(); e < r.expert_hi(); ++e) load += l.window_loads[e];
      out.push_back({name, r.expert_lo(), r.expert_hi(), load, shard.healthy});
    }
  }
  return out;
}

void RouterServer::Impl::FillLoadStatsLocked(const LayerState& l, v1::LoadStats* s) const {
  s->set_layer(l.layer);
  s->set_bias_version(l.current().version());
  s->set_mode(l.mode);
  *s->mutable_total_loads() = {l.total_loads.begin(), l.total_loads.end()};
  s->set_total_tokens(l.total_tokens);
  *s->mutable_window_loads() = {l.window_loads.begin(), l.window_loads.end()};
  s->set_window_tokens(l.window_tokens);
  std::vector<std::string> names;
  const std::vector<int32_t> shard_of = ShardOfExpertLocked(l, &names);
  if (l.window_tokens > 0) {
    FillBalance(numerics::ComputeBalance(l.window_loads, shard_of), s->mutable_window_balance());
  }
  for (const ShardLoad& x : ShardLoadsLocked(l)) {
    s->add_shard_names(x.name);
    s->add_shard_loads(x.load);
  }
  s->set_rebalances(l.rebalances);
  for (const v1::LayerBias& b : l.history) {
    v1::LayerBias* h = s->add_history();
    *h = b;
    h->clear_bias();
  }
}

nlohmann::json RouterServer::Impl::StateJsonLocked(const LayerState& l) const {
  std::vector<std::string> names;
  const std::vector<int32_t> shard_of = ShardOfExpertLocked(l, &names);
  const numerics::BalanceMetrics b = numerics::ComputeBalance(l.window_loads, shard_of);
  nlohmann::json j;
  j["layer"] = l.layer;
  j["bias_version"] = l.current().version();
  j["mode"] = l.mode == v1::BIAS_MODE_FROZEN       ? "frozen"
              : l.mode == v1::BIAS_MODE_CONTINUOUS ? "continuous"
                                                   : "rebalance";
  j["window_tokens"] = l.window_tokens;
  j["total_tokens"] = l.total_tokens;
  j["loads"] = l.window_loads;
  j["target"] = static_cast<double>(l.window_tokens) * l.top_k / l.experts;
  j["max_vio"] = l.window_tokens > 0 ? b.max_vio : 0.0;
  j["cv"] = l.window_tokens > 0 ? b.cv : 0.0;
  j["dead"] = l.window_tokens > 0 ? b.dead : 0;
  j["shard_max_over_mean"] = l.window_tokens > 0 ? b.shard_max_over_mean : 0.0;
  j["noise_floor"] =
      l.window_tokens > 0
          ? numerics::NoiseFloorMaxVio(l.experts,
                                       static_cast<double>(l.window_tokens) * l.top_k / l.experts)
          : 0.0;
  j["rebalances"] = l.rebalances;
  j["shards"] = nlohmann::json::array();
  for (const ShardLoad& x : ShardLoadsLocked(l)) {
    j["shards"].push_back(
        {{"name", x.name}, {"lo", x.lo}, {"hi", x.hi}, {"load", x.load}, {"healthy", x.healthy}});
  }
  j["history"] = nlohmann::json::array();
  for (const v1::LayerBias& h : l.history) {
    j["history"].push_back({{"version", h.version()},
                            {"reason", h.reason()},
                            {"created_unix_ms", h.created_unix_ms()}});
  }
  return j;
}

metrics::HttpResponse RouterServer::Impl::HandleHttp(const metrics::HttpRequest& req) {
  auto json = [](int status, const nlohmann::json& j) {
    return metrics::HttpResponse{status, "application/json", j.dump()};
  };
  auto error = [&](const absl::Status& s) {
    int status = 500;
    switch (s.code()) {
      case absl::StatusCode::kInvalidArgument:
        status = 400;
        break;
      case absl::StatusCode::kPermissionDenied:
        status = 403;
        break;
      case absl::StatusCode::kNotFound:
        status = 404;
        break;
      case absl::StatusCode::kFailedPrecondition:
        status = 412;
        break;
      default:
        break;
    }
    return json(status, {{"error", std::string(s.message())},
                         {"code", absl::StatusCodeToString(s.code())}});
  };
  if (req.method == "GET" && (req.path == "/" || req.path == "/index.html")) {
    return {200, "text/html; charset=utf-8", std::string(web::kIndexHtml, web::kIndexHtmlSize)};
  }
  if (req.method == "GET" && req.path == "/app.js") {
    return {200, "text/javascript; charset=utf-8", std::string(web::kAppJs, web::kAppJsSize)};
  }
  if (req.method == "GET" && req.path == "/style.css") {
    return {200, "text/css; charset=utf-8", std::string(web::kStyleCss, web::kStyleCssSize)};
  }
  if (req.method == "GET" && req.path == "/api/layers") {
    std::lock_guard<std::mutex> lock(mu_);
    nlohmann::json j;
    j["layers"] = nlohmann::json::array();
    for (const auto& [l, state] : layers_) j["layers"].push_back(l);
    j["experts"] = cfg_.num_experts;
    j["top_k"] = cfg_.top_k;
    return json(200, j);
  }
  int32_t layer = 0;
  auto it = req.query.find("layer");
  if (it == req.query.end() || !absl::SimpleAtoi(it->second, &layer)) {
    if (req.path.rfind("/api/", 0) == 0) {
      return error(absl::InvalidArgumentError("the query needs ?layer=<MoE layer>"));
    }
    return {404, "text/plain; charset=utf-8", "not found\n"};
  }
  if (req.method == "GET" && req.path == "/api/state") {
    std::lock_guard<std::mutex> lock(mu_);
    auto l = LayerLocked(layer);
    if (!l.ok()) return error(l.status());
    return json(200, StateJsonLocked(**l));
  }
  if (req.path == "/api/rebalance" || req.path == "/api/rollback") {
    if (req.method != "POST") return {405, "text/plain; charset=utf-8", "POST only\n"};
    // The page changes the bias only when router-svc has a token and the request carries it.
    auto token = req.headers.find("x-moe-admin-token");
    if (options_.admin_token.empty()) {
      return error(absl::PermissionDeniedError(
          "router-svc was started without --admin_token: the page cannot change the bias"));
    }
    if (token == req.headers.end() || token->second != options_.admin_token) {
      return error(absl::PermissionDeniedError(token == req.headers.end() || token->second.empty()
                                                   ? "an admin token is required"
                                                   : "the admin token is wrong"));
    }
    if (req.path == "/api/rebalance") {
      std::lock_guard<std::mutex> lock(mu_);
      auto l = LayerLocked(layer);
      if (!l.ok()) return error(l.status());
      v1::RebalanceResponse r;
      if (absl::Status s = RebalanceLocked(**l, /*dry_run=*/false, "rebalance (page)", &r);
          !s.ok()) {
        return error(s);
      }
      return json(200, {{"applied", r.applied()},
                        {"version", r.new_bias().version()},
                        {"window_tokens", r.window_tokens()},
                        {"before_max_vio", r.before().max_vio()},
                        {"predicted_max_vio", r.predicted_after().max_vio()}});
    }
    uint64_t to = 0;
    auto v = req.query.find("to");
    if (v == req.query.end() || !absl::SimpleAtoi(v->second, &to)) {
      return error(absl::InvalidArgumentError("rollback needs ?to=<version>"));
    }
    v1::RollbackBiasRequest rb;
    rb.set_layer(layer);
    rb.set_to_version(to);
    v1::LayerBias out;
    if (absl::Status s = DoRollback(rb, &out); !s.ok()) return error(s);
    return json(200, {{"version", out.version()}, {"reason", out.reason()}});
  }
  return {404, "text/plain; charset=utf-8", "not found\n"};
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
