#include "attention-svc/attention_server.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "attention-svc/dispatch_plan.h"
#include "attention-svc/expert_channel.h"
#include "attention-svc/expert_channel_grpc.h"
#include "attention-svc/expert_channel_ucx.h"
#include "attention-svc/oip_service.h"
#include "attention-svc/replica_picker.h"
#include "moe/v1/attention.grpc.pb.h"
#include "moe/v1/router.grpc.pb.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/router_link.h"
#include "services/common/logging.h"
#include "services/common/secret_file.h"
#include "services/common/status_macros.h"
#include "services/common/work_queue.h"
#include "services/dataplane/ucx_worker.h"
#include "services/metrics/metrics_server.h"
#include "services/metrics/service_metrics.h"
#include "services/numerics/combine.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/numerics/qb.h"
#include "services/transport/grpc_server.h"
#include "services/transport/status_convert.h"
#include "services/transport/stream_reactor.h"
#include "services/transport/tensor_codec.h"

namespace moe::attention_svc {

using numerics::LayerTimings;
using numerics::QbHistogram;
using numerics::cpu::CpuMoeLayer;
using numerics::cpu::RoutedBatch;
using tensor::Bf16;

namespace {

using Clock = std::chrono::steady_clock;

// The expert calls end this share of the time left before the caller's deadline, within
// [min, max], so that the caller hears which shard was late rather than a bare
// DEADLINE_EXCEEDED from its own clock.
constexpr double kExpertDeadlineShare = 0.1;
constexpr absl::Duration kExpertDeadlineMarginMin = absl::Milliseconds(10);
constexpr absl::Duration kExpertDeadlineMarginMax = absl::Milliseconds(100);
using ForwardStreamReactor = transport::StreamReactor<v1::ForwardRequest, v1::ForwardResponse>;

// A ForwardStream answer that carries a batch's own failure (the stream goes on).
v1::ForwardResponse StreamError(uint64_t request_id, const absl::Status& s) {
  v1::ForwardResponse resp;
  resp.set_request_id(request_id);
  resp.set_code(static_cast<int>(s.code()));
  resp.set_message(std::string(s.message()));
  return resp;
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

struct HostedLayer {
  std::unique_ptr<CpuMoeLayer> layer;
  std::mutex mu;  // CpuMoeLayer is not reentrant
  std::vector<float> checkpoint_bias;
};

struct BiasEntry {
  uint64_t version = 0;
  std::vector<float> bias;
};

}  // namespace

class AttentionServer::Impl final : public v1::AttentionService::CallbackService {
 public:
  explicit Impl(const AttentionServerOptions& o) : options_(o) {}
  ~Impl() override;

  absl::Status Load();
  absl::Status StartServing();
  void Shutdown(absl::Duration grace);
  int port() const { return server_ != nullptr ? server_->port() : 0; }
  void Wait() {
    if (server_ != nullptr) server_->Wait();
  }

  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* ctx, const v1::ForwardRequest* req,
                                    v1::ForwardResponse* resp) override;
  grpc::ServerBidiReactor<v1::ForwardRequest, v1::ForwardResponse>* ForwardStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* ctx,
                                         const v1::GetModelInfoRequest* req,
                                         v1::ModelInfo* resp) override;

 private:
  absl::Status RunForward(const v1::ForwardRequest& req, absl::Time deadline,
                          v1::ForwardResponse* resp);
  // RunForward plus its metrics (latency, errors by code, bytes from and to the client).
  // Queues work for the workers (false: the queue is full); the queue depth gauge follows.
  bool Submit(std::function<void()> work) {
    const bool queued = workers_->Submit(std::move(work));
    if (metrics_ != nullptr) metrics_->common.QueueDepth(static_cast<int64_t>(workers_->queued()));
    return queued;
  }
  absl::Status ServeForward(const v1::ForwardRequest& req, absl::Time deadline,
                            v1::ForwardResponse* resp, const char* method);
  void Accumulate(int32_t layer, uint64_t version, const std::vector<float>& bias,
                  const RoutedBatch& batch);
  void ApplyPlacement(const v1::Placement& p);
  void ApplyBias(const v1::LayerBias& b);
  std::shared_ptr<ExpertChannel> ChannelFor(const ShardRef& s);
  // Sends one message to route.shards[target] (counted as outstanding there, and on the wire).
  void SendTo(const LayerRoute& route, size_t target, const DispatchHeader& header,
              const DispatchMessage& m, std::unique_ptr<ExpertCall>* call, const char** transport,
              int64_t* bytes_sent);
  ReplicaPicker picker_;
  void ReportLoop();
  void ReportNow();
  bool SleepUnlessStopping(std::chrono::milliseconds d);

  AttentionServerOptions options_;
  ModelConfig cfg_;
  std::map<int32_t, std::unique_ptr<HostedLayer>> layers_;
  std::unique_ptr<transport::GrpcServer> server_;
  std::unique_ptr<metrics::MetricsServer> metrics_server_;
  std::unique_ptr<metrics::AttentionMetrics> metrics_;
  std::unique_ptr<WorkQueue> workers_;
  std::unique_ptr<client::RouterLink> router_;  // placement and bias watches, reports
  // The UCX worker of the out-of-band data plane (null: in band only). Declared before the
  // channels so that it outlives them.
  std::unique_ptr<dataplane::UcxWorker> ucx_;
  std::unique_ptr<OipService> oip_;  // the Open Inference Protocol front

  std::mutex mu_;
  std::map<int32_t, std::shared_ptr<const BiasEntry>> bias_ ABSL_GUARDED_BY(mu_);
  std::map<int32_t, std::shared_ptr<const LayerRoute>> routes_ ABSL_GUARDED_BY(mu_);
  std::map<int32_t, bool> covered_ ABSL_GUARDED_BY(mu_);  // every expert has a healthy shard
  v1::Placement placement_ ABSL_GUARDED_BY(mu_);          // the last one from router-svc
  // by shard@endpoint
  std::map<std::string, std::shared_ptr<ExpertChannel>> channels_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::condition_variable stop_cv_;

  std::mutex stats_mu_;
  std::map<int32_t, std::optional<QbHistogram>> stats_ ABSL_GUARDED_BY(stats_mu_);
  // finished windows of an older bias version
  std::vector<QbHistogram> outgoing_ ABSL_GUARDED_BY(stats_mu_);

  std::thread report_thread_;
};

AttentionServer::Impl::~Impl() { Shutdown(absl::ZeroDuration()); }

absl::Status AttentionServer::Impl::Load() {
  if (options_.router.empty()) {
    return absl::InvalidArgumentError("attention-svc needs --router (placement and bias)");
  }
  std::unique_ptr<checkpoint::Checkpoint> ckpt;
  if (!options_.checkpoint.empty()) {
    MOE_ASSIGN_OR_RETURN(ckpt, checkpoint::Checkpoint::Open(options_.checkpoint));
    MOE_ASSIGN_OR_RETURN(cfg_, ckpt->LoadConfig());
  } else {
    MOE_ASSIGN_OR_RETURN(cfg_, PresetConfig(options_.preset));
  }
  std::vector<int64_t> layers = options_.layers;
  if (layers.empty()) layers.push_back(cfg_.first_moe_layer);
  numerics::cpu::CpuLayerOptions lo;
  lo.threads = options_.threads;
  lo.isa = options_.isa;
  lo.experts = false;
  for (int64_t layer : layers) {
    if (!cfg_.IsMoeLayer(layer)) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " is not a MoE layer"));
    }
    numerics::MoeLayerWeights w;
    if (ckpt != nullptr) {
      checkpoint::LoadOptions opt;
      opt.dense = true;
      opt.expert_lo = 0;
      opt.expert_hi = 0;
      MOE_ASSIGN_OR_RETURN(w, checkpoint::LoadMoeLayer(*ckpt, cfg_, layer, opt));
    } else {
      checkpoint::SyntheticOptions so;
      so.seed = options_.seed;
      so.router_skew = options_.router_skew;
      w = checkpoint::SyntheticLayer(cfg_, layer, so);
      w.experts.clear();
      w.backing.clear();
      w.expert_lo = w.expert_hi = 0;
    }
    const size_t dense_bytes =
        2 * (w.gate.size() + w.down_proj.size() + w.norm.size() + w.up_proj.size() +
             w.shared_gate.size() + w.shared_up.size() + w.shared_down.size());
    MOE_LOG_INFO("layer {}: dense weights loaded ({:.1f} MB, {})", layer, dense_bytes / 1e6,
                 ckpt != nullptr ? options_.checkpoint : "synthetic");
    auto hosted = std::make_unique<HostedLayer>();
    hosted->checkpoint_bias = w.bias;
    MOE_ASSIGN_OR_RETURN(hosted->layer, CpuMoeLayer::Create(cfg_, std::move(w), lo));
    auto entry = std::make_shared<BiasEntry>();
    entry->bias = hosted->checkpoint_bias;
    bias_[static_cast<int32_t>(layer)] = std::move(entry);
    layers_[static_cast<int32_t>(layer)] = std::move(hosted);
  }
  return absl::OkStatus();
}

absl::Status AttentionServer::Impl::StartServing() {
  if (options_.metrics_port >= 0) {
    MOE_ASSIGN_OR_RETURN(metrics_server_,
                         metrics::MetricsServer::Start(options_.host, options_.metrics_port));
    std::vector<int64_t> layers;
    for (const auto& [l, hosted] : layers_) layers.push_back(l);
    metrics_ = std::make_unique<metrics::AttentionMetrics>(
        metrics_server_->registry(), layers, cfg_.num_experts, options_.per_expert_metrics);
    for (int64_t l : layers) metrics_->BiasVersion(l, 0);
    if (!options_.metrics_port_file.empty()) {
      MOE_RETURN_IF_ERROR(
          transport::WritePortFile(options_.metrics_port_file, metrics_server_->port()));
    }
  }
  if (options_.data_plane != dataplane::DataPlane::kGrpc) {
    dataplane::UcxOptions uo;
    uo.name = options_.node;
    uo.tls = options_.ucx_tls;
    auto w = dataplane::UcxWorker::Create(uo);
    if (w.ok()) {
      ucx_ = std::move(*w);
      MOE_LOG_INFO("UCX data plane up (UCX_TLS {})", ucx_->tls());
    } else if (options_.data_plane == dataplane::DataPlane::kUcx) {
      return absl::FailedPreconditionError(
          absl::StrCat("--data_plane=ucx: ", w.status().message()));
    } else {
      MOE_LOG_WARN("no UCX data plane ({}): in band only", w.status().ToString());
    }
  }
  workers_ = std::make_unique<WorkQueue>(options_.workers, options_.max_queued);
  if (!options_.cluster_token_file.empty()) {
    MOE_ASSIGN_OR_RETURN(options_.cluster_token, ReadSecretFile(options_.cluster_token_file));
  }
  router_ = std::make_unique<client::RouterLink>(options_.router, client::RouterLinkTimings{},
                                                 options_.cluster_token);
  transport::GrpcServerOptions so;
  so.host = options_.host;
  so.port = options_.port;
  so.max_receive_message_bytes = options_.max_message_bytes;
  so.max_send_message_bytes = options_.max_message_bytes;
  OipService::Hooks hooks;
  hooks.version = metrics::BuildVersion();
  hooks.hidden = cfg_.hidden;
  hooks.latent = cfg_.latent;
  hooks.top_k = cfg_.top_k;
  hooks.num_experts = cfg_.num_experts;
  hooks.model = cfg_.name;
  hooks.default_timeout_ms = options_.default_timeout_ms;
  for (const auto& [l, h] : layers_) hooks.layers.push_back(l);
  hooks.forward = [this](const v1::ForwardRequest& r, absl::Time deadline,
                         v1::ForwardResponse* out) {
    return ServeForward(r, deadline, out, "ModelInfer");
  };
  hooks.submit = [this](std::function<void()> f) { return Submit(std::move(f)); };
  hooks.layer_ready = [this](int32_t layer) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = covered_.find(layer);
    return it != covered_.end() && it->second;
  };
  oip_ = std::make_unique<OipService>(std::move(hooks));
  so.services = {this, oip_.get()};
  MOE_ASSIGN_OR_RETURN(server_, transport::GrpcServer::Start(so));
  router_->WatchPlacement([this](const v1::Placement& p) { ApplyPlacement(p); });
  std::vector<int32_t> hosted;
  for (const auto& [l, h] : layers_) hosted.push_back(l);
  router_->WatchBias(hosted, [this](const v1::LayerBias& b) { ApplyBias(b); });
  report_thread_ = std::thread([this] { ReportLoop(); });
  if (!options_.port_file.empty()) {
    MOE_RETURN_IF_ERROR(transport::WritePortFile(options_.port_file, server_->port()));
  }
  return absl::OkStatus();
}

void AttentionServer::Impl::Shutdown(absl::Duration grace) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    stop_cv_.notify_all();
  }
  if (router_ != nullptr) router_->Stop();  // ends the watches; reports still go out
  if (server_ != nullptr) server_->Shutdown(grace);
  workers_.reset();  // runs what is queued (bounded by deadlines), then joins
  if (report_thread_.joinable()) report_thread_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    channels_.clear();  // before the UCX worker they use
  }
  ReportNow();  // the last partial window
}

bool AttentionServer::Impl::SleepUnlessStopping(std::chrono::milliseconds d) {
  std::unique_lock<std::mutex> lock(mu_);
  return !stop_cv_.wait_for(lock, d, [&] { return stopping_; });
}

void AttentionServer::Impl::ApplyPlacement(const v1::Placement& p) {
  bool covered = true;
  std::map<int32_t, std::shared_ptr<const LayerRoute>> routes;
  for (const auto& [layer, hosted] : layers_) {
    std::vector<ShardRef> shards;
    for (const v1::ShardInfo& s : p.shards()) {
      for (const v1::ExpertRange& r : s.ranges()) {
        if (r.layer() != layer) continue;
        shards.push_back(
            {s.shard(), s.endpoint(), r.expert_lo(), r.expert_hi(), s.healthy(), s.last_seen_ms()});
      }
    }
    auto route = std::make_shared<LayerRoute>(
        BuildRoute(layer, static_cast<int32_t>(cfg_.num_experts), std::move(shards)));
    covered &= Covered(*route);
    routes[layer] = std::move(route);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [layer, route] : routes) covered_[layer] = Covered(*route);
    placement_ = p;
    routes_ = std::move(routes);
    // Channels to shards no longer placed (a restarted shard on a new port) are closed.
    for (auto it = channels_.begin(); it != channels_.end();) {
      bool placed = false;
      for (const auto& [layer, route] : routes_) {
        for (const ShardRef& s : route->shards) placed |= it->first == s.shard + "@" + s.endpoint;
      }
      it = placed ? std::next(it) : channels_.erase(it);
    }
  }
  if (server_ != nullptr) server_->SetServing(covered);
}

void AttentionServer::Impl::ApplyBias(const v1::LayerBias& b) {
  if (layers_.count(b.layer()) == 0 || b.bias_size() != cfg_.num_experts) return;
  auto entry = std::make_shared<BiasEntry>();
  entry->version = b.version();
  entry->bias.assign(b.bias().begin(), b.bias().end());
  std::lock_guard<std::mutex> lock(mu_);
  bias_[b.layer()] = std::move(entry);
  if (metrics_ != nullptr) metrics_->BiasVersion(b.layer(), b.version());
}

namespace {

// A call counted as outstanding on its replica from Send until it is dropped (answered, failed
// over or abandoned), and marked failed when it ended UNAVAILABLE.
class CountedCall final : public ExpertCall {
 public:
  CountedCall(std::unique_ptr<ExpertCall> inner, ReplicaPicker* picker, placement::ShardRef shard)
      : inner_(std::move(inner)), picker_(picker), shard_(std::move(shard)) {
    picker_->Started(shard_);
  }
  ~CountedCall() override { picker_->Finished(shard_, failed_); }
  absl::StatusOr<ExpertReply> Wait(absl::Time deadline) override {
    absl::StatusOr<ExpertReply> r = inner_->Wait(deadline);
    failed_ = !r.ok() && r.status().code() == absl::StatusCode::kUnavailable;
    return r;
  }
  const char* transport() const override { return inner_->transport(); }

 private:
  std::unique_ptr<ExpertCall> inner_;
  ReplicaPicker* picker_;
  const placement::ShardRef shard_;
  bool failed_ = false;
};

absl::Status CheckLatentFinite(const std::vector<Bf16>& z, int64_t latent, int64_t first_token) {
  for (size_t i = 0; i < z.size(); ++i) {
    if ((z[i].bits & 0x7f80) == 0x7f80) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the hidden states of token ", first_token + static_cast<int64_t>(i) / latent,
          " are too large: their latent projection overflows bf16 (column ",
          static_cast<int64_t>(i) % latent, "); scale the input down"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

void AttentionServer::Impl::SendTo(const LayerRoute& route, size_t target,
                                   const DispatchHeader& header, const DispatchMessage& m,
                                   std::unique_ptr<ExpertCall>* call, const char** transport,
                                   int64_t* bytes_sent) {
  const int64_t bytes = static_cast<int64_t>(m.z.size() * sizeof(Bf16));
  *bytes_sent += bytes;
  *call = std::make_unique<CountedCall>(ChannelFor(route.shards[target])->Send(header, m), &picker_,
                                        route.shards[target]);
  *transport = (*call)->transport();
  if (metrics_ != nullptr && **transport != '\0') {
    metrics_->wire.Add("sent", "bf16", "expert", bytes, static_cast<int64_t>(m.tokens.size()),
                       *transport);
  }
}

std::shared_ptr<ExpertChannel> AttentionServer::Impl::ChannelFor(const ShardRef& s) {
  const std::string key = s.shard + "@" + s.endpoint;
  if (metrics_ != nullptr) metrics_->Failover(s.shard, 0);
  std::lock_guard<std::mutex> lock(mu_);
  auto& channel = channels_[key];
  if (channel == nullptr && ucx_ != nullptr) {
    channel = std::make_shared<UcxExpertChannel>(
        s.shard, s.endpoint, options_.max_message_bytes, ucx_.get(), options_.data_plane,
        options_.node,
        [this](const std::string& shard, const std::string& event) {
          if (metrics_ != nullptr) metrics_->DataPlaneEvent(shard, event);
        },
        options_.cluster_token);
  } else if (channel == nullptr) {
    channel = std::make_shared<GrpcExpertChannel>(s.shard, s.endpoint, options_.max_message_bytes,
                                                  options_.cluster_token);
  }
  return channel;
}

void AttentionServer::Impl::Accumulate(int32_t layer, uint64_t version,
                                       const std::vector<float>& bias, const RoutedBatch& batch) {
  std::lock_guard<std::mutex> lock(stats_mu_);
  std::optional<QbHistogram>& acc = stats_[layer];
  if (acc.has_value() && acc->window().bias_version != version) {
    outgoing_.push_back(std::move(*acc));
    acc.reset();
  }
  if (!acc.has_value()) {
    numerics::QbWindow w;
    w.window_id = version;
    w.bias_version = version;
    w.layer = layer;
    w.top_k = cfg_.top_k;
    w.bins = options_.qb_bins;
    auto h = QbHistogram::Create(w, bias);
    if (!h.ok()) return;  // the bias was validated upstream; nothing to report otherwise
    acc = std::move(*h);
  }
  (void)acc->Accumulate(batch.scores, batch.tokens);
}

void AttentionServer::Impl::ReportNow() {
  std::vector<QbHistogram> out;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    out.swap(outgoing_);
    for (auto& [layer, acc] : stats_) {
      if (acc.has_value() && acc->tokens() > 0) out.push_back(std::move(*acc));
      acc.reset();
    }
  }
  if (out.empty()) return;
  if (router_ == nullptr) return;
  for (const QbHistogram& h : out) {
    v1::ReportStatsRequest req;
    req.set_node(options_.node);
    req.set_layer(h.window().layer);
    req.set_bias_version(h.window().bias_version);
    req.set_tokens(h.tokens());
    *req.mutable_loads() = {h.loads().begin(), h.loads().end()};
    req.set_qb_histogram(h.Serialize());
    if (auto r = router_->ReportStats(req); !r.ok()) {
      MOE_LOG_WARN("ReportStats failed: {}", r.status().ToString());
    }
  }
}

void AttentionServer::Impl::ReportLoop() {
  while (SleepUnlessStopping(std::chrono::milliseconds(options_.report_interval_ms))) ReportNow();
}

absl::Status AttentionServer::Impl::RunForward(const v1::ForwardRequest& req, absl::Time deadline,
                                               v1::ForwardResponse* resp) {
  auto it = layers_.find(req.layer());
  if (it == layers_.end()) {
    std::string hosted;
    for (const auto& [l, h] : layers_) absl::StrAppend(&hosted, hosted.empty() ? "" : ",", l);
    return absl::NotFoundError(
        absl::StrCat("layer ", req.layer(), " is not hosted here (layers ", hosted, ")"));
  }
  HostedLayer& hosted = *it->second;
  MOE_ASSIGN_OR_RETURN(
      transport::Bf16Matrix x,
      transport::DecodeBf16Matrix(req.hidden_states(), "hidden_states", cfg_.hidden,
                                  /*accept_f32=*/true));
  if (x.rows > options_.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("hidden_states: ", x.rows,
                                                     " tokens, this server takes at most ",
                                                     options_.max_tokens, " per request"));
  }
  ReplyMode mode = options_.reply_mode;
  switch (req.options().reply_mode()) {
    case v1::REPLY_MODE_UNSPECIFIED:
      break;
    case v1::REPLY_MODE_PER_PAIR:
      mode = ReplyMode::kPerPair;
      break;
    case v1::REPLY_MODE_PARTIAL_SUM:
      mode = ReplyMode::kPartialSum;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown reply_mode ", static_cast<int>(req.options().reply_mode())));
  }
  if (!v1::MissingExperts_IsValid(req.options().missing_experts())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown missing_experts ", static_cast<int>(req.options().missing_experts())));
  }
  std::shared_ptr<const BiasEntry> bias;
  std::shared_ptr<const LayerRoute> route;
  {
    std::lock_guard<std::mutex> lock(mu_);
    bias = bias_[req.layer()];
    auto r = routes_.find(req.layer());
    if (r != routes_.end()) route = r->second;
  }
  if (route == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("no placement for layer ", req.layer(), " from router-svc yet"));
  }
  const int64_t tokens = x.rows, d = cfg_.latent, h = cfg_.hidden;
  // The expert calls end a little before the caller's deadline (kExpertDeadline*).
  const absl::Duration left = deadline - absl::Now();
  const absl::Time expert_deadline =
      deadline -
      std::clamp(left * kExpertDeadlineShare, kExpertDeadlineMarginMin, kExpertDeadlineMarginMax);
  DispatchSpec spec;
  spec.mode = mode;
  spec.num_experts = cfg_.num_experts;
  spec.latent = d;
  spec.max_message_bytes = options_.max_dispatch_bytes;

  // One micro-batch in flight: routed, projected, dispatched; its shared experts done.
  struct InFlight {
    int64_t lo = 0, rows = 0;  // tokens [lo, lo + rows) of the request
    RoutedBatch batch;
    DispatchPlan plan;
    DispatchHeader header;
    std::vector<std::unique_ptr<ExpertCall>> calls;
    std::vector<size_t> targets;  // per message: the replica it went to (an index of shards)
    std::vector<const char*> transports;
    std::vector<float> shared;
  };
  LayerTimings t;
  int64_t bytes_sent = 0, bytes_received = 0;
  std::set<int32_t> missing;  // DEGRADE: experts left out, over all micro-batches
  int64_t degraded_pairs = 0;
  double combine_seconds = 0;
  // Dispatch: from the first message sent to the last reply in (the shared experts overlap it).
  std::optional<Clock::time_point> first_send;
  Clock::time_point last_reply;
  std::vector<Bf16> out(static_cast<size_t>(tokens * h));
  std::vector<int32_t> expert_ids;
  std::vector<float> weights;
  const int64_t top_k = cfg_.top_k;
  if (req.options().return_routing()) {
    expert_ids.resize(static_cast<size_t>(tokens * top_k));
    weights.resize(static_cast<size_t>(tokens * top_k));
  }

  auto start = [&](int64_t lo, int64_t rows) -> absl::StatusOr<InFlight> {
    InFlight f;
    f.lo = lo;
    f.rows = rows;
    {
      std::lock_guard<std::mutex> lock(hosted.mu);
      MOE_ASSIGN_OR_RETURN(f.batch,
                           hosted.layer->RouteAndProject(
                               absl::MakeConstSpan(x.values).subspan(static_cast<size_t>(lo * h),
                                                                     static_cast<size_t>(rows * h)),
                               rows, x.cols, bias->bias.data(), &t));
    }
    // Finite inputs can still overflow the latent (|x| near the bf16 maximum): the caller's
    // error, said here, not a shard's refusal of non-finite activations.
    MOE_RETURN_IF_ERROR(CheckLatentFinite(f.batch.z, d, lo));
    Accumulate(req.layer(), bias->version, bias->bias, f.batch);  // the loads as routed
    DispatchSpec batch_spec = spec;
    if (req.options().missing_experts() == v1::MISSING_EXPERTS_DEGRADE && !Covered(*route)) {
      int64_t pairs = 0;
      for (int32_t e : DegradeRouting(*route, &f.batch.routing, &batch_spec.skip, &pairs)) {
        missing.insert(e);
      }
      degraded_pairs += pairs;
    }
    MOE_ASSIGN_OR_RETURN(f.plan,
                         PlanDispatch(f.batch.routing, f.batch.z.data(), *route, batch_spec));
    if (metrics_ != nullptr) {  // counted where the router's loads are (routing time)
      metrics_->Routed(req.layer(), f.plan.per_expert, f.plan.shard_rows);
    }
    if (!first_send.has_value()) first_send = Clock::now();
    DispatchHeader& header = f.header;
    header.layer = req.layer();
    header.mode = mode;
    header.num_tokens = rows;
    header.latent = d;
    header.timeout_ms =
        std::max<int64_t>(1, absl::ToInt64Milliseconds(expert_deadline - absl::Now()));
    // Every message goes out before any reply is awaited.
    f.calls.resize(f.plan.messages.size());
    f.targets.resize(f.plan.messages.size());
    f.transports.assign(f.plan.messages.size(), "grpc");
    for (size_t i = 0; i < f.plan.messages.size(); ++i) {
      const DispatchMessage& m = f.plan.messages[i];
      // Any healthy replica of the message's range: the least busy one.
      f.targets[i] = picker_.Pick(*route, ReplicasOf(*route, m.shard), {});
      SendTo(*route, f.targets[i], header, m, &f.calls[i], &f.transports[i], &bytes_sent);
    }
    // The shared experts need only x: they run here while the expert servers work.
    std::lock_guard<std::mutex> lock(hosted.mu);
    f.shared = hosted.layer->SharedExperts(f.batch, &t);
    return f;
  };

  auto finish = [&](InFlight& f) -> absl::Status {
    std::vector<ExpertReply> replies(f.plan.messages.size());
    for (size_t i = 0; i < f.calls.size(); ++i) {
      // A replica that is gone (UNAVAILABLE) hands its message to another replica of the same
      // range within the same deadline; other errors are the answer.
      std::set<size_t> tried;
      for (;;) {
        absl::StatusOr<ExpertReply> reply = f.calls[i]->Wait(expert_deadline);
        const bool gone = !reply.ok() && reply.status().code() == absl::StatusCode::kUnavailable;
        if (reply.ok() || !gone || absl::Now() >= expert_deadline) {
          MOE_ASSIGN_OR_RETURN(replies[i], std::move(reply));
          break;
        }
        tried.insert(f.targets[i]);
        const DispatchMessage& m = f.plan.messages[i];
        const size_t next = picker_.Pick(*route, ReplicasOf(*route, m.shard), tried);
        if (next >= route->shards.size()) return reply.status();  // no replica left
        MOE_LOG_INFO("layer {}: {} failed over to {} ({})", req.layer(),
                     route->shards[f.targets[i]].shard, route->shards[next].shard,
                     reply.status().ToString());
        if (metrics_ != nullptr) metrics_->Failover(route->shards[f.targets[i]].shard);
        f.targets[i] = next;
        f.header.timeout_ms =
            std::max<int64_t>(1, absl::ToInt64Milliseconds(expert_deadline - absl::Now()));
        SendTo(*route, next, f.header, m, &f.calls[i], &f.transports[i], &bytes_sent);
      }
      const bool f32 = mode == ReplyMode::kPartialSum;
      const int64_t bytes = f32 ? static_cast<int64_t>(replies[i].f32.size() * sizeof(float))
                                : static_cast<int64_t>(replies[i].bf16.size() * sizeof(Bf16));
      bytes_received += bytes;
      if (metrics_ != nullptr) {
        metrics_->wire.Add("received", f32 ? "f32" : "bf16", "expert", bytes, replies[i].rows,
                           f.transports[i]);
      }
    }
    last_reply = Clock::now();
    const auto combine_start = Clock::now();
    std::vector<Bf16> r;
    {
      numerics::StageTimer timer(&t, &LayerTimings::combine_norm);
      MOE_ASSIGN_OR_RETURN(r, Gather(f.plan, f.batch.routing, *route, replies));
    }
    combine_seconds += Seconds(Clock::now() - combine_start);
    std::vector<Bf16> y;
    {
      std::lock_guard<std::mutex> lock(hosted.mu);
      y = hosted.layer->Finish(f.batch, r.data(), &t, &f.shared);
    }
    std::copy(y.begin(), y.end(), out.begin() + f.lo * h);
    if (!expert_ids.empty()) {
      std::copy(f.batch.routing.expert_ids.begin(), f.batch.routing.expert_ids.end(),
                expert_ids.begin() + f.lo * top_k);
      std::copy(f.batch.routing.weights.begin(), f.batch.routing.weights.end(),
                weights.begin() + f.lo * top_k);
    }
    return absl::OkStatus();
  };

  // Micro-batches (--micro_batches): at most two in flight, so one is routed, projected and
  // run through the shared experts here while the expert servers compute the other.
  const int64_t chunks =
      std::clamp<int64_t>(options_.micro_batches, 1, std::max<int64_t>(1, tokens));
  const int64_t per_chunk = (tokens + chunks - 1) / chunks;
  std::deque<InFlight> flight;
  for (int64_t lo = 0; lo < tokens; lo += per_chunk) {
    MOE_ASSIGN_OR_RETURN(InFlight f, start(lo, std::min(per_chunk, tokens - lo)));
    flight.push_back(std::move(f));
    if (flight.size() > 1) {
      MOE_RETURN_IF_ERROR(finish(flight.front()));
      flight.pop_front();
    }
  }
  for (InFlight& f : flight) MOE_RETURN_IF_ERROR(finish(f));

  resp->set_request_id(req.request_id());
  transport::EncodeBf16Into(out, tokens, h, resp->mutable_output());
  resp->set_bias_version(bias->version);
  if (req.options().return_routing()) {
    v1::Routing* rt = resp->mutable_routing();
    rt->set_top_k(static_cast<int32_t>(top_k));
    *rt->mutable_expert_ids() = {expert_ids.begin(), expert_ids.end()};
    *rt->mutable_weights() = {weights.begin(), weights.end()};
  }
  resp->set_dispatch_bytes_sent(bytes_sent);
  resp->set_dispatch_bytes_received(bytes_received);
  if (degraded_pairs > 0) {
    *resp->mutable_missing_experts() = {missing.begin(), missing.end()};
    resp->set_degraded_pairs(degraded_pairs);
    if (metrics_ != nullptr) metrics_->Degraded(req.layer(), degraded_pairs);
  }
  v1::StageSeconds* sec = resp->mutable_seconds();
  sec->set_router(t.router);
  sec->set_down_proj(t.down_proj);
  sec->set_dispatch(first_send.has_value() ? Seconds(last_reply - *first_send) : 0.0);
  sec->set_combine_norm(t.combine_norm);
  sec->set_up_proj(t.up_proj);
  sec->set_shared(t.shared);
  sec->set_combine(combine_seconds);
  return absl::OkStatus();
}

absl::Status AttentionServer::Impl::ServeForward(const v1::ForwardRequest& req, absl::Time deadline,
                                                 v1::ForwardResponse* resp, const char* method) {
  const auto start = Clock::now();
  if (metrics_ != nullptr) {
    metrics_->common.QueueDepth(static_cast<int64_t>(workers_->queued()));
    metrics_->common.Started(method);
  }
  const absl::Status s = RunForward(req, deadline, resp);
  if (metrics_ == nullptr) return s;
  metrics_->common.Finished(method, s.ok());
  const v1::Tensor& x = req.hidden_states();
  metrics_->wire.Add("received", x.dtype() == v1::DTYPE_F32 ? "f32" : "bf16", "client",
                     static_cast<int64_t>(x.data().size()), x.shape_size() > 0 ? x.shape(0) : 0);
  if (!s.ok()) {
    metrics_->common.Error(method, absl::StatusCodeToString(s.code()));
    return s;
  }
  const int64_t tokens = resp->output().shape(0);
  metrics_->wire.Add("sent", "bf16", "client", static_cast<int64_t>(resp->output().data().size()),
                     tokens);
  metrics_->ForwardDone(req.layer(), Seconds(Clock::now() - start), resp->seconds().dispatch(),
                        resp->seconds().combine(), tokens);
  return s;
}

grpc::ServerUnaryReactor* AttentionServer::Impl::Forward(grpc::CallbackServerContext* ctx,
                                                         const v1::ForwardRequest* req,
                                                         v1::ForwardResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  absl::Time deadline = absl::Now() + absl::Milliseconds(options_.default_timeout_ms);
  deadline = std::min(deadline, absl::FromChrono(ctx->deadline()));
  const bool queued = Submit([this, reactor, req, resp, deadline] {
    reactor->Finish(transport::ToGrpc(ServeForward(*req, deadline, resp, "Forward")));
  });
  if (!queued) {
    if (metrics_ != nullptr) metrics_->common.Error("Forward", "RESOURCE_EXHAUSTED");
    reactor->Finish(transport::ToGrpc(absl::ResourceExhaustedError(
        absl::StrCat("attention node ", options_.node, ": too many requests waiting (",
                     options_.max_queued, ")"))));
  }
  return reactor;
}

grpc::ServerBidiReactor<v1::ForwardRequest, v1::ForwardResponse>*
AttentionServer::Impl::ForwardStream(grpc::CallbackServerContext* ctx) {
  const absl::Time stream_deadline = absl::FromChrono(ctx->deadline());
  return new ForwardStreamReactor(
      [this, stream_deadline](v1::ForwardRequest&& req, ForwardStreamReactor* stream) {
        const absl::Time deadline = std::min(
            stream_deadline, absl::Now() + absl::Milliseconds(options_.default_timeout_ms));
        auto shared_req = std::make_shared<v1::ForwardRequest>(std::move(req));
        if (stream->in_flight() >= options_.max_stream_in_flight) {
          if (metrics_ != nullptr) metrics_->common.Error("ForwardStream", "RESOURCE_EXHAUSTED");
          stream->Reply(
              StreamError(shared_req->request_id(),
                          absl::ResourceExhaustedError(absl::StrCat(
                              "attention node ", options_.node, ": ", options_.max_stream_in_flight,
                              " requests already in flight on this stream"))),
              /*ends_work=*/false);
          return;
        }
        stream->BeginWork();
        auto run = [this, shared_req, stream, deadline] {
          v1::ForwardResponse resp;
          if (stream->cancelled()) {  // nobody reads the answer: the cores go to other clients
            if (metrics_ != nullptr) metrics_->common.Error("ForwardStream", "CANCELLED");
            stream->Reply(std::move(resp), /*ends_work=*/true);
            return;
          }
          const absl::Status s = ServeForward(*shared_req, deadline, &resp, "ForwardStream");
          if (!s.ok()) resp = StreamError(shared_req->request_id(), s);
          stream->Reply(std::move(resp), /*ends_work=*/true);
        };
        if (!Submit(run)) {
          if (metrics_ != nullptr) metrics_->common.Error("ForwardStream", "RESOURCE_EXHAUSTED");
          stream->Reply(StreamError(shared_req->request_id(),
                                    absl::ResourceExhaustedError("too many requests waiting")),
                        /*ends_work=*/true);
        }
      },
      static_cast<size_t>(options_.max_stream_outbox_bytes));
}

grpc::ServerUnaryReactor* AttentionServer::Impl::GetModelInfo(grpc::CallbackServerContext* ctx,
                                                              const v1::GetModelInfoRequest*,
                                                              v1::ModelInfo* resp) {
  resp->set_model(cfg_.name);
  resp->set_hidden(static_cast<int32_t>(cfg_.hidden));
  resp->set_latent(static_cast<int32_t>(cfg_.latent));
  resp->set_num_experts(static_cast<int32_t>(cfg_.num_experts));
  resp->set_top_k(static_cast<int32_t>(cfg_.top_k));
  for (const auto& [l, h] : layers_) {
    resp->add_layers(l);
    resp->add_oip_models(OipModelName(l));
  }
  resp->add_input_dtypes(v1::DTYPE_BF16);
  resp->add_input_dtypes(v1::DTYPE_F32);
  resp->set_output_dtype(v1::DTYPE_BF16);
  resp->add_precision_modes("w4a16");
  resp->add_reply_modes(v1::REPLY_MODE_PER_PAIR);
  resp->add_reply_modes(v1::REPLY_MODE_PARTIAL_SUM);
  resp->set_default_reply_mode(options_.reply_mode == ReplyMode::kPerPair
                                   ? v1::REPLY_MODE_PER_PAIR
                                   : v1::REPLY_MODE_PARTIAL_SUM);
  resp->set_max_tokens(options_.max_tokens);
  bool ready = !layers_.empty();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [l, h] : layers_) {
      auto it = covered_.find(l);
      ready &= it != covered_.end() && it->second;
    }
    for (const v1::ShardInfo& s : placement_.shards()) {
      for (const v1::ExpertRange& r : s.ranges()) {
        if (layers_.count(r.layer()) == 0) continue;
        v1::ShardSummary* out = resp->add_shards();
        out->set_shard(s.shard());
        out->set_endpoint(s.endpoint());
        out->set_layer(r.layer());
        out->set_expert_lo(r.expert_lo());
        out->set_expert_hi(r.expert_hi());
        out->set_healthy(s.healthy());
        out->set_data_plane(s.data_plane());
      }
    }
  }
  resp->set_ready(ready);
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

AttentionServer::AttentionServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
AttentionServer::~AttentionServer() { Shutdown(absl::ZeroDuration()); }

absl::StatusOr<std::unique_ptr<AttentionServer>> AttentionServer::Start(
    const AttentionServerOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  MOE_RETURN_IF_ERROR(impl->Load());
  MOE_RETURN_IF_ERROR(impl->StartServing());
  return std::unique_ptr<AttentionServer>(new AttentionServer(std::move(impl)));
}

int AttentionServer::port() const { return impl_->port(); }
void AttentionServer::Shutdown(absl::Duration grace) { impl_->Shutdown(grace); }
void AttentionServer::Wait() { impl_->Wait(); }

}  // namespace moe::attention_svc
