// expert-svc: hosts the routed experts [expert_lo, expert_hi) of one or more MoE layers as
// MXFP4 weights and runs the expert FFN (MXFP4 matmul + SiTU-GLU) on dispatched latent rows
// (ExpertService in proto/moe/v1/expert.proto).
//
// Requests arrive on long-lived Dispatch streams (callback API; reactions never block): each
// batch is validated on arrival and queued; one compute thread runs the batches in arrival
// order on the CPU backend's thread pool and hands the reply back to its stream. A bad batch is
// answered with its own code and message; the stream and the server keep serving.
// With a router endpoint, the server registers its ranges with router-svc and heartbeats.
//
//   ExpertServerOptions o; o.checkpoint = "out/mid"; o.expert_lo = 0; o.expert_hi = 64;
//   MOE_ASSIGN_OR_RETURN(auto server, ExpertServer::Start(o));
//   server->Wait();
#ifndef MOE_EXPERT_SVC_EXPERT_SERVER_H_
#define MOE_EXPERT_SVC_EXPERT_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "expert-svc/expert_options.h"

namespace moe::expert_svc {

class ExpertServer {
 public:
  static absl::StatusOr<std::unique_ptr<ExpertServer>> Start(const ExpertServerOptions& options);
  ~ExpertServer();

  int port() const;
  // Stops registration, fails queued batches with UNAVAILABLE, stops the server.
  void Shutdown(absl::Duration grace = absl::Seconds(2));
  void Wait();

  class Impl;

 private:
  explicit ExpertServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::expert_svc

#endif  // MOE_EXPERT_SVC_EXPERT_SERVER_H_
