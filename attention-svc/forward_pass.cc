#include "attention-svc/forward_pass.h"

#include <algorithm>
#include <deque>
#include <optional>

#include "absl/strings/str_cat.h"
#include "services/common/logging.h"
#include "services/common/status_macros.h"
#include "services/metrics/service_metrics.h"
#include "services/numerics/mxfp8.h"
#include "services/transport/precision_convert.h"

namespace moe::attention_svc {

namespace {

using numerics::LayerTimings;
using tensor::Bf16;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

absl::Status CheckLatentFinite(const std::vector<Bf16>& z, int64_t latent, int64_t first_token) {
  const size_t i = tensor::FirstNonFinite(z.data(), z.size());
  if (i == z.size()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("the hidden states of token ", first_token + static_cast<int64_t>(i) / latent,
                   " are too large: their latent projection overflows bf16 (column ",
                   static_cast<int64_t>(i) % latent, "); scale the input down"));
}

}  // namespace

absl::StatusOr<ForwardSpec> PrepareForward(const ForwardLimits& limits, const HostedLayers& layers,
                                           const RoutingView& view, const v1::ForwardRequest& req,
                                           absl::Time deadline, bool check) {
  const ModelConfig& cfg = *limits.cfg;
  ForwardSpec spec;
  spec.check = check;
  auto it = layers.find(req.layer());
  if (it == layers.end()) {
    std::string hosted;
    for (const auto& [l, h] : layers) absl::StrAppend(&hosted, hosted.empty() ? "" : ",", l);
    return absl::NotFoundError(
        absl::StrCat("layer ", req.layer(), " is not hosted here (layers ", hosted, ")"));
  }
  spec.hosted = it->second.get();
  MOE_ASSIGN_OR_RETURN(spec.x, transport::DecodeBf16Matrix(req.hidden_states(), "hidden_states",
                                                           cfg.hidden, /*accept_f32=*/true));
  if (spec.x.rows > limits.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("hidden_states: ", spec.x.rows,
                                                     " tokens, this server takes at most ",
                                                     limits.max_tokens, " per request"));
  }
  spec.mode = limits.reply_mode;
  switch (req.options().reply_mode()) {
    case v1::REPLY_MODE_UNSPECIFIED:
      break;
    case v1::REPLY_MODE_PER_PAIR:
      spec.mode = ReplyMode::kPerPair;
      break;
    case v1::REPLY_MODE_PARTIAL_SUM:
      spec.mode = ReplyMode::kPartialSum;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown reply_mode ", static_cast<int>(req.options().reply_mode())));
  }
  MOE_ASSIGN_OR_RETURN(spec.precision,
                       transport::PrecisionFromProto(req.options().precision(), limits.precision));
  if (!v1::MissingExperts_IsValid(req.options().missing_experts())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown missing_experts ", static_cast<int>(req.options().missing_experts())));
  }
  const int32_t cap = req.options().expert_budget();
  if (cap < 0 || cap > cfg.top_k) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert_budget ", cap, " outside [0, top-k = ", cfg.top_k, "] (0: the layer's budget)"));
  }
  const double top_p = req.options().expert_top_p();
  if (!(top_p >= 0 && top_p <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert_top_p ", top_p, " outside [0, 1] (0: off)"));
  }
  if (top_p > 0 && cap > 0) {
    return absl::InvalidArgumentError(
        "expert_top_p and expert_budget are two modes of dynamic k: send one of them");
  }
  {
    RoutingView::Snapshot now = view.Get(req.layer());
    spec.bias = std::move(now.bias);
    spec.route = std::move(now.route);
  }
  if (spec.bias == nullptr) {
    return absl::NotFoundError(absl::StrCat("layer ", req.layer(), " has no bias here"));
  }
  // Dynamic k: the layer's budget, capped by the request and the automatic mode; served only
  // with solved thresholds (the response says which budget it got).
  spec.budget = static_cast<int32_t>(cfg.top_k);
  // A cap below k on a layer with no usable thresholds is refused, never served at k in
  // silence: the caller asked for a cheaper forward and would get the full one.
  if (cap > 0 && cap < cfg.top_k && !spec.bias->usable() && !check) {
    if (spec.bias->stale) {
      return absl::FailedPreconditionError(absl::StrCat(
          "expert_budget ", cap, ": layer ", req.layer(),
          "'s budget thresholds are stale (solved under bias version ",
          spec.bias->solved_from_version,
          spec.bias->k_avg < cfg.top_k
              ? "; the bias has moved since and router-svc solves them again from the next "
                "window of traffic); send 0 or "
              : "; the bias has moved since; the layer has no budget set, so they are solved "
                "again at its next Rebalance or SetExpertBudget); send 0 or ",
          cfg.top_k, " for the full top-k meanwhile"));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "expert_budget ", cap, ": layer ", req.layer(),
        " has no solved budget thresholds (bias version ", spec.bias->version,
        "; router-svc solves them from reported traffic when an operator sets a budget: moe-cli "
        "budget); send 0 or ",
        cfg.top_k, " for the full top-k"));
  }
  spec.rule.k_min = spec.bias->k_min;
  if (top_p > 0 && !check) {
    spec.rule.top_p = top_p;  // served with any bias: it needs no thresholds
  } else if (spec.bias->usable() && !check) {
    int32_t b = spec.bias->k_avg;
    if (cap > 0) b = std::min(b, cap);
    if (limits.auto_budget_cap > 0) b = std::min(b, limits.auto_budget_cap);
    spec.budget = std::clamp<int32_t>(b, 1, static_cast<int32_t>(cfg.top_k));
    if (spec.budget < cfg.top_k) {
      spec.rule.thresholds =
          numerics::BudgetRow(spec.bias->thresholds, spec.budget, cfg.num_experts);
    }
  }
  if (spec.route == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("no placement for layer ", req.layer(), " from router-svc yet"));
  }
  // The expert calls end a little before the caller's deadline (kExpertDeadline*).
  const absl::Duration left = deadline - absl::Now();
  spec.expert_deadline = deadline - std::clamp(left * kExpertDeadlineShare,
                                               kExpertDeadlineMarginMin, kExpertDeadlineMarginMax);
  return spec;
}

ForwardPass::ForwardPass(const ForwardEnv& env, const v1::ForwardRequest& req,
                         const ForwardSpec& spec)
    : env_(env),
      req_(req),
      spec_(spec),
      d_(env.cfg->latent),
      h_(env.cfg->hidden),
      top_k_(env.cfg->top_k),
      out_(static_cast<size_t>(spec.x.rows * h_)),
      replicas_(*spec.route, env.picker, Hooks()) {
  dispatch_.mode = spec.mode;
  dispatch_.num_experts = env.cfg->num_experts;
  dispatch_.latent = d_;
  dispatch_.max_message_bytes = env.max_dispatch_bytes;
  if (req.options().return_routing()) {
    expert_ids_.resize(static_cast<size_t>(spec.x.rows * top_k_));
    weights_.resize(static_cast<size_t>(spec.x.rows * top_k_));
  }
}

absl::StatusOr<ForwardPass::InFlight> ForwardPass::Start(int64_t lo, int64_t rows) {
  InFlight f;
  f.lo = lo;
  f.rows = rows;
  HostedLayer& hosted = *spec_.hosted;
  {
    std::lock_guard<std::mutex> lock(hosted.mu);
    MOE_ASSIGN_OR_RETURN(
        f.batch, hosted.layer->RouteAndProject(
                     absl::MakeConstSpan(spec_.x.values)
                         .subspan(static_cast<size_t>(lo * h_), static_cast<size_t>(rows * h_)),
                     rows, spec_.x.cols, spec_.bias->bias.data(), &t_));
  }
  // Finite inputs can still overflow the latent (|x| near the bf16 maximum): the caller's
  // error, said here, not a shard's refusal of non-finite activations.
  MOE_RETURN_IF_ERROR(CheckLatentFinite(f.batch.z, d_, lo));
  // The statistics take the selections before any budget (the full top-k); they are counted
  // once the messages are out, while the shards work.
  std::optional<numerics::Routing> full;
  if (!spec_.check) full = f.batch.routing;
  // The budget's or the request's rule (none: every pair kept, the routing untouched).
  const ModelConfig& cfg = *env_.cfg;
  routed_pairs_ +=
      numerics::ApplyBudget(f.batch.scores.data(), cfg.num_experts, spec_.rule, cfg.renormalize,
                            cfg.routed_scaling_factor, &f.batch.routing, &kept_mass_);
  DispatchSpec dispatch = dispatch_;
  if (req_.options().missing_experts() == v1::MISSING_EXPERTS_DEGRADE && !Covered(*spec_.route)) {
    int64_t pairs = 0;
    for (int32_t e : DegradeRouting(*spec_.route, &f.batch.routing, &dispatch.skip, &pairs)) {
      missing_.insert(e);
    }
    degraded_pairs_ += pairs;
  }
  // W4A8: z quantized to MXFP8 once per token here; every message carries its tokens' rows.
  const tensor::Activations z =
      spec_.precision == numerics::Precision::kW4A8
          ? tensor::Activations::FromMxfp8(numerics::QuantizeMxfp8Rows(f.batch.z.data(), rows, d_))
          : tensor::Activations::FromBf16(f.batch.z, rows, d_);
  MOE_ASSIGN_OR_RETURN(f.plan, PlanDispatch(f.batch.routing, z, *spec_.route, dispatch));
  if (!spec_.check) {  // where the router's loads are counted
    env_.metrics->Routed(req_.layer(), f.plan.per_expert, f.plan.shard_rows);
  }
  if (!first_send_.has_value()) first_send_ = Clock::now();
  f.header.layer = req_.layer();
  f.header.mode = spec_.mode;
  f.header.num_tokens = rows;
  f.header.latent = d_;
  f.header.timeout_ms =
      std::max<int64_t>(1, absl::ToInt64Milliseconds(spec_.expert_deadline - absl::Now()));
  // Every message goes out before any reply is awaited.
  for (const DispatchMessage& m : f.plan.messages) f.calls.push_back(replicas_.Send(f.header, m));
  // The shared experts need only x: they run here while the expert servers work.
  {
    std::lock_guard<std::mutex> lock(hosted.mu);
    f.shared = hosted.layer->SharedExperts(f.batch, &t_);
  }
  // Not on the path to the shards: QB's histogram costs ~5 us a token at K3's shape.
  if (full.has_value()) {
    env_.stats->Accumulate(req_.layer(), *spec_.bias, f.batch.scores, f.batch.tokens, *full);
  }
  return f;
}

absl::Status ForwardPass::Finish(InFlight& f) {
  std::vector<ExpertReply> replies(f.plan.messages.size());
  const bool f32 = spec_.mode == ReplyMode::kPartialSum;
  const bool degrade = req_.options().missing_experts() == v1::MISSING_EXPERTS_DEGRADE;
  std::vector<bool> lost;  // DEGRADE: experts whose shard died or stalled after dispatch
  for (size_t i = 0; i < f.calls.size(); ++i) {
    absl::StatusOr<ExpertReply> reply = f.calls[i]->Wait(spec_.expert_deadline);
    if (!reply.ok() && degrade &&
        (reply.status().code() == absl::StatusCode::kUnavailable ||
         reply.status().code() == absl::StatusCode::kDeadlineExceeded)) {
      // No replica answered in time: under DEGRADE its experts are left out like missing ones
      // (said in the response and moe_degraded_pairs_total).
      lost.resize(static_cast<size_t>(spec_.route->owner.size()), false);
      for (const auto& [e, rows] : f.plan.messages[i].groups) lost[e] = true;
      replies[i] = ZeroReply(f.plan.messages[i], f32, d_);
      continue;
    }
    MOE_RETURN_IF_ERROR(reply.status());
    replies[i] = *std::move(reply);
    const int64_t bytes = f32 ? static_cast<int64_t>(replies[i].f32.size() * sizeof(float))
                              : static_cast<int64_t>(replies[i].bf16.size() * sizeof(Bf16));
    bytes_received_ += bytes;
    env_.metrics->wire.Add("received", f32 ? "f32" : "bf16", "expert", bytes, replies[i].rows,
                           f.calls[i]->transport());
  }
  last_reply_ = Clock::now();
  if (!lost.empty()) {
    int64_t pairs = 0;
    std::vector<int32_t> missing;
    const std::vector<float> scale = DegradeLost(lost, &f.batch.routing, &pairs, &missing);
    missing_.insert(missing.begin(), missing.end());
    degraded_pairs_ += pairs;
    // Partial sums were weighted at the shards with the weights before the loss.
    for (size_t i = 0; f32 && i < replies.size(); ++i) {
      const std::vector<int64_t>& tokens = f.plan.messages[i].tokens;
      for (size_t j = 0; j < tokens.size(); ++j) {
        const float c = scale[static_cast<size_t>(tokens[j])];
        if (c == 1.0f) continue;
        for (int64_t col = 0; col < d_; ++col) replies[i].f32[j * d_ + col] *= c;
      }
    }
  }
  const auto combine_start = Clock::now();
  std::vector<Bf16> r;
  {
    numerics::StageTimer timer(&t_, &LayerTimings::combine_norm);
    MOE_ASSIGN_OR_RETURN(
        r, Gather(f.plan, f.batch.routing, *spec_.route, replies, spec_.hosted->layer->pool()));
  }
  combine_seconds_ += Seconds(Clock::now() - combine_start);
  std::vector<Bf16> y;
  {
    std::lock_guard<std::mutex> lock(spec_.hosted->mu);
    y = spec_.hosted->layer->Finish(f.batch, r.data(), &t_, &f.shared);
  }
  std::copy(y.begin(), y.end(), out_.begin() + f.lo * h_);
  if (!expert_ids_.empty()) {
    std::copy(f.batch.routing.expert_ids.begin(), f.batch.routing.expert_ids.end(),
              expert_ids_.begin() + f.lo * top_k_);
    std::copy(f.batch.routing.weights.begin(), f.batch.routing.weights.end(),
              weights_.begin() + f.lo * top_k_);
  }
  return absl::OkStatus();
}

void ForwardPass::Respond(v1::ForwardResponse* resp) const {
  resp->set_request_id(req_.request_id());
  transport::EncodeBf16Into(out_, spec_.x.rows, h_, resp->mutable_output());
  resp->set_bias_version(spec_.bias->version);
  if (req_.options().return_routing()) {
    v1::Routing* rt = resp->mutable_routing();
    rt->set_top_k(static_cast<int32_t>(top_k_));
    *rt->mutable_expert_ids() = {expert_ids_.begin(), expert_ids_.end()};
    *rt->mutable_weights() = {weights_.begin(), weights_.end()};
  }
  resp->set_precision(transport::PrecisionToProto(spec_.precision));
  resp->set_expert_budget(spec_.budget);
  resp->set_routed_pairs(routed_pairs_);
  resp->set_routing_mass_kept(spec_.x.rows > 0 ? kept_mass_ / static_cast<double>(spec_.x.rows)
                                               : 1.0);
  resp->set_dispatch_bytes_sent(bytes_sent_);
  resp->set_dispatch_bytes_received(bytes_received_);
  if (degraded_pairs_ > 0) {
    *resp->mutable_missing_experts() = {missing_.begin(), missing_.end()};
    resp->set_degraded_pairs(degraded_pairs_);
    env_.metrics->Degraded(req_.layer(), degraded_pairs_);
  }
  v1::StageSeconds* sec = resp->mutable_seconds();
  sec->set_router(t_.router);
  sec->set_down_proj(t_.down_proj);
  sec->set_dispatch(first_send_.has_value() ? Seconds(last_reply_ - *first_send_) : 0.0);
  sec->set_combine_norm(t_.combine_norm);
  sec->set_up_proj(t_.up_proj);
  sec->set_shared(t_.shared);
  sec->set_combine(combine_seconds_);
}

FailoverHooks ForwardPass::Hooks() {
  FailoverHooks hooks;
  hooks.channel_for = [links = env_.links](const ShardRef& s) { return links->ChannelFor(s); };
  hooks.on_sent = [this](const DispatchMessage& m, const char* transport) {
    bytes_sent_ += m.activation_bytes();
    if (*transport != '\0') {
      env_.metrics->wire.Add("sent", tensor::ActivationFormatName(m.z.format()), "expert",
                             m.activation_bytes(), static_cast<int64_t>(m.tokens.size()),
                             transport);
    }
  };
  hooks.hedge_share = env_.hedge_share;
  hooks.audit = env_.audit;
  hooks.on_hedge = [this](const ShardRef& slow, const ShardRef& twin, bool twin_won) {
    env_.metrics->Hedge(slow.shard, twin_won);
    if (twin_won) {
      MOE_LOG_INFO("layer {}: {} was silent, its twin {} answered first", req_.layer(), slow.shard,
                   twin.shard);
    }
  };
  hooks.on_failover = [this](const ShardRef& from, const ShardRef& to, const absl::Status& why) {
    MOE_LOG_INFO("layer {}: {} failed over to {} ({})", req_.layer(), from.shard, to.shard,
                 why.ToString());
    env_.metrics->Failover(from.shard);
  };
  return hooks;
}

absl::Status RunForward(const ForwardEnv& env, const v1::ForwardRequest& req,
                        const ForwardSpec& spec, int micro_batches, v1::ForwardResponse* resp) {
  ForwardPass pass(env, req, spec);
  // Micro-batches (--micro_batches): at most two in flight, so one is routed, projected and
  // run through the shared experts here while the expert servers compute the other.
  const int64_t tokens = spec.x.rows;
  const int64_t chunks = std::clamp<int64_t>(micro_batches, 1, std::max<int64_t>(1, tokens));
  const int64_t per_chunk = (tokens + chunks - 1) / chunks;
  std::deque<ForwardPass::InFlight> flight;
  for (int64_t lo = 0; lo < tokens; lo += per_chunk) {
    MOE_ASSIGN_OR_RETURN(ForwardPass::InFlight f, pass.Start(lo, std::min(per_chunk, tokens - lo)));
    flight.push_back(std::move(f));
    if (flight.size() > 1) {
      MOE_RETURN_IF_ERROR(pass.Finish(flight.front()));
      flight.pop_front();
    }
  }
  for (ForwardPass::InFlight& f : flight) MOE_RETURN_IF_ERROR(pass.Finish(f));
  pass.Respond(resp);
  return absl::OkStatus();
}

}  // namespace moe::attention_svc
