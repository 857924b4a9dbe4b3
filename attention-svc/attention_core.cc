#include "attention-svc/attention_core.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "prometheus/registry.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/synthetic.h"
#include "services/common/logging.h"
#include "services/common/status_macros.h"
#include "services/metrics/service_metrics.h"
#include "services/numerics/dynamic_k.h"
#include "services/transport/precision_convert.h"

namespace moe::attention_svc {

namespace {
// The readiness canary's batch: 4 tokens of a fixed seed (readiness_canary.h).
constexpr int64_t kCanaryTokens = 4;
constexpr uint64_t kCanarySeed = 9;

// A request that failed on the path (a shard, the data plane, a deadline), not by what its
// caller sent or a full queue: what keeps a timed-out canary from counting as only busy.
bool FailedOnThePath(absl::StatusCode c) {
  using C = absl::StatusCode;
  return c == C::kDeadlineExceeded || c == C::kUnavailable || c == C::kDataLoss ||
         c == C::kInternal || c == C::kUnknown || c == C::kAborted;
}
}  // namespace

namespace {

using Clock = std::chrono::steady_clock;
using tensor::Bf16;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Requests past this many tokens are not sampled for a full-k check: a copy of each waits.
constexpr int64_t kMaxCheckTokens = 2048;

}  // namespace

AttentionCore::AttentionCore(const AttentionServerOptions& o, const ModelConfig& cfg)
    : options_(o),
      cfg_(cfg),
      view_(cfg.num_experts, cfg.top_k),
      stats_(NodeStatsOptions{cfg.num_experts, cfg.top_k, o.qb_bins, o.budget_bins}),
      canary_timeout_ms_(o.canary_timeout_ms) {}

AttentionCore::~AttentionCore() { Stop(); }

absl::StatusOr<std::unique_ptr<AttentionCore>> AttentionCore::Load(
    const AttentionServerOptions& options) {
  std::unique_ptr<checkpoint::Checkpoint> ckpt;
  ModelConfig cfg;
  if (!options.checkpoint.empty()) {
    MOE_ASSIGN_OR_RETURN(ckpt, checkpoint::Checkpoint::Open(options.checkpoint));
    MOE_ASSIGN_OR_RETURN(cfg, ckpt->LoadConfig());
  } else {
    MOE_ASSIGN_OR_RETURN(cfg, PresetConfig(options.preset));
  }
  std::unique_ptr<AttentionCore> core(new AttentionCore(options, cfg));
  MOE_RETURN_IF_ERROR(core->LoadLayers(ckpt.get()));
  return core;
}

absl::Status AttentionCore::LoadLayers(checkpoint::Checkpoint* ckpt) {
  std::vector<int64_t> layers = options_.layers;
  if (layers.empty()) layers.push_back(cfg_.first_moe_layer);
  numerics::cpu::CpuLayerOptions lo;
  lo.threads = options_.threads;
  lo.isa = options_.isa;
  lo.experts = false;
  int64_t kept_synthetic = 0;  // bytes of synthetic experts kept for the references
  for (int64_t layer : layers) {
    if (!cfg_.IsMoeLayer(layer)) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " is not a MoE layer"));
    }
    // The references' weights (readiness_canary.h, twin_audit.h): the dense part and the
    // experts as views of the mapped checkpoint, read only for the experts a canary routes to or
    // an audit recomputes. (Synthetic weights are generated in memory: kept only up to 2 GiB of
    // experts over all layers.)
    const bool canary = options_.canary_interval_ms > 0 && layer == layers.front();
    const bool want_experts = canary || options_.audit_share > 0;
    const int64_t synthetic_bytes = cfg_.ExpertBytes() * cfg_.num_experts;
    const bool keep =
        want_experts && (ckpt != nullptr || kept_synthetic + synthetic_bytes <= (int64_t{2} << 30));
    if (want_experts && !keep) {
      MOE_LOG_WARN(
          "layer {}: synthetic {} experts are too large to keep in memory: {}{}(run on a "
          "checkpoint)",
          layer, options_.preset, canary ? "readiness canary off, " : "",
          options_.audit_share > 0 ? "twin audits cannot judge replies that differ " : "");
    }
    numerics::MoeLayerWeights w;
    if (ckpt != nullptr) {
      checkpoint::LoadOptions opt;
      opt.dense = true;
      opt.expert_lo = 0;
      opt.expert_hi = keep ? -1 : 0;
      MOE_ASSIGN_OR_RETURN(w, checkpoint::LoadMoeLayer(*ckpt, cfg_, layer, opt));
    } else {
      checkpoint::SyntheticOptions so;
      so.seed = options_.seed;
      so.router_skew = options_.router_skew;
      w = checkpoint::SyntheticLayer(cfg_, layer, so);
      if (keep) kept_synthetic += synthetic_bytes;
    }
    if (keep) {
      reference_[static_cast<int32_t>(layer)] = std::make_unique<numerics::MoeLayerWeights>(w);
    }
    if (canary && keep) {
      canary_layer_ = static_cast<int32_t>(layer);
      canary_ = std::make_unique<CanaryOracle>(cfg_, reference_[canary_layer_].get(), kCanaryTokens,
                                               kCanarySeed);
    }
    w.experts.clear();
    w.backing.clear();
    w.expert_lo = w.expert_hi = 0;
    const size_t dense_bytes =
        2 * (w.gate.size() + w.down_proj.size() + w.norm.size() + w.up_proj.size() +
             w.shared_gate.size() + w.shared_up.size() + w.shared_down.size());
    MOE_LOG_INFO("layer {}: dense weights loaded ({:.1f} MB, {})", layer, dense_bytes / 1e6,
                 ckpt != nullptr ? options_.checkpoint : "synthetic");
    view_.Host(static_cast<int32_t>(layer), w.bias);
    auto hosted = std::make_unique<HostedLayer>();
    MOE_ASSIGN_OR_RETURN(hosted->layer, numerics::cpu::CpuMoeLayer::Create(cfg_, std::move(w), lo));
    layers_[static_cast<int32_t>(layer)] = std::move(hosted);
  }
  return absl::OkStatus();
}

void AttentionCore::OnQuarantine(std::function<void(const ShardQuarantine&)> f) {
  std::lock_guard<std::mutex> lock(quarantine_mu_);
  on_quarantine_ = std::move(f);
}

TwinAuditor::Counts AttentionCore::AuditCounts() const {
  return audit_ != nullptr ? audit_->counts() : TwinAuditor::Counts{};
}

void AttentionCore::Quarantine(const ShardQuarantine& q) {
  picker_.Quarantine(q.shard);
  metrics_->Quarantined(q.shard.shard, q.suspect_answers);
  MOE_LOG_ERROR(
      "shard {} at {} quarantined on this node: {}; {} of its answers served since its last "
      "passed audit are suspect",
      q.shard.shard, q.shard.endpoint, q.evidence, q.suspect_answers);
  std::lock_guard<std::mutex> lock(quarantine_mu_);
  if (on_quarantine_) on_quarantine_(q);
}

v1::ReportNodeRequest AttentionCore::NodeReport() const {
  v1::ReportNodeRequest r;
  r.set_node(options_.node);
  {
    std::lock_guard<std::mutex> lock(canary_mu_);
    r.set_canary_outcome(canary_ == nullptr ? "off" : canary_last_);
    if (canary_ != nullptr && canary_last_ != "pending") {
      r.set_canary_age_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                              std::chrono::steady_clock::now() - canary_at_)
                              .count());
    }
  }
  r.set_canary_ready(CanaryReady());
  const TwinAuditor::Counts c = AuditCounts();
  auto n = [&](TwinOutcome o) {
    auto it = c.outcomes.find(o);
    return it == c.outcomes.end() ? int64_t{0} : it->second;
  };
  r.set_audits_agree(n(TwinOutcome::kAgree));
  r.set_audits_within_bound(n(TwinOutcome::kWithinBound));
  r.set_audits_caught(n(TwinOutcome::kCaught));
  r.set_audits_unresolved(n(TwinOutcome::kUnresolved));
  r.set_audits_skipped(n(TwinOutcome::kSkipped));
  // At most 64 (ReportNode's bound): the first caught.
  for (size_t i = 0; i < c.quarantined.size() && i < 64; ++i) r.add_quarantined(c.quarantined[i]);
  return r;
}

std::vector<int32_t> AttentionCore::layers() const {
  std::vector<int32_t> out;
  for (const auto& [l, h] : layers_) out.push_back(l);
  return out;
}

absl::Status AttentionCore::Start(metrics::AttentionMetrics* metrics, const LocalExperts& local) {
  if (metrics == nullptr) {
    // Not exported, but counted all the same: every component holds its stats as a value.
    std::vector<int64_t> layers;
    for (int32_t l : this->layers()) layers.push_back(l);
    own_registry_ = std::make_unique<prometheus::Registry>();
    own_metrics_ = std::make_unique<metrics::AttentionMetrics>(*own_registry_, layers,
                                                               cfg_.num_experts, false);
    metrics = own_metrics_.get();
  }
  metrics_ = metrics;
  for (int32_t l : layers()) metrics_->BiasVersion(l, 0);
  ExpertLinksOptions lo;
  lo.node = options_.node;
  lo.bind_host = options_.host;
  lo.data_plane = options_.data_plane;
  lo.ucx_tls = options_.ucx_tls;
  lo.ucx_poll_us = options_.ucx_poll_us;
  lo.ucx_poll_max_us = options_.ucx_poll_max_us;
  lo.ucx_progress_spin_us = options_.ucx_progress_spin_us;
  lo.ucx_detach_tag_from = options_.ucx_detach_tag_from_bytes;
  lo.max_message_bytes = options_.max_message_bytes;
  lo.cluster_token = options_.cluster_token;
  lo.local = local;
  lo.cfg = &cfg_;
  MOE_ASSIGN_OR_RETURN(links_, ExpertLinks::Start(lo, metrics_));
  workers_ = std::make_unique<WorkQueue>(options_.workers, options_.max_queued);
  // Dynamic k's automatic mode exists before the first request can arrive.
  BudgetGovernorOptions g;
  g.floor = std::clamp<int32_t>(options_.budget_auto_floor, 0, static_cast<int32_t>(cfg_.top_k));
  g.queue_bound = options_.budget_auto_queue;
  g.p99_ms = options_.budget_auto_p99_ms;
  g.interval_ms = std::max<int64_t>(10, options_.budget_auto_interval_ms);
  governor_ = std::make_unique<BudgetGovernor>(g, static_cast<int32_t>(cfg_.top_k));
  metrics_->AutoBudget(cfg_.top_k);
  if (governor_->enabled()) {
    MOE_LOG_INFO("dynamic k: automatic budget on, floor {}, queue bound {}, p99 bound {} ms",
                 g.floor, g.queue_bound, g.p99_ms);
    governor_thread_ = std::thread([this] { GovernorLoop(); });
  }
  if (options_.budget_check_every > 0) check_thread_ = std::thread([this] { CheckLoop(); });
  if (options_.audit_share > 0) {
    TwinAuditOptions ao;
    ao.share = options_.audit_share;
    audit_ = std::make_unique<TwinAuditor>(
        cfg_, ao,
        [this](int32_t layer) -> const numerics::MoeLayerWeights* {
          auto it = reference_.find(layer);
          return it == reference_.end() ? nullptr : it->second.get();
        },
        [this](const ShardQuarantine& q) { Quarantine(q); },
        [this](TwinOutcome o) { metrics_->TwinAudit(kTwinOutcomes.Name(o)); });
  }
  metrics_->Canary("", canary_ == nullptr);
  if (canary_ != nullptr) canary_thread_ = std::thread([this] { CanaryLoop(); });
  return absl::OkStatus();
}

void AttentionCore::Stop() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (canary_thread_.joinable()) canary_thread_.join();  // a canary in flight: its timeout
  workers_.reset();  // runs what is queued (bounded by deadlines), then joins
  if (governor_thread_.joinable()) governor_thread_.join();
  {
    std::lock_guard<std::mutex> lock(check_mu_);
    checks_stopping_ = true;
    checks_.clear();
  }
  check_cv_.notify_all();
  if (check_thread_.joinable()) check_thread_.join();
  if (links_ != nullptr) links_->Close();  // the channels before the data plane they use
}

bool AttentionCore::Submit(std::function<void()> work) {
  if (workers_ == nullptr) return false;
  const bool queued = workers_->Submit(std::move(work));
  if (governor_ != nullptr) governor_->ObserveQueue(static_cast<int64_t>(workers_->queued()));
  metrics_->common.QueueDepth(static_cast<int64_t>(workers_->queued()));
  return queued;
}

bool AttentionCore::ApplyPlacement(const v1::Placement& p) {
  const bool ready = view_.ApplyPlacement(p);
  // Channels to shards no longer placed (a restarted shard on a new port) are closed.
  if (links_ != nullptr)
    links_->KeepOnly([this](const std::string& key) { return view_.Placed(key); });
  return ready;
}

void AttentionCore::ApplyBias(const v1::LayerBias& b) {
  if (view_.ApplyBias(b)) metrics_->BiasVersion(b.layer(), b.version());
}

std::vector<v1::ReportStatsRequest> AttentionCore::TakeReports() {
  return stats_.TakeReports(options_.node,
                            governor_ != nullptr && governor_->enabled() ? governor_->cap() : 0);
}

absl::Status AttentionCore::RunOne(const v1::ForwardRequest& req, absl::Time deadline,
                                   v1::ForwardResponse* resp, bool check) {
  ForwardLimits limits;
  limits.cfg = &cfg_;
  limits.max_tokens = options_.max_tokens;
  limits.reply_mode = options_.reply_mode;
  limits.precision = options_.precision;
  limits.auto_budget_cap = governor_ != nullptr && governor_->enabled() ? governor_->cap() : 0;
  if (links_ == nullptr) return absl::FailedPreconditionError("the attention core is not started");
  MOE_ASSIGN_OR_RETURN(const ForwardSpec spec,
                       PrepareForward(limits, layers_, view_, req, deadline, check));
  ForwardEnv env;
  env.cfg = &cfg_;
  env.links = links_.get();
  env.picker = &picker_;
  env.stats = &stats_;
  env.metrics = metrics_;
  env.max_dispatch_bytes = options_.max_dispatch_bytes;
  env.hedge_share = options_.hedge_share;
  env.audit = audit_.get();
  return RunForward(env, req, spec, options_.micro_batches, resp);
}

absl::Status AttentionCore::Serve(const v1::ForwardRequest& req, absl::Time deadline,
                                  v1::ForwardResponse* resp, const char* method) {
  const auto start = Clock::now();
  metrics_->common.QueueDepth(static_cast<int64_t>(queued()));
  metrics_->common.Started(method);
  serving_.fetch_add(1);
  const absl::Status s = RunOne(req, deadline, resp, /*check=*/false);
  // Counted for the readiness canary before the request is no longer in flight.
  if (s.ok()) {
    answered_.fetch_add(1);
  } else if (FailedOnThePath(s.code())) {
    path_failed_.fetch_add(1);
  }
  serving_.fetch_sub(1);
  if (s.ok()) {
    if (governor_ != nullptr) governor_->Observe(Seconds(Clock::now() - start));
    MaybeCheck(req, *resp);
  }
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

void AttentionCore::CountRefusal(const char* method, const absl::Status& s) const {
  metrics_->common.Error(method, absl::StatusCodeToString(s.code()));
}

void AttentionCore::FillModelInfo(v1::ModelInfo* resp) const {
  resp->set_model(cfg_.name);
  resp->set_hidden(static_cast<int32_t>(cfg_.hidden));
  resp->set_latent(static_cast<int32_t>(cfg_.latent));
  resp->set_num_experts(static_cast<int32_t>(cfg_.num_experts));
  resp->set_top_k(static_cast<int32_t>(cfg_.top_k));
  for (int32_t l : layers()) resp->add_layers(l);
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
  const v1::Placement placement = view_.placement();
  for (const v1::ShardInfo& s : placement.shards()) {
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
  resp->set_ready(Ready());
}

void AttentionCore::OnReadinessChange(std::function<void(bool)> f) {
  std::lock_guard<std::mutex> lock(readiness_mu_);
  on_readiness_ = std::move(f);
}

CanaryOutcome AttentionCore::RunCanary(std::string* detail) {
  const RoutingView::Snapshot s = view_.Get(canary_layer_);
  if (s.bias == nullptr) return CanaryOutcome::kError;
  v1::ForwardResponse resp;
  const absl::Time deadline = absl::Now() + absl::Milliseconds(canary_timeout_ms_);
  const ServeCounts before = Served();
  // As a full-k check: the whole top-k, no statistics, no request metrics (forward_pass.h).
  const absl::Status st = RunOne(canary_->Request(canary_layer_), deadline, &resp, /*check=*/true);
  if (!st.ok()) {
    *detail = st.ToString();
    if (st.code() != absl::StatusCode::kDeadlineExceeded && absl::Now() < deadline) {
      return CanaryOutcome::kError;
    }
    if (!AnsweredOthersMeanwhile(before)) return CanaryOutcome::kTimeout;
    const ServeCounts now = Served();
    absl::StrAppend(detail, "; queued behind ", now.answered - before.answered,
                    " requests answered meanwhile, none failed");
    return CanaryOutcome::kBusy;
  }
  return canary_->Judge(resp, *s.bias, detail);
}

bool AttentionCore::AnsweredOthersMeanwhile(const ServeCounts& before) {
  // Longer than any batch of a K3 prefill here (3.5-4 s at 256 tokens on two vCPUs).
  constexpr auto kBusyWaitMax = std::chrono::seconds(60);
  const auto until = std::chrono::steady_clock::now() + kBusyWaitMax;
  std::unique_lock<std::mutex> lock(stop_mu_);
  for (;;) {
    const ServeCounts now = Served();
    if (now.failed > before.failed) return false;
    if (now.answered > before.answered) return true;
    if (serving_.load() == 0 || stopping_ || std::chrono::steady_clock::now() >= until) {
      return false;
    }
    stop_cv_.wait_for(lock, std::chrono::milliseconds(10));
  }
}

void AttentionCore::CanaryLoop() {
  // Until a canary matches, and while the placement is not ready, look every 250 ms (bounded
  // by the interval); after a match, wait the interval.
  const auto interval = std::chrono::milliseconds(options_.canary_interval_ms);
  const auto retry = std::min(interval, std::chrono::milliseconds(250));
  bool first = true;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(stop_mu_);
      const auto wait = first ? std::chrono::milliseconds(0) : canary_ok_ ? interval : retry;
      if (stop_cv_.wait_for(lock, wait, [&] { return stopping_; })) return;
    }
    first = false;
    const bool was = Ready();
    if (!view_.AllReady()) {
      canary_ok_ = false;  // a placement that comes back is checked again before it is ready
      continue;
    }
    std::string detail;
    const CanaryOutcome o = RunCanary(&detail);
    if (o != CanaryOutcome::kSkipped && o != CanaryOutcome::kBusy) {
      canary_ok_ = o == CanaryOutcome::kMatch;
    }
    canary_timeout_ms_ = NextCanaryTimeoutMs(o, canary_timeout_ms_, options_.canary_timeout_ms);
    metrics_->Canary(kCanaryOutcomes.Name(o), Ready());
    {
      std::lock_guard<std::mutex> lock(canary_mu_);
      canary_last_ = kCanaryOutcomes.Name(o);
      canary_at_ = std::chrono::steady_clock::now();
    }
    if (o == CanaryOutcome::kBusy) {
      MOE_LOG_INFO("readiness canary on layer {}: busy ({}); {}, the next one waits {} ms",
                   canary_layer_, detail, Ready() ? "still ready" : "not ready yet",
                   canary_timeout_ms_);
    } else if (o != CanaryOutcome::kMatch && o != CanaryOutcome::kSkipped) {
      MOE_LOG_WARN("readiness canary on layer {}: {} ({}); not ready", canary_layer_,
                   kCanaryOutcomes.Name(o), detail);
    } else if (!was && Ready()) {
      MOE_LOG_INFO("readiness canary on layer {}: {} ({}); ready", canary_layer_,
                   kCanaryOutcomes.Name(o), detail);
    }
    if (was != Ready()) {
      std::lock_guard<std::mutex> lock(readiness_mu_);
      if (on_readiness_) on_readiness_(Ready());
    }
  }
}

void AttentionCore::GovernorLoop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(stop_mu_);
      if (stop_cv_.wait_for(lock, governor_->interval(), [&] { return stopping_; })) return;
    }
    const int32_t ceiling = view_.BudgetCeiling();  // the highest budget a hosted layer serves
    const int32_t before = governor_->cap();
    std::string why;
    const int step = governor_->Tick(ceiling, &why);
    if (step == 0) continue;
    MOE_LOG_INFO("dynamic k: automatic budget cap {} -> {} ({})", before, governor_->cap(), why);
    metrics_->BudgetStep(step < 0);
    metrics_->AutoBudget(governor_->cap());
  }
}

void AttentionCore::MaybeCheck(const v1::ForwardRequest& req, const v1::ForwardResponse& resp) {
  if (options_.budget_check_every <= 0 || resp.expert_budget() >= cfg_.top_k ||
      resp.output().shape_size() < 1 || resp.output().shape(0) > kMaxCheckTokens) {
    return;
  }
  std::lock_guard<std::mutex> lock(check_mu_);
  if (checks_stopping_ || budgeted_++ % static_cast<uint64_t>(options_.budget_check_every) != 0) {
    return;
  }
  if (static_cast<int>(checks_.size()) >= options_.budget_check_queue) {
    metrics_->BudgetCheck(req.layer(), "dropped");
    return;
  }
  checks_.push_back({req, resp.output().data(), resp.bias_version(), resp.routing_mass_kept()});
  check_cv_.notify_one();
}

void AttentionCore::CheckLoop() {
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
    const absl::Status s = RunOne(
        c.req,
        absl::Now() + absl::Milliseconds(std::min<int64_t>(options_.default_timeout_ms, 5000)),
        &full, /*check=*/true);
    const int32_t layer = c.req.layer();
    if (!s.ok()) {
      MOE_LOG_WARN("dynamic k: the full-k check of a layer {} request failed: {}", layer,
                   s.ToString());
      metrics_->BudgetCheck(layer, "failed");
      continue;
    }
    if (full.bias_version() != c.bias_version || full.output().data().size() != c.output.size()) {
      metrics_->BudgetCheck(layer, "skipped");
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
    metrics_->BudgetCheck(layer, "measured", rel);
    metrics_->BudgetQuality(layer, c.mass_kept, top1);
    stats_.AddCheck(layer, rel, c.mass_kept, top1);
  }
}

}  // namespace moe::attention_svc
