#include "attention-svc/expert_links.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "attention-svc/dataplane/registry.h"
#include "services/common/logging.h"
#include "services/common/status_macros.h"
#include "services/metrics/service_metrics.h"

namespace moe::attention_svc {

absl::StatusOr<std::unique_ptr<ExpertLinks>> ExpertLinks::Start(
    const ExpertLinksOptions& options, metrics::AttentionMetrics* metrics) {
  std::unique_ptr<ExpertLinks> links(new ExpertLinks(metrics));
  MOE_RETURN_IF_ERROR(links->StartHalves(options));
  ExpertChannelConfig& c = links->config_;
  c.max_message_bytes = options.max_message_bytes;
  c.cluster_token = options.cluster_token;
  c.node = options.node;
  for (const auto& h : links->halves_) c.data_planes.push_back(h.get());
  c.fallback_in_band = options.data_plane.automatic();
  c.detach_reply_tag_from = static_cast<size_t>(std::max<int64_t>(0, options.ucx_detach_tag_from));
  c.local_weights = options.local.weights;
  c.cfg = options.cfg;
  c.kernels = options.local.kernels;
  c.pool = options.local.pool;
  c.on_event = [metrics](const std::string& shard, const std::string& event) {
    metrics->DataPlaneEvent(shard, event);
  };
  c.on_lanes = [metrics](const std::string& shard, const dataplane::Lanes& lanes,
                         const std::string& shard_lanes) {
    MOE_LOG_INFO("data plane to {}: lanes {} (the shard's side: {})", shard, lanes.Describe(),
                 shard_lanes);
    metrics->DataPlaneLanes(shard, lanes.kind, lanes.Describe(), shard_lanes);
  };
  return links;
}

absl::Status ExpertLinks::StartHalves(const ExpertLinksOptions& options) {
  for (const std::string& backend : options.data_plane.backends()) {
    ClientHalfOptions co;
    co.node = options.node;
    co.tls = options.ucx_tls;
    co.bind_host = options.bind_host;
    co.poll_spin = std::chrono::microseconds(std::max(0, options.ucx_poll_us));
    co.poll_spin_max = std::chrono::microseconds(std::max(0, options.ucx_poll_max_us));
    co.progress_spin = dataplane::ProgressSpin(options.ucx_progress_spin_us);
    auto half = StartClientHalf(backend, co);
    if (half.ok()) {
      MOE_LOG_INFO("{} data plane up ({})", (*half)->name(), (*half)->Describe());
      halves_.push_back(std::move(*half));
    } else if (!options.data_plane.automatic()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--data_plane=", backend, ": ", half.status().message()));
    } else {
      MOE_LOG_WARN("no {} data plane ({})", backend, half.status().ToString());
    }
  }
  if (options.data_plane.automatic() && halves_.empty()) MOE_LOG_WARN("in band only");
  return absl::OkStatus();
}

std::shared_ptr<ExpertChannel> ExpertLinks::ChannelFor(const ShardRef& s) {
  const std::string key = s.shard + "@" + s.endpoint;
  std::lock_guard<std::mutex> lock(mu_);
  auto& channel = channels_[key];
  if (channel != nullptr) return channel;
  // Once per shard, not per message: its failover series starts at 0.
  metrics_->Failover(s.shard, 0);
  metrics_->Hedge(s.shard, false, 0);  // the series exist at 0 from the shard's first use
  metrics_->Hedge(s.shard, true, 0);
  metrics_->Quarantined(s.shard, 0, 0);
  channel = MakeExpertChannel(config_, s);
  return channel;
}

void ExpertLinks::KeepOnly(const std::function<bool(const std::string&)>& placed) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = channels_.begin(); it != channels_.end();) {
    it = placed(it->first) ? std::next(it) : channels_.erase(it);
  }
}

void ExpertLinks::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  channels_.clear();
}

}  // namespace moe::attention_svc
