// attention-svc: the attention instance of attention-FFN disaggregation for the MoE layer
// (AttentionService in proto/moe/v1/attention.proto). For each hosted layer it holds the
// full-width weights (router, latent projections, latent norm, shared experts) and runs
// docs/math.md section 4 with the routed experts remote:
//
//   route (current bias from router-svc) -> z = down(x) -> group (token, expert) pairs by the
//   shard that owns the expert -> dispatch to every shard concurrently on long-lived streams ->
//   gather -> combine (per-pair replies: ref::Combine, bit-exact with the in-process layer;
//   partial sums: add the shards' fp32 sums in ascending shard order) -> norm -> up -> + shared.
//
// The request's deadline (or default_timeout_ms) bounds the expert calls; a shard that is down
// or too slow yields UNAVAILABLE or DEADLINE_EXCEEDED naming it. Placement and bias come from
// router-svc watch streams; QB histograms and loads go back to it every report_interval_ms.
//
//   AttentionServerOptions o; o.checkpoint = "out/mid"; o.router = "127.0.0.1:5000";
//   MOE_ASSIGN_OR_RETURN(auto server, AttentionServer::Start(o));
#ifndef MOE_ATTENTION_SVC_ATTENTION_SERVER_H_
#define MOE_ATTENTION_SVC_ATTENTION_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention-svc/attention_options.h"

namespace moe::attention_svc {

class AttentionServer {
 public:
  static absl::StatusOr<std::unique_ptr<AttentionServer>> Start(
      const AttentionServerOptions& options);
  ~AttentionServer();

  int port() const;
  void Shutdown(absl::Duration grace = absl::Seconds(2));
  void Wait();

  class Impl;

 private:
  explicit AttentionServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_ATTENTION_SERVER_H_
