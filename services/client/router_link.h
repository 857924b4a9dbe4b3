// The servers' one control-plane client of router-svc. Expert servers stay registered (register,
// heartbeat at the interval the router asks for, register again when the router no longer
// knows the lease, as after a router restart); attention nodes watch the placement and the
// bias (each watch on its own thread, reopened after a break) and report their statistics.
// Every unary call has a deadline; Stop() cancels the watches and joins every thread.
//
//   RouterLink link("127.0.0.1:7000");
//   link.WatchPlacement([&](const v1::Placement& p) { ApplyPlacement(p); });
//   link.KeepRegistered(registration, [&] { return queued(); });  // on an expert server
//   link.Stop();
#ifndef MOE_SERVICES_CLIENT_ROUTER_LINK_H_
#define MOE_SERVICES_CLIENT_ROUTER_LINK_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "moe/v1/router.grpc.pb.h"

namespace moe::client {

// How the link paces itself.
struct RouterLinkTimings {
  absl::Duration call_timeout = absl::Seconds(2);              // every unary call
  absl::Duration reconnect_delay = absl::Milliseconds(200);    // a broken watch, a failed register
  absl::Duration default_heartbeat = absl::Milliseconds(500);  // until the router says otherwise
};

class RouterLink {
 public:
  // cluster_token: sent as x-moe-cluster-token on registration, heartbeats and reports (the
  // router refuses them without it).
  explicit RouterLink(const std::string& router, RouterLinkTimings timings = {},
                      std::string cluster_token = "");
  ~RouterLink();  // Stop()
  RouterLink(const RouterLink&) = delete;
  RouterLink& operator=(const RouterLink&) = delete;

  // Attention nodes. Each callback runs on the watch's thread, for every message.
  void WatchPlacement(std::function<void(const v1::Placement&)> on_placement);
  void WatchBias(std::vector<int32_t> layers, std::function<void(const v1::LayerBias&)> on_bias);
  absl::StatusOr<v1::ReportStatsResponse> ReportStats(const v1::ReportStatsRequest& req);
  // A shard caught answering wrong bytes (twin_audit.h), for router-svc to quarantine.
  absl::StatusOr<v1::QuarantineShardResponse> QuarantineShard(
      const v1::QuarantineShardRequest& req);
  // The attention node's own state (canary, twin audits) for the page.
  absl::Status ReportNode(const v1::ReportNodeRequest& req);

  // Expert servers: registers `req` and heartbeats on a thread until Stop(); queued() gives the
  // queue length each heartbeat carries.
  // lanes(), when given, is sent with each heartbeat (the data plane's lanes, for the page).
  // refused(), when given, hears each refused registration (it is retried), e.g. ALREADY_EXISTS
  // while an earlier process's lease of the same name lives, or PERMISSION_DENIED, and each
  // heartbeat refused for anything but an unreachable router (e.g. INVALID_ARGUMENT: the lease
  // lapses unless a later one passes).
  void KeepRegistered(v1::RegisterExpertServerRequest req, std::function<int64_t()> queued,
                      std::function<std::string()> lanes = nullptr,
                      std::function<void(const absl::Status&)> refused = nullptr);
  // The lease of the current registration (0 while unregistered).
  uint64_t lease() const;

  void Stop();

 private:
  template <typename Resp, typename Call>
  absl::StatusOr<Resp> Unary(Call call);
  template <typename Msg, typename OpenFn, typename ApplyFn>
  void WatchLoop(OpenFn open, ApplyFn apply);
  // Waits d; false when stopping.
  bool Sleep(absl::Duration d);

  const RouterLinkTimings timings_;
  std::unique_ptr<v1::RouterService::Stub> stub_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::set<grpc::ClientContext*> open_watches_ ABSL_GUARDED_BY(mu_);
  uint64_t lease_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> threads_;
  const std::string cluster_token_;
};

}  // namespace moe::client

#endif  // MOE_SERVICES_CLIENT_ROUTER_LINK_H_
