#include "attention-svc/expert_links.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "attention-svc/dataplane/registry.h"
#include "services/common/logging.h"
#include "services/metrics/service_metrics.h"

namespace moe::attention_svc {

absl::StatusOr<std::unique_ptr<ExpertLinks>> ExpertLinks::Start(
    const ExpertLinksOptions& options, metrics::AttentionMetrics* metrics) {
  std::unique_ptr<ExpertLinks> links(new ExpertLinks(options, metrics));
  if (options.data_plane.in_band()) return links;
  const std::string backend = options.data_plane.backend();
  ClientHalfOptions co;
  co.node = options.node;
  co.tls = options.ucx_tls;
  co.bind_host = options.bind_host;
  co.poll_spin = std::chrono::microseconds(std::max(0, options.ucx_poll_us));
  auto half = StartClientHalf(backend, co);
  if (half.ok()) {
    links->half_ = std::move(*half);
    MOE_LOG_INFO("{} data plane up ({})", links->half_->name(), links->half_->Describe());
  } else if (!options.data_plane.automatic()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--data_plane=", backend, ": ", half.status().message()));
  } else {
    MOE_LOG_WARN("no {} data plane ({}): in band only", backend, half.status().ToString());
  }
  return links;
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
  ExpertChannelConfig c;
  c.max_message_bytes = o_.max_message_bytes;
  c.cluster_token = o_.cluster_token;
  c.node = o_.node;
  c.data_plane = half_.get();
  c.fallback_in_band = o_.data_plane.automatic();
  c.local_weights = o_.local_weights;
  c.cfg = o_.cfg;
  c.kernels = o_.kernels;
  c.pool = o_.pool;
  metrics::AttentionMetrics* m = metrics_;
  c.on_event = [m](const std::string& shard, const std::string& event) {
    m->DataPlaneEvent(shard, event);
  };
  c.on_lanes = [m](const std::string& shard, const dataplane::Lanes& lanes,
                   const std::string& shard_lanes) {
    MOE_LOG_INFO("data plane to {}: lanes {} (the shard's side: {})", shard, lanes.Describe(),
                 shard_lanes);
    m->DataPlaneLanes(shard, lanes.kind, lanes.Describe(), shard_lanes);
  };
  channel = MakeExpertChannel(c, s);
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
