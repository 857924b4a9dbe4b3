// The Open Inference Protocol (KServe v2, `inference.GRPCInferenceService`) on attention-svc:
// one model per hosted MoE layer ("moe-layer-<L>"), over the same layer code as
// moe.v1.AttentionService.Forward (proto/inference/grpc_inference.proto).
//
//   input  "hidden_states"    BF16 or FP32 [T, H] (raw_input_contents, or fp32_contents)
//   output "output"           BF16 [T, H]
//          "expert_ids"       INT32 [T, k]   the routing (returned when asked, or when the
//          "routing_weights"  FP32 [T, k]    request names no outputs at all)
//   parameter "reply_mode" = "per_pair" | "partial_sum" (optional)
//
// ServerReady is true when every hosted layer's experts have a healthy shard; ModelReady the
// same for one layer. ModelInfer runs on the node's worker queue, never on a gRPC thread.
//
//   OipService oip(hooks);  // then register &oip next to the AttentionService
#ifndef MOE_ATTENTION_SVC_OIP_SERVICE_H_
#define MOE_ATTENTION_SVC_OIP_SERVICE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "inference/grpc_inference.grpc.pb.h"
#include "moe/v1/attention.pb.h"

namespace moe::attention_svc {

// The OIP model name of a layer, and back (NOT_FOUND for another name).
std::string OipModelName(int32_t layer);

class OipService final : public inference::GRPCInferenceService::CallbackService {
 public:
  struct Hooks {
    std::string server_name = "stable-latentmoe";
    std::string version;
    int64_t hidden = 0, top_k = 0, num_experts = 0, latent = 0;
    std::vector<int32_t> layers;
    std::string model;  // the config's name
    int64_t default_timeout_ms = 30000;
    // Runs one Forward (what AttentionService.Forward runs, metrics included).
    std::function<absl::Status(const v1::ForwardRequest&, absl::Time, v1::ForwardResponse*)>
        forward;
    // Queues work on the node's workers; false when the queue is full.
    std::function<bool(std::function<void()>)> submit;
    // Whether the layer's experts all have a healthy shard.
    std::function<bool(int32_t layer)> layer_ready;
    // A call refused before it reached forward (which counts its own): counted as an error of
    // `method` (moe_errors_total).
    std::function<void(const char* method, const absl::Status&)> on_error;
  };
  explicit OipService(Hooks hooks) : hooks_(std::move(hooks)) {}

  // The protocol's operations, shared by the gRPC service below and the REST front
  // (oip_rest.h).
  bool Ready() const;
  absl::StatusOr<bool> ModelIsReady(const std::string& name, const std::string& version) const;
  inference::ServerMetadataResponse Metadata() const;
  absl::StatusOr<inference::ModelMetadataResponse> ModelMeta(const std::string& name,
                                                             const std::string& version) const;
  // One inference on the node's workers: `done` runs on a worker with the status and the
  // response (refusals before the queue run it at once). `method` names the caller's front in
  // moe_errors_total ("ModelInfer", "http:infer").
  void Infer(std::shared_ptr<const inference::ModelInferRequest> req, absl::Time deadline,
             const char* method,
             std::function<void(const absl::Status&, inference::ModelInferResponse*)> done);
  // The statistics extension (Triton's model statistics): per hosted model, or one ("" all).
  absl::StatusOr<std::string> StatisticsJson(const std::string& name,
                                             const std::string& version) const;
  // The repository extension's index: every hosted model with its state (READY/UNAVAILABLE).
  std::string RepositoryIndexJson() const;
  // The extensions ServerMetadata announces.
  static std::vector<std::string> Extensions();
  // A request refused before Infer (the REST front's parse errors): counted in moe_errors_total.
  void CountRefusal(const char* method, const absl::Status& s) const {
    if (hooks_.on_error) hooks_.on_error(method, s);
  }

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* ctx,
                                       const inference::ServerLiveRequest* req,
                                       inference::ServerLiveResponse* resp) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* ctx,
                                        const inference::ServerReadyRequest* req,
                                        inference::ServerReadyResponse* resp) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* ctx,
                                       const inference::ModelReadyRequest* req,
                                       inference::ModelReadyResponse* resp) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* ctx,
                                           const inference::ServerMetadataRequest* req,
                                           inference::ServerMetadataResponse* resp) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* ctx,
                                          const inference::ModelMetadataRequest* req,
                                          inference::ModelMetadataResponse* resp) override;
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* ctx,
                                       const inference::ModelInferRequest* req,
                                       inference::ModelInferResponse* resp) override;

 private:
  // The layer of a model name and version ("" or "1"), or NOT_FOUND naming the hosted models.
  absl::StatusOr<int32_t> LayerOf(const std::string& name, const std::string& version) const;
  // ModelInferRequest -> ForwardRequest (INVALID_ARGUMENT naming what is wrong).
  absl::Status ToForward(const inference::ModelInferRequest& req, int32_t layer,
                         v1::ForwardRequest* out, std::vector<std::string>* outputs) const;

  // Per model (layer): the statistics extension's counters, durations in ns.
  struct Duration {
    int64_t count = 0, ns = 0;
  };
  struct ModelStats {
    Duration success, fail, queue, compute_input, compute_infer, compute_output;
    int64_t last_inference_ms = 0;
  };
  void Record(int32_t layer, bool ok, int64_t total_ns, int64_t queue_ns, int64_t input_ns,
              int64_t infer_ns, int64_t output_ns);

  const Hooks hooks_;
  mutable std::mutex stats_mu_;
  std::map<int32_t, ModelStats> stats_;  // guarded by stats_mu_
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_OIP_SERVICE_H_
