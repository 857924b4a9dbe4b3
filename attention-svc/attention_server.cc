#include "attention-svc/attention_server.h"

#include "attention-svc/attention_impl.h"
#include "attention-svc/dataplane/registry.h"
#include "services/common/version.h"

namespace moe::attention_svc {

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
    entry->k_avg = static_cast<int32_t>(cfg_.top_k);
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
  if (!options_.data_plane.in_band()) {
    const std::string backend = options_.data_plane.backend();
    ClientHalfOptions co;
    co.node = options_.node;
    co.tls = options_.ucx_tls;
    co.bind_host = options_.host;
    co.poll_spin = std::chrono::microseconds(std::max(0, options_.ucx_poll_us));
    auto half = StartClientHalf(backend, co);
    if (half.ok()) {
      data_plane_ = std::move(*half);
      if (metrics_server_ != nullptr) {
        dp_drops_ =
            metrics::UcxMessagesDropped([dp = data_plane_.get()] { return dp->DroppedByKind(); });
        metrics_server_->Add(dp_drops_);
      }
      MOE_LOG_INFO("{} data plane up ({})", data_plane_->name(), data_plane_->Describe());
    } else if (!options_.data_plane.automatic()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--data_plane=", backend, ": ", half.status().message()));
    } else {
      MOE_LOG_WARN("no {} data plane ({}): in band only", backend, half.status().ToString());
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
  hooks.version = BuildVersion();
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
  hooks.on_error = [this](const char* method, const absl::Status& s) {
    if (metrics_ != nullptr) metrics_->common.Error(method, absl::StatusCodeToString(s.code()));
  };
  hooks.layer_ready = [this](int32_t layer) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = covered_.find(layer);
    return it != covered_.end() && it->second;
  };
  oip_ = std::make_unique<OipService>(std::move(hooks));
  if (options_.http_port >= 0) {
    oip_rest_ = std::make_unique<OipRest>(oip_.get(), options_.default_timeout_ms);
    // Event-driven (http_server.h): idle and slow clients hold sockets, not threads. The
    // handler threads each run one ModelInfer at a time; a body may take up to 30 s to arrive.
    metrics::HttpServerOptions ho;
    ho.workers = 16;
    ho.max_body_bytes = static_cast<size_t>(std::max<int64_t>(options_.max_http_body_bytes, 1));
    ho.request_deadline = absl::Seconds(30);
    MOE_ASSIGN_OR_RETURN(
        http_, metrics::HttpServer::Start(
                   options_.host, options_.http_port,
                   [this](const metrics::HttpRequest& r) { return oip_rest_->Handle(r); }, ho));
    MOE_LOG_INFO("Open Inference Protocol REST front on port {}", http_->port());
    if (!options_.http_port_file.empty()) {
      MOE_RETURN_IF_ERROR(transport::WritePortFile(options_.http_port_file, http_->port()));
    }
  }
  so.services = {this, oip_.get()};
  // Dynamic k's automatic mode exists before the first request can arrive.
  BudgetGovernorOptions g;
  g.floor = std::clamp<int32_t>(options_.budget_auto_floor, 0, static_cast<int32_t>(cfg_.top_k));
  g.queue_bound = options_.budget_auto_queue;
  g.p99_ms = options_.budget_auto_p99_ms;
  g.interval_ms = std::max<int64_t>(10, options_.budget_auto_interval_ms);
  governor_ = std::make_unique<BudgetGovernor>(g, static_cast<int32_t>(cfg_.top_k));
  if (metrics_ != nullptr) metrics_->AutoBudget(cfg_.top_k);
  MOE_ASSIGN_OR_RETURN(server_, transport::GrpcServer::Start(so));
  router_->WatchPlacement([this](const v1::Placement& p) { ApplyPlacement(p); });
  std::vector<int32_t> hosted;
  for (const auto& [l, h] : layers_) hosted.push_back(l);
  router_->WatchBias(hosted, [this](const v1::LayerBias& b) { ApplyBias(b); });
  report_thread_ = std::thread([this] { ReportLoop(); });
  if (governor_->enabled()) {
    MOE_LOG_INFO("dynamic k: automatic budget on, floor {}, queue bound {}, p99 bound {} ms",
                 g.floor, g.queue_bound, g.p99_ms);
    governor_thread_ = std::thread([this] { GovernorLoop(); });
  }
  if (options_.budget_check_every > 0) check_thread_ = std::thread([this] { CheckLoop(); });
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
  if (http_ != nullptr) http_->Stop();  // its inferences wait on the workers: before them
  workers_.reset();                     // runs what is queued (bounded by deadlines), then joins
  if (report_thread_.joinable()) report_thread_.join();
  if (governor_thread_.joinable()) governor_thread_.join();
  {
    std::lock_guard<std::mutex> lock(check_mu_);
    checks_stopping_ = true;
    checks_.clear();
  }
  check_cv_.notify_all();
  if (check_thread_.joinable()) check_thread_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    channels_.clear();  // before the data plane they use
  }
  if (dp_drops_ != nullptr) dp_drops_->Stop();
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
  const v1::ExpertBudget& budget = b.budget();
  entry->k_avg = budget.k_avg() >= 1 && budget.k_avg() <= cfg_.top_k
                     ? budget.k_avg()
                     : static_cast<int32_t>(cfg_.top_k);
  entry->k_min = std::clamp<int32_t>(budget.k_min(), 0, static_cast<int32_t>(cfg_.top_k));
  if (budget.thresholds_size() == (cfg_.top_k - 1) * cfg_.num_experts) {
    entry->thresholds.assign(budget.thresholds().begin(), budget.thresholds().end());
  }
  entry->stale = budget.stale();
  entry->solved_from_version = budget.solved_from_version();
  std::lock_guard<std::mutex> lock(mu_);
  bias_[b.layer()] = std::move(entry);
  if (metrics_ != nullptr) metrics_->BiasVersion(b.layer(), b.version());
}

void AttentionServer::Impl::Accumulate(int32_t layer, const BiasEntry& bias,
                                       const RoutedBatch& batch) {
  const uint64_t version = bias.version;
  std::lock_guard<std::mutex> lock(stats_mu_);
  std::optional<LayerStats>& acc = stats_[layer];
  if (acc.has_value() && acc->qb.window().bias_version != version) {
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
    auto h = QbHistogram::Create(w, bias.bias);
    if (!h.ok()) return;  // the bias was validated upstream; nothing to report otherwise
    acc = LayerStats{*std::move(h), std::nullopt};
    numerics::BudgetWindow bw;
    bw.bias_version = version;
    bw.layer = layer;
    bw.top_k = cfg_.top_k;
    bw.k_min = bias.k_min;
    bw.bins = options_.budget_bins;
    auto b = numerics::BudgetHistogram::Create(bw, cfg_.num_experts);
    if (b.ok()) acc->budget = *std::move(b);  // top-k 1 has no budget to report
  }
  (void)acc->qb.Accumulate(batch.scores, batch.tokens);
  // Dynamic k's thresholds come from the selections before any budget (the full top-k).
  if (acc->budget.has_value()) (void)acc->budget->Accumulate(batch.routing, batch.scores.data());
}

void AttentionServer::Impl::ReportNow() {
  std::vector<LayerStats> out;
  std::map<int32_t, CheckSums> costs;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    out.swap(outgoing_);
    costs.swap(check_costs_);
    for (auto& [layer, acc] : stats_) {
      if (acc.has_value() && acc->qb.tokens() > 0) out.push_back(std::move(*acc));
      acc.reset();
    }
  }
  if (out.empty()) return;
  if (router_ == nullptr) return;
  for (const LayerStats& stats : out) {
    const QbHistogram& h = stats.qb;
    v1::ReportStatsRequest req;
    req.set_node(options_.node);
    req.set_layer(h.window().layer);
    req.set_bias_version(h.window().bias_version);
    req.set_tokens(h.tokens());
    *req.mutable_loads() = {h.loads().begin(), h.loads().end()};
    req.set_qb_histogram(h.Serialize());
    if (stats.budget.has_value()) req.set_budget_histogram(stats.budget->Serialize());
    req.set_auto_budget(governor_ != nullptr && governor_->enabled() ? governor_->cap() : 0);
    // The checks go with the layer's newest report (the last of its in `out`), which the
    // router counts for the current version.
    bool newest = true;
    for (const LayerStats& later : out) {
      if (&later > &stats && later.qb.window().layer == h.window().layer) newest = false;
    }
    auto cost = costs.find(h.window().layer);
    if (newest && cost != costs.end()) {
      req.set_budget_checks(cost->second.checks);
      req.set_budget_rel_diff_sum(cost->second.rel_diff);
      req.set_budget_mass_kept_sum(cost->second.mass_kept);
      req.set_budget_top1_agree_sum(cost->second.top1);
    }
    if (auto r = router_->ReportStats(req); !r.ok()) {
      MOE_LOG_WARN("ReportStats failed: {}", r.status().ToString());
    }
  }
}

void AttentionServer::Impl::GovernorLoop() {
  while (SleepUnlessStopping(governor_->interval())) {
    int32_t ceiling = 1;  // the highest budget a hosted layer serves
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [layer, b] : bias_) {
        ceiling = std::max(ceiling, !b->usable() ? static_cast<int32_t>(cfg_.top_k) : b->k_avg);
      }
    }
    const int32_t before = governor_->cap();
    std::string why;
    const int step = governor_->Tick(ceiling, &why);
    if (step == 0) continue;
    MOE_LOG_INFO("dynamic k: automatic budget cap {} -> {} ({})", before, governor_->cap(), why);
    if (metrics_ != nullptr) {
      metrics_->BudgetStep(step < 0);
      metrics_->AutoBudget(governor_->cap());
    }
  }
}

void AttentionServer::Impl::MaybeCheck(const v1::ForwardRequest& req,
                                       const v1::ForwardResponse& resp) {
  // Requests past kMaxCheckTokens are not sampled: a copy of each waits in the queue.
  constexpr int64_t kMaxCheckTokens = 2048;
  if (options_.budget_check_every <= 0 || resp.expert_budget() >= cfg_.top_k ||
      resp.output().shape_size() < 1 || resp.output().shape(0) > kMaxCheckTokens) {
    return;
  }
  std::lock_guard<std::mutex> lock(check_mu_);
  if (checks_stopping_ || budgeted_++ % static_cast<uint64_t>(options_.budget_check_every) != 0) {
    return;
  }
  if (static_cast<int>(checks_.size()) >= options_.budget_check_queue) {
    if (metrics_ != nullptr) metrics_->BudgetCheck(req.layer(), "dropped");
    return;
  }
  checks_.push_back({req, resp.output().data(), resp.bias_version(), resp.routing_mass_kept()});
  check_cv_.notify_one();
}

void AttentionServer::Impl::CheckLoop() {
  for (;;) {
    BudgetCheck c;
    {
      std::unique_lock<std::mutex> lock(check_mu_);
      check_cv_.wait(lock, [&] { return checks_stopping_ || !checks_.empty(); });
      if (checks_stopping_) return;
      c = std::move(checks_.front());
      checks_.pop_front();
    }
    // The same request at full k, through the same expert servers, after the answer went out.
    v1::ForwardResponse full;
    c.req.mutable_options()->set_return_routing(false);
    // A short deadline: a check never holds a shutdown for long.
    const absl::Status s = RunForward(
        c.req,
        absl::Now() + absl::Milliseconds(std::min<int64_t>(options_.default_timeout_ms, 5000)),
        &full, /*check=*/true);
    const int32_t layer = c.req.layer();
    if (!s.ok()) {
      MOE_LOG_WARN("dynamic k: the full-k check of a layer {} request failed: {}", layer,
                   s.ToString());
      if (metrics_ != nullptr) metrics_->BudgetCheck(layer, "failed");
      continue;
    }
    if (full.bias_version() != c.bias_version || full.output().data().size() != c.output.size()) {
      if (metrics_ != nullptr) metrics_->BudgetCheck(layer, "skipped");
      continue;
    }
    // The relative L2 difference of the outputs, and where the next-token head would point,
    // with the budget and without.
    const size_t n = c.output.size() / sizeof(Bf16);
    std::vector<float> budgeted(n), full_k(n);
    for (size_t i = 0; i < n; ++i) {
      Bf16 x, y;
      std::memcpy(&x, c.output.data() + i * sizeof(Bf16), sizeof(Bf16));
      std::memcpy(&y, full.output().data().data() + i * sizeof(Bf16), sizeof(Bf16));
      budgeted[i] = x.ToFloat();
      full_k[i] = y.ToFloat();
    }
    const double rel = numerics::RelativeL2(budgeted.data(), full_k.data(), n);
    const int64_t tokens = static_cast<int64_t>(n) / cfg_.hidden;
    const double top1 =
        numerics::Top1Agreement(budgeted.data(), full_k.data(), tokens, cfg_.hidden);
    if (metrics_ != nullptr) {
      metrics_->BudgetCheck(layer, "measured", rel);
      metrics_->BudgetQuality(layer, c.mass_kept, top1);
    }
    std::lock_guard<std::mutex> lock(stats_mu_);
    CheckSums& sums = check_costs_[layer];
    sums.checks += 1;
    sums.rel_diff += rel;
    sums.mass_kept += c.mass_kept;
    sums.top1 += top1;
  }
}

void AttentionServer::Impl::ReportLoop() {
  while (SleepUnlessStopping(std::chrono::milliseconds(options_.report_interval_ms))) ReportNow();
}

absl::Status AttentionServer::Impl::ServeForward(const v1::ForwardRequest& req, absl::Time deadline,
                                                 v1::ForwardResponse* resp, const char* method) {
  const auto start = Clock::now();
  if (metrics_ != nullptr) {
    metrics_->common.QueueDepth(static_cast<int64_t>(workers_->queued()));
    metrics_->common.Started(method);
  }
  const absl::Status s = RunForward(req, deadline, resp);
  if (s.ok()) {
    if (governor_ != nullptr) governor_->Observe(Seconds(Clock::now() - start));
    MaybeCheck(req, *resp);
  }
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
  metrics_->Budgeted(req.layer(), tokens, resp->routed_pairs());
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
  resp->add_precision_modes("w4a8");
  resp->set_default_precision(transport::PrecisionToProto(options_.precision));
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
