// The C++ client SDK of the MoE cluster: Forward through attention-svc (blocking and
// streaming), load statistics, Rebalance and bias control through router-svc. One channel per
// endpoint, reused by every call; every call carries a deadline (options.timeout unless given).
//
//   ClientOptions o; o.attention = "127.0.0.1:7001"; o.router = "127.0.0.1:7000";
//   MOE_ASSIGN_OR_RETURN(auto client, MoeClient::Create(o));
//   MOE_ASSIGN_OR_RETURN(ForwardResult y, client->Forward(1, x, tokens, hidden));
//   MOE_ASSIGN_OR_RETURN(v1::RebalanceResponse r, client->Rebalance(1, /*dry_run=*/false));
#ifndef MOE_SERVICES_CLIENT_MOE_CLIENT_H_
#define MOE_SERVICES_CLIENT_MOE_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "moe/v1/attention.pb.h"
#include "moe/v1/router.pb.h"
#include "services/tensor/bf16.h"
#include "services/transport/security.h"

namespace moe::client {

struct ClientOptions {
  std::string attention;  // attention-svc host:port (Forward)
  std::string router;     // router-svc host:port (stats, rebalance)
  absl::Duration timeout = absl::Seconds(30);
  std::string admin_token;  // sent as x-moe-admin-token on admin calls
  int max_message_bytes = 256 << 20;
  // TLS to both (transport/security.h); no CA file: the process's credentials (plaintext unless
  // ConfigureProcessTls was called).
  transport::TlsOptions tls;
};

struct ForwardOptions {
  bool return_routing = false;
  v1::ReplyMode reply_mode = v1::REPLY_MODE_UNSPECIFIED;
  absl::Duration timeout = absl::ZeroDuration();  // zero: ClientOptions::timeout
  // FAIL (the default) or DEGRADE when an expert has no healthy replica (attention.proto).
  v1::MissingExperts missing_experts = v1::MISSING_EXPERTS_UNSPECIFIED;
  // W4A16 or W4A8 (MXFP8 expert inputs); UNSPECIFIED: the server's --precision.
  v1::Precision precision = v1::PRECISION_UNSPECIFIED;
  // Dynamic k: at most this expert budget (experts per token on average); 0: the layer's.
  int32_t expert_budget = 0;
  // Dynamic k's second mode: keep the experts whose share of the routing weight reaches this.
  double expert_top_p = 0;
};

struct ForwardResult {
  int64_t tokens = 0;
  int64_t width = 0;
  std::vector<tensor::Bf16> out;    // [T, H]
  std::vector<int32_t> expert_ids;  // [T, k] when asked
  std::vector<float> weights;       // [T, k] when asked
  int64_t top_k = 0;
  uint64_t bias_version = 0;
  v1::StageSeconds seconds;
  int64_t dispatch_bytes_sent = 0, dispatch_bytes_received = 0;
  std::vector<int32_t> missing_experts;  // DEGRADE: the skipped experts
  int64_t degraded_pairs = 0;
  v1::Precision precision = v1::PRECISION_W4A16;  // the precision that produced out
  int32_t expert_budget = 0;                      // the budget that produced out (top-k: none)
  int64_t routed_pairs = 0;                       // (token, expert) pairs computed
  double routing_mass_kept = 1.0;  // ForwardResponse.routing_mass_kept: the budget's kept weight
};

// Many Forward batches on one stream; responses may come back in any order.
class ForwardStream {
 public:
  virtual ~ForwardStream() = default;
  // Returns the request id.
  virtual absl::StatusOr<uint64_t> Send(int32_t layer, absl::Span<const tensor::Bf16> x,
                                        int64_t tokens, int64_t width,
                                        const ForwardOptions& options = {}) = 0;
  // The next response: its request id and its own status (a failed batch does not end the
  // stream). NOT_FOUND-free end of stream is reported as OUT_OF_RANGE.
  virtual absl::StatusOr<std::pair<uint64_t, absl::StatusOr<ForwardResult>>> Receive() = 0;
  // No more sends; then Receive until OUT_OF_RANGE.
  virtual absl::Status CloseSend() = 0;
};

class MoeClient {
 public:
  static absl::StatusOr<std::unique_ptr<MoeClient>> Create(const ClientOptions& options);
  virtual ~MoeClient() = default;

  virtual absl::StatusOr<ForwardResult> Forward(int32_t layer, absl::Span<const tensor::Bf16> x,
                                                int64_t tokens, int64_t width,
                                                const ForwardOptions& options = {}) = 0;
  // x as fp32 (sent as F32; the server rounds to bf16).
  virtual absl::StatusOr<ForwardResult> ForwardF32(int32_t layer, absl::Span<const float> x,
                                                   int64_t tokens, int64_t width,
                                                   const ForwardOptions& options = {}) = 0;
  // The stream's deadline is `timeout` from now.
  virtual absl::StatusOr<std::unique_ptr<ForwardStream>> OpenForwardStream(
      absl::Duration timeout) = 0;

  virtual absl::StatusOr<v1::LoadStats> GetLoadStats(int32_t layer) = 0;
  virtual absl::StatusOr<v1::RebalanceResponse> Rebalance(int32_t layer, bool dry_run) = 0;
  virtual absl::StatusOr<v1::LayerBias> RollbackBias(int32_t layer, uint64_t to_version) = 0;
  virtual absl::StatusOr<v1::LayerBias> SetBiasMode(int32_t layer, v1::BiasMode mode,
                                                    int64_t continuous_tokens = 0) = 0;
  // Dynamic k: the layer's expert budget (1..k; k: none) as a new version (admin).
  virtual absl::StatusOr<v1::LayerBias> SetExpertBudget(int32_t layer, int32_t k_avg) = 0;
  virtual absl::StatusOr<v1::LayerBias> GetBias(int32_t layer) = 0;
  virtual absl::StatusOr<v1::Placement> GetPlacement() = 0;
  // Lifts the quarantine of a shard caught answering wrong bytes (admin): whether it had one.
  virtual absl::StatusOr<bool> ReleaseShard(const std::string& shard) = 0;
  // grpc.health.v1 status of the attention node ("" service): true when SERVING.
  virtual absl::StatusOr<bool> AttentionServing() = 0;
  // What the attention node serves: widths, layers, dtypes, modes, the shards.
  virtual absl::StatusOr<v1::ModelInfo> GetModelInfo() = 0;
};

}  // namespace moe::client

#endif  // MOE_SERVICES_CLIENT_MOE_CLIENT_H_
