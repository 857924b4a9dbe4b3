#include <set>

#include "attention-svc/attention_impl.h"
#include "services/numerics/precision_mode.h"

namespace moe::attention_svc {

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
  const int64_t bytes = m.activation_bytes();
  *bytes_sent += bytes;
  *call = std::make_unique<CountedCall>(ChannelFor(route.shards[target])->Send(header, m), &picker_,
                                        route.shards[target]);
  *transport = (*call)->transport();
  if (metrics_ != nullptr && **transport != '\0') {
    metrics_->wire.Add("sent", tensor::ActivationFormatName(m.z.format()), "expert", bytes,
                       static_cast<int64_t>(m.tokens.size()), *transport);
  }
}

std::shared_ptr<ExpertChannel> AttentionServer::Impl::ChannelFor(const ShardRef& s) {
  const std::string key = s.shard + "@" + s.endpoint;
  std::lock_guard<std::mutex> lock(mu_);
  auto& channel = channels_[key];
  // Once per shard, not per message: its failover series starts at 0.
  if (channel == nullptr && metrics_ != nullptr) metrics_->Failover(s.shard, 0);
  if (channel == nullptr && ucx_ != nullptr) {
    channel = std::make_shared<UcxExpertChannel>(
        s.shard, s.endpoint, options_.max_message_bytes, ucx_.get(), options_.data_plane,
        options_.node,
        [this](const std::string& shard, const std::string& event) {
          if (metrics_ != nullptr) metrics_->DataPlaneEvent(shard, event);
        },
        options_.cluster_token,
        [this](const std::string& shard, const dataplane::UcxLanes& lanes,
               const std::string& shard_lanes) {
          MOE_LOG_INFO("data plane to {}: UCX lanes {} (the shard's side: {})", shard,
                       lanes.Describe(), shard_lanes);
          if (metrics_ != nullptr) {
            metrics_->DataPlaneLanes(shard, lanes.kind, lanes.Describe(), shard_lanes);
          }
        });
  } else if (channel == nullptr) {
    channel = std::make_shared<GrpcExpertChannel>(s.shard, s.endpoint, options_.max_message_bytes,
                                                  options_.cluster_token);
  }
  return channel;
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
  MOE_ASSIGN_OR_RETURN(
      const numerics::Precision precision,
      transport::PrecisionFromProto(req.options().precision(), options_.precision));
  const bool w4a8 = precision == numerics::Precision::kW4A8;
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
    // W4A8: z quantized to MXFP8 once per token here; every message carries its tokens' rows.
    const tensor::Activations z =
        w4a8
            ? tensor::Activations::FromMxfp8(numerics::QuantizeMxfp8Rows(f.batch.z.data(), rows, d))
            : tensor::Activations::FromBf16(f.batch.z, rows, d);
    MOE_ASSIGN_OR_RETURN(f.plan, PlanDispatch(f.batch.routing, z, *route, batch_spec));
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
      // range within the same deadline; with none left, the last one gets it once more (a
      // transport broken under this call, e.g. a data-plane endpoint another request's
      // cancelled transfer closed, is reopened by the channel); other errors are the answer.
      std::set<size_t> tried;
      bool again = false;
      for (;;) {
        absl::StatusOr<ExpertReply> reply = f.calls[i]->Wait(expert_deadline);
        const bool gone = !reply.ok() && reply.status().code() == absl::StatusCode::kUnavailable;
        if (reply.ok() || !gone || absl::Now() >= expert_deadline) {
          MOE_ASSIGN_OR_RETURN(replies[i], std::move(reply));
          break;
        }
        tried.insert(f.targets[i]);
        const DispatchMessage& m = f.plan.messages[i];
        size_t next = picker_.Pick(*route, ReplicasOf(*route, m.shard), tried);
        if (next >= route->shards.size()) {
          if (again) return reply.status();  // no replica left
          again = true;
          next = f.targets[i];
        }
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
  resp->set_precision(transport::PrecisionToProto(precision));
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

}  // namespace moe::attention_svc
