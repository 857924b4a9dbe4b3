// Synthetic K3-format checkpoints and hidden states, deterministic from a seed.
//
// Weight scales follow the shapes (std 1/sqrt(fan_in), so activations stay O(1) through the
// layer); expert matrices are drawn in fp32 and quantized to MXFP4 with the OCP rule. The
// router_skew knob makes some experts hot: expert e's gate row has std (1 + skew * p_e) /
// sqrt(H) with a per-expert popularity p_e in [0, 1) (cubed uniform: a few hot experts, a long
// cold tail), so its logits spread wider and it wins top-k more often for any input. skew 0 is
// balanced in expectation.
//
// Every tensor is generated from its own seed (seed, layer, tensor, expert), so the streaming
// writer and the in-memory layer produce identical bytes, in any order, on any thread.
//
//   SyntheticOptions opt; opt.seed = 7; opt.router_skew = 1.0;
//   MOE_RETURN_IF_ERROR(WriteSyntheticCheckpoint(cfg, "/tmp/ckpt", opt));
//   MoeLayerWeights w = SyntheticLayer(cfg, /*layer=*/1, opt);  // the same weights in memory
#ifndef MOE_SERVICES_CHECKPOINT_SYNTHETIC_H_
#define MOE_SERVICES_CHECKPOINT_SYNTHETIC_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "services/common/model_config.h"
#include "services/numerics/layer_weights.h"
#include "services/tensor/bf16.h"

namespace moe::checkpoint {

struct SyntheticOptions {
  uint64_t seed = 1;
  double router_skew = 0.0;
  std::vector<int64_t> layers;             // empty: the first MoE layer only
  int64_t shard_bytes = int64_t{4} << 30;  // experts are split into shards of about this
  bool single_file = false;                // model.safetensors, no index (small models)
  bool experts = true;  // false: the dense tensors only (what router-svc and attention-svc read)
  // Only the experts [expert_lo, expert_hi) of every layer (-1: to the last): what one expert
  // pod loads, so that a pod of a k3 deployment writes its range, not the whole 15.8 GB layer.
  int64_t expert_lo = 0;
  int64_t expert_hi = -1;
  int threads = 2;
  // Called from the writer threads after each expert (and the dense part): bytes written so
  // far of the total the checkpoint will have (common/progress.h reports it).
  std::function<void(int64_t written, int64_t total)> on_progress;
};

struct SyntheticReport {
  int64_t bytes = 0;
  int shards = 0;
  double seconds = 0;
};

// Writes config.json, the shards and (unless single_file) model.safetensors.index.json into dir
// (created if missing). Memory stays bounded by one expert per thread: tensors are streamed.
// Inside each shard the experts are stored in a shuffled order, as in the released checkpoint.
absl::Status WriteSyntheticCheckpoint(const ModelConfig& cfg, const std::string& dir,
                                      const SyntheticOptions& options,
                                      SyntheticReport* report = nullptr);

// The same layer in memory (owned buffers), for tests.
numerics::MoeLayerWeights SyntheticLayer(const ModelConfig& cfg, int64_t layer,
                                         const SyntheticOptions& options);
// Only the routed experts [lo, hi) of that layer (no dense part): what an expert server of that
// range holds, and, for one expert, an independent copy to check against.
numerics::MoeLayerWeights SyntheticExperts(const ModelConfig& cfg, int64_t layer, int64_t lo,
                                           int64_t hi, const SyntheticOptions& options);

// Per-expert popularity p_e in [0, 1) used by the router skew.
std::vector<float> ExpertPopularity(const ModelConfig& cfg, int64_t layer, uint64_t seed);

// Hidden states [tokens, H], approximately N(0, 1), rounded to bf16.
std::vector<tensor::Bf16> SyntheticHiddenStates(const ModelConfig& cfg, int64_t tokens,
                                                uint64_t seed);

}  // namespace moe::checkpoint

#endif  // MOE_SERVICES_CHECKPOINT_SYNTHETIC_H_
