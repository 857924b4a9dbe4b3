#include "services/client/router_link.h"

#include <grpcpp/grpcpp.h>

#include <chrono>

#include "services/transport/channel.h"
#include "services/transport/status_convert.h"

namespace moe::client {

namespace {

void SetDeadline(grpc::ClientContext* ctx, absl::Duration timeout) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
}

}  // namespace

RouterLink::RouterLink(const std::string& router, RouterLinkTimings timings,
                       std::string cluster_token)
    : timings_(timings),
      stub_(v1::RouterService::NewStub(transport::MakeChannel(router))),
      cluster_token_(std::move(cluster_token)) {}

RouterLink::~RouterLink() { Stop(); }

void RouterLink::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
    for (grpc::ClientContext* ctx : open_watches_) ctx->TryCancel();
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

bool RouterLink::Sleep(absl::Duration d) {
  std::unique_lock<std::mutex> lock(mu_);
  return !cv_.wait_for(lock, std::chrono::milliseconds(absl::ToInt64Milliseconds(d)),
                       [&] { return stopping_; });
}

template <typename Msg, typename OpenFn, typename ApplyFn>
void RouterLink::WatchLoop(OpenFn open, ApplyFn apply) {
  for (;;) {
    grpc::ClientContext ctx;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      open_watches_.insert(&ctx);
    }
    auto reader = open(&ctx);
    Msg m;
    while (reader->Read(&m)) apply(m);
    reader->Finish();
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_watches_.erase(&ctx);
    }
    if (!Sleep(timings_.reconnect_delay)) return;
  }
}

void RouterLink::WatchPlacement(std::function<void(const v1::Placement&)> on_placement) {
  threads_.emplace_back([this, apply = std::move(on_placement)] {
    v1::GetPlacementRequest req;
    WatchLoop<v1::Placement>(
        [&](grpc::ClientContext* ctx) { return stub_->WatchPlacement(ctx, req); }, apply);
  });
}

void RouterLink::WatchBias(std::vector<int32_t> layers,
                           std::function<void(const v1::LayerBias&)> on_bias) {
  threads_.emplace_back([this, layers = std::move(layers), apply = std::move(on_bias)] {
    v1::WatchBiasRequest req;
    *req.mutable_layers() = {layers.begin(), layers.end()};
    WatchLoop<v1::LayerBias>([&](grpc::ClientContext* ctx) { return stub_->WatchBias(ctx, req); },
                             apply);
  });
}

// One unary member call: the call timeout and the cluster token, the status converted.
template <typename Resp, typename Call>
absl::StatusOr<Resp> RouterLink::Unary(Call call) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, timings_.call_timeout);
  if (!cluster_token_.empty()) ctx.AddMetadata(transport::kClusterTokenMetadata, cluster_token_);
  Resp resp;
  const grpc::Status s = call(&ctx, &resp);
  if (!s.ok()) return transport::FromGrpc(s);
  return resp;
}

absl::StatusOr<v1::ReportStatsResponse> RouterLink::ReportStats(const v1::ReportStatsRequest& req) {
  return Unary<v1::ReportStatsResponse>(
      [&](grpc::ClientContext* ctx, auto* resp) { return stub_->ReportStats(ctx, req, resp); });
}

absl::StatusOr<v1::QuarantineShardResponse> RouterLink::QuarantineShard(
    const v1::QuarantineShardRequest& req) {
  return Unary<v1::QuarantineShardResponse>(
      [&](grpc::ClientContext* ctx, auto* resp) { return stub_->QuarantineShard(ctx, req, resp); });
}

absl::Status RouterLink::ReportNode(const v1::ReportNodeRequest& req) {
  return Unary<v1::ReportNodeResponse>([&](grpc::ClientContext* ctx, auto* resp) {
           return stub_->ReportNode(ctx, req, resp);
         })
      .status();
}

void RouterLink::KeepRegistered(v1::RegisterExpertServerRequest req,
                                std::function<int64_t()> queued, std::function<std::string()> lanes,
                                std::function<void(const absl::Status&)> refused) {
  threads_.emplace_back([this, req = std::move(req), queued = std::move(queued),
                         lanes = std::move(lanes), refused = std::move(refused)] {
    absl::Duration interval = timings_.default_heartbeat;
    uint64_t lease = 0;
    while (Sleep(lease == 0 ? timings_.reconnect_delay : interval)) {
      grpc::ClientContext ctx;
      SetDeadline(&ctx, timings_.call_timeout);
      if (!cluster_token_.empty())
        ctx.AddMetadata(transport::kClusterTokenMetadata, cluster_token_);
      if (lease == 0) {
        v1::RegisterExpertServerResponse resp;
        const grpc::Status s = stub_->RegisterExpertServer(&ctx, req, &resp);
        if (s.ok()) {
          lease = resp.lease_id();
          if (resp.heartbeat_interval_ms() > 0) {
            interval = absl::Milliseconds(resp.heartbeat_interval_ms());
          }
        } else if (refused) {
          refused(transport::FromGrpc(s));
        }
      } else {
        v1::HeartbeatRequest hb;
        hb.set_lease_id(lease);
        if (queued) hb.set_queued_batches(queued());
        if (lanes) hb.set_data_plane_lanes(lanes());
        v1::HeartbeatResponse resp;
        const grpc::Status s = stub_->Heartbeat(&ctx, hb, &resp);
        if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
          lease = 0;  // register again
        } else if (!s.ok() && s.error_code() != grpc::StatusCode::UNAVAILABLE &&
                   s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED && refused) {
          refused(transport::FromGrpc(s));  // the lease lapses unless the next one passes
        }
      }
      std::lock_guard<std::mutex> lock(mu_);
      lease_ = lease;
    }
  });
}

uint64_t RouterLink::lease() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lease_;
}

}  // namespace moe::client
