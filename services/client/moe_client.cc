#include "services/client/moe_client.h"

#include <grpcpp/grpcpp.h>

#include <mutex>

#include "absl/strings/str_cat.h"
#include "moe/v1/attention.grpc.pb.h"
#include "moe/v1/router.grpc.pb.h"
#include "services/common/status_macros.h"
#include "services/transport/channel.h"
#include "services/transport/health_check.h"
#include "services/transport/status_convert.h"
#include "services/transport/tensor_codec.h"

namespace moe::client {

using tensor::Bf16;

namespace {

absl::StatusOr<ForwardResult> ToResult(const v1::ForwardResponse& r) {
  ForwardResult out;
  MOE_ASSIGN_OR_RETURN(transport::Bf16Matrix m,
                       transport::DecodeBf16Matrix(r.output(), "output", -1, false));
  out.tokens = m.rows;
  out.width = m.cols;
  out.out = std::move(m.values);
  out.top_k = r.routing().top_k();
  out.expert_ids.assign(r.routing().expert_ids().begin(), r.routing().expert_ids().end());
  out.weights.assign(r.routing().weights().begin(), r.routing().weights().end());
  out.bias_version = r.bias_version();
  out.precision = r.precision();
  out.expert_budget = r.expert_budget();
  out.routed_pairs = r.routed_pairs();
  out.routing_mass_kept = r.routing_mass_kept();
  out.seconds = r.seconds();
  out.dispatch_bytes_sent = r.dispatch_bytes_sent();
  out.dispatch_bytes_received = r.dispatch_bytes_received();
  out.missing_experts.assign(r.missing_experts().begin(), r.missing_experts().end());
  out.degraded_pairs = r.degraded_pairs();
  return out;
}

void FillRequest(int32_t layer, const ForwardOptions& o, v1::ForwardRequest* req) {
  req->set_layer(layer);
  req->mutable_options()->set_return_routing(o.return_routing);
  req->mutable_options()->set_reply_mode(o.reply_mode);
  req->mutable_options()->set_missing_experts(o.missing_experts);
  req->mutable_options()->set_precision(o.precision);
  req->mutable_options()->set_expert_budget(o.expert_budget);
  req->mutable_options()->set_expert_top_p(o.expert_top_p);
}

class GrpcForwardStream final : public ForwardStream {
 public:
  GrpcForwardStream(v1::AttentionService::Stub* stub, absl::Duration timeout) {
    ctx_.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    rw_ = stub->ForwardStream(&ctx_);
  }
  ~GrpcForwardStream() override {
    ctx_.TryCancel();
    if (!finished_) rw_->Finish();
  }

  absl::StatusOr<uint64_t> Send(int32_t layer, absl::Span<const Bf16> x, int64_t tokens,
                                int64_t width, const ForwardOptions& options) override {
    v1::ForwardRequest req;
    FillRequest(layer, options, &req);
    const uint64_t id = next_id_++;
    req.set_request_id(id);
    transport::EncodeBf16Into(x, tokens, width, req.mutable_hidden_states());
    std::lock_guard<std::mutex> lock(write_mu_);
    if (!rw_->Write(req)) return absl::UnavailableError("forward stream closed");
    return id;
  }

  absl::StatusOr<std::pair<uint64_t, absl::StatusOr<ForwardResult>>> Receive() override {
    v1::ForwardResponse resp;
    if (!rw_->Read(&resp)) {
      finished_ = true;
      const absl::Status s = transport::FromGrpc(rw_->Finish());
      if (!s.ok()) return s;
      return absl::OutOfRangeError("end of stream");
    }
    if (resp.code() != 0) {
      return std::make_pair(resp.request_id(), absl::StatusOr<ForwardResult>(transport::FromCode(
                                                   resp.code(), resp.message())));
    }
    return std::make_pair(resp.request_id(), ToResult(resp));
  }

  absl::Status CloseSend() override {
    std::lock_guard<std::mutex> lock(write_mu_);
    if (!rw_->WritesDone()) return absl::UnavailableError("forward stream closed");
    return absl::OkStatus();
  }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ForwardRequest, v1::ForwardResponse>> rw_;
  std::mutex write_mu_;
  uint64_t next_id_ = 1;
  bool finished_ = false;
};

class GrpcMoeClient final : public MoeClient {
 public:
  GrpcMoeClient(const ClientOptions& o, std::shared_ptr<grpc::ChannelCredentials> credentials)
      : options_(o) {
    if (!o.attention.empty()) {
      attention_channel_ = transport::MakeChannel(o.attention, o.max_message_bytes, credentials);
      attention_ = v1::AttentionService::NewStub(attention_channel_);
    }
    if (!o.router.empty()) {
      router_ = v1::RouterService::NewStub(
          transport::MakeChannel(o.router, transport::kDefaultMaxMessageBytes, credentials));
    }
  }

  absl::StatusOr<ForwardResult> Forward(int32_t layer, absl::Span<const Bf16> x, int64_t tokens,
                                        int64_t width, const ForwardOptions& o) override {
    v1::ForwardRequest req;
    FillRequest(layer, o, &req);
    transport::EncodeBf16Into(x, tokens, width, req.mutable_hidden_states());
    return Call(req, o);
  }

  absl::StatusOr<ForwardResult> ForwardF32(int32_t layer, absl::Span<const float> x, int64_t tokens,
                                           int64_t width, const ForwardOptions& o) override {
    v1::ForwardRequest req;
    FillRequest(layer, o, &req);
    *req.mutable_hidden_states() = transport::EncodeF32(x, tokens, width);
    return Call(req, o);
  }

  absl::StatusOr<std::unique_ptr<ForwardStream>> OpenForwardStream(
      absl::Duration timeout) override {
    if (attention_ == nullptr) return absl::FailedPreconditionError("no attention endpoint");
    return std::unique_ptr<ForwardStream>(new GrpcForwardStream(attention_.get(), timeout));
  }

  absl::StatusOr<v1::LoadStats> GetLoadStats(int32_t layer) override {
    v1::GetLoadStatsRequest req;
    req.set_layer(layer);
    return RouterCall<v1::LoadStats>(&v1::RouterService::Stub::GetLoadStats, req, false);
  }

  absl::StatusOr<v1::RebalanceResponse> Rebalance(int32_t layer, bool dry_run) override {
    v1::RebalanceRequest req;
    req.set_layer(layer);
    req.set_dry_run(dry_run);
    return RouterCall<v1::RebalanceResponse>(&v1::RouterService::Stub::Rebalance, req, true);
  }

  absl::StatusOr<v1::LayerBias> RollbackBias(int32_t layer, uint64_t to_version) override {
    v1::RollbackBiasRequest req;
    req.set_layer(layer);
    req.set_to_version(to_version);
    return RouterCall<v1::LayerBias>(&v1::RouterService::Stub::RollbackBias, req, true);
  }

  absl::StatusOr<bool> ReleaseShard(const std::string& shard) override {
    v1::ReleaseShardRequest req;
    req.set_shard(shard);
    auto r =
        RouterCall<v1::ReleaseShardResponse>(&v1::RouterService::Stub::ReleaseShard, req, true);
    if (!r.ok()) return r.status();
    return r->released();
  }

  absl::StatusOr<v1::LayerBias> SetBiasMode(int32_t layer, v1::BiasMode mode,
                                            int64_t continuous_tokens) override {
    v1::SetBiasModeRequest req;
    req.set_layer(layer);
    req.set_mode(mode);
    req.set_continuous_tokens(continuous_tokens);
    return RouterCall<v1::LayerBias>(&v1::RouterService::Stub::SetBiasMode, req, true);
  }

  absl::StatusOr<v1::LayerBias> SetExpertBudget(int32_t layer, int32_t k_avg) override {
    v1::SetExpertBudgetRequest req;
    req.set_layer(layer);
    req.set_k_avg(k_avg);
    return RouterCall<v1::LayerBias>(&v1::RouterService::Stub::SetExpertBudget, req, true);
  }

  absl::StatusOr<v1::LayerBias> GetBias(int32_t layer) override {
    v1::GetBiasRequest req;
    req.set_layer(layer);
    return RouterCall<v1::LayerBias>(&v1::RouterService::Stub::GetBias, req, false);
  }

  absl::StatusOr<v1::Placement> GetPlacement() override {
    return RouterCall<v1::Placement>(&v1::RouterService::Stub::GetPlacement,
                                     v1::GetPlacementRequest(), false);
  }

  absl::StatusOr<bool> AttentionServing() override {
    if (attention_channel_ == nullptr)
      return absl::FailedPreconditionError("no attention endpoint");
    return transport::CheckHealth(attention_channel_, options_.timeout);
  }

  absl::StatusOr<v1::ModelInfo> GetModelInfo() override {
    if (attention_ == nullptr) return absl::FailedPreconditionError("no attention endpoint");
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
    v1::ModelInfo info;
    MOE_RETURN_IF_ERROR(
        transport::FromGrpc(attention_->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info)));
    return info;
  }

 private:
  absl::StatusOr<ForwardResult> Call(const v1::ForwardRequest& req, const ForwardOptions& o) {
    if (attention_ == nullptr) return absl::FailedPreconditionError("no attention endpoint");
    grpc::ClientContext ctx;
    const absl::Duration timeout = o.timeout > absl::ZeroDuration() ? o.timeout : options_.timeout;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    v1::ForwardResponse resp;
    const grpc::Status s = attention_->Forward(&ctx, req, &resp);
    if (!s.ok()) return transport::FromGrpc(s);
    return ToResult(resp);
  }

  template <typename Resp, typename Req, typename Method>
  absl::StatusOr<Resp> RouterCall(Method method, const Req& req, bool admin) {
    if (router_ == nullptr) return absl::FailedPreconditionError("no router endpoint");
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
    if (admin && !options_.admin_token.empty()) {
      ctx.AddMetadata(transport::kAdminTokenMetadata, options_.admin_token);
    }
    Resp resp;
    const grpc::Status s = (router_.get()->*method)(&ctx, req, &resp);
    if (!s.ok()) return transport::FromGrpc(s);
    return resp;
  }

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> attention_channel_;
  std::unique_ptr<v1::AttentionService::Stub> attention_;
  std::unique_ptr<v1::RouterService::Stub> router_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MoeClient>> MoeClient::Create(const ClientOptions& options) {
  if (options.attention.empty() && options.router.empty()) {
    return absl::InvalidArgumentError("MoeClient needs an attention or a router endpoint");
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // null: the process's
  if (options.tls.enabled()) {
    MOE_ASSIGN_OR_RETURN(credentials, transport::MakeChannelCredentials(options.tls));
  }
  return std::unique_ptr<MoeClient>(new GrpcMoeClient(options, std::move(credentials)));
}

}  // namespace moe::client
