// RouterCore's membership operations (router_core.h): a registration bound to its member's
// identity and to the deployment's ranges, heartbeats on a live lease, the silent expired and
// the long silent removed.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <iterator>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "router-svc/router_core.h"
#include "router-svc/router_proto.h"
#include "services/common/logging.h"
#include "services/common/status_macros.h"
#include "services/metrics/service_metrics.h"
#include "services/numerics/dynamic_k.h"
#include "services/transport/security.h"

namespace moe::router_svc {

namespace {

constexpr size_t kMaxEndpointBytes = 256;

}  // namespace

absl::Status RouterCore::Register(const v1::RegisterExpertServerRequest& req,
                                  v1::RegisterExpertServerResponse* resp) {
  const std::vector<LayerRange> ranges = FromProto(req.ranges());
  const std::string data_plane = req.data_plane().empty() ? "grpc" : req.data_plane();
  MOE_RETURN_IF_ERROR(CheckShardName(req.shard()));
  if (req.endpoint().size() > kMaxEndpointBytes) {
    return absl::InvalidArgumentError(absl::StrCat("registration of ", req.shard(),
                                                   ": endpoint of ", req.endpoint().size(),
                                                   " bytes (at most ", kMaxEndpointBytes, ")"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  // One range per managed layer at most, each within what the deployment lets this shard serve.
  std::set<int32_t> seen;
  for (const LayerRange& r : ranges) {
    if (layers_.count(r.layer) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("registration of ", req.shard(), ": ",
                                                     UnknownLayerLocked(r.layer).message()));
    }
    if (!seen.insert(r.layer).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("registration of ", req.shard(), ": two ranges for layer ", r.layer));
    }
    if (allowance_ != nullptr) {
      absl::Status allowed = placement::CheckShardRange(*allowance_, req.shard(), {r.lo, r.hi});
      if (!allowed.ok()) {
        return absl::PermissionDeniedError(absl::StrCat(allowed.message(), " for layer ", r.layer));
      }
    }
  }
  MOE_ASSIGN_OR_RETURN(uint64_t lease, registry_->Register(req.shard(), req.endpoint(), ranges,
                                                           Clock::now(), data_plane));
  if (store_ != nullptr) {
    MOE_RETURN_IF_ERROR(store_->PutShard({req.shard(), req.endpoint(), data_plane, lease, ranges}));
  }
  resp->set_lease_id(lease);
  resp->set_heartbeat_interval_ms(options_.heartbeat_interval_ms);
  PublishPlacementLocked();
  MOE_LOG_INFO("shard {} registered at {}", req.shard(), req.endpoint());
  return absl::OkStatus();
}

absl::Status RouterCore::Heartbeat(const v1::HeartbeatRequest& req) {
  std::lock_guard<std::mutex> lock(mu_);
  MOE_ASSIGN_OR_RETURN(bool revived,
                       registry_->Heartbeat(req.lease_id(), Clock::now(), req.data_plane_lanes()));
  if (revived) PublishPlacementLocked();
  return absl::OkStatus();
}

void RouterCore::ExpireStale(std::chrono::milliseconds stale) {
  std::lock_guard<std::mutex> lock(mu_);
  const Clock::time_point now = Clock::now();
  const std::vector<std::string> expired = registry_->ExpireStale(now, stale);
  for (const std::string& name : expired) {
    MOE_LOG_WARN("shard {} missed its heartbeats, unhealthy", name);
  }
  // Long silent: gone from the placement, the page, errors and the store (a shard that comes
  // back registers again).
  const std::vector<std::string> gone =
      registry_->RemoveGone(now, std::chrono::seconds(options_.shard_expiry_seconds));
  for (const std::string& name : gone) {
    MOE_LOG_WARN("shard {} silent for {} s, its registration removed", name,
                 options_.shard_expiry_seconds);
    if (store_ != nullptr) {
      if (absl::Status s = store_->DeleteShard(name); !s.ok()) {
        MOE_LOG_ERROR("removing shard {} from the router state: {}", name, s.ToString());
      }
    }
  }
  if (!expired.empty() || !gone.empty()) PublishPlacementLocked();
}

absl::Status RouterCore::Quarantine(const v1::QuarantineShardRequest& req,
                                    const std::string& reporter,
                                    v1::QuarantineShardResponse* resp) {
  MOE_RETURN_IF_ERROR(CheckShardName(req.shard()));
  // The evidence is the reporter's words: kept short and printable (it reaches logs and the page).
  std::string evidence = req.evidence().substr(0, 1024);
  for (char& c : evidence) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
  }
  const std::string by = reporter.empty() ? "an attention member" : reporter;
  std::lock_guard<std::mutex> lock(mu_);
  absl::StatusOr<bool> fresh = registry_->Quarantine(
      req.shard(),
      absl::StrCat("wrong answers (layer ", req.layer(), ", reported by ", by, "): ", evidence));
  if (!fresh.ok()) {
    MOE_LOG_ERROR("shard {} reported answering wrong bytes by {}, not quarantined: {}", req.shard(),
                  by, fresh.status().ToString());
    return fresh.status();
  }
  resp->set_newly_quarantined(*fresh);
  if (*fresh) {
    MOE_LOG_ERROR(
        "shard {} at {} quarantined: {} caught it answering wrong bytes on layer {} ({} of its "
        "answers served since its last passed audit are suspect): {}",
        req.shard(), req.endpoint(), by, req.layer(), req.suspect_answers(), evidence);
    PublishPlacementLocked();
  }
  return absl::OkStatus();
}

bool RouterCore::Release(const std::string& shard) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!registry_->Release(shard)) return false;
  MOE_LOG_WARN("shard {}: quarantine lifted by an admin", shard);
  PublishPlacementLocked();
  return true;
}

absl::Status RouterCore::ReportNode(const v1::ReportNodeRequest& req) {
  MOE_RETURN_IF_ERROR(CheckShardName(req.node()));
  static const std::set<std::string> kOutcomes = {"match",   "mismatch", "timeout", "error",
                                                  "skipped", "busy",     "off",     "pending"};
  const int64_t counts[] = {req.audits_agree(),   req.audits_within_bound(),
                            req.audits_caught(),  req.audits_unresolved(),
                            req.audits_skipped(), req.canary_age_ms()};
  const bool counts_ok = std::all_of(std::begin(counts), std::end(counts),
                                     [](int64_t c) { return c >= 0 && c < (int64_t{1} << 53); });
  if (kOutcomes.count(req.canary_outcome()) == 0 || !counts_ok || req.quarantined_size() > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "node report from ", req.node(), ": canary outcome '", req.canary_outcome().substr(0, 32),
        "' (match, mismatch, timeout, error, skipped, busy, off, pending), counts >= 0, at "
        "most 64 "
        "quarantined shards"));
  }
  for (const std::string& q : req.quarantined()) MOE_RETURN_IF_ERROR(CheckShardName(q));
  const int64_t now = UnixMs();
  std::lock_guard<std::mutex> lock(mu_);
  if (nodes_.count(req.node()) == 0 && nodes_.size() >= kMaxNodes) {
    for (auto it = nodes_.begin(); it != nodes_.end();) {  // a minute silent: forgotten
      it = now - it->second.unix_ms > 60000 ? nodes_.erase(it) : std::next(it);
    }
    if (nodes_.size() >= kMaxNodes) {
      return absl::ResourceExhaustedError(absl::StrCat("node report from ", req.node(), ": ",
                                                       kMaxNodes, " nodes reported already"));
    }
  }
  nodes_[req.node()] = {req, now};
  return absl::OkStatus();
}

nlohmann::json RouterCore::NodesJsonLocked() const {
  const int64_t now = UnixMs();
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [name, n] : nodes_) {
    const v1::ReportNodeRequest& r = n.report;
    out.push_back(
        {{"node", name},
         {"canary", r.canary_outcome()},
         {"canary_ready", r.canary_ready()},
         {"canary_age_ms", r.canary_age_ms()},
         {"audits",
          {{"agree", r.audits_agree()},
           {"within_bound", r.audits_within_bound()},
           {"caught", r.audits_caught()},
           {"unresolved", r.audits_unresolved()},
           {"skipped", r.audits_skipped()}}},
         {"quarantined", std::vector<std::string>(r.quarantined().begin(), r.quarantined().end())},
         {"seen_ms_ago", std::max<int64_t>(0, now - n.unix_ms)}});
  }
  return out;
}

void RouterCore::PublishPlacementLocked() {
  if (sinks_.placement) sinks_.placement(ToProto(registry_->Snapshot(Clock::now())));
  metrics_->Shards(registry_->shards(), registry_->healthy_shards(),
                   registry_->quarantined_shards());
}

}  // namespace moe::router_svc
