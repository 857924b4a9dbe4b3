// The whole Stable LatentMoE layer x[T, H] -> out[T, H] in process, scalar reference, with the
// rounding points of docs/math.md section 4. The stages are public so that the disaggregated path
// (attention node: route, down, combine, finish; expert server: experts) runs the same code.
//
//   MOE_ASSIGN_OR_RETURN(LayerOutput y, ref::MoeLayerForward(cfg, weights, x, tokens, width));
//   // y.out: [T, H] bf16; y.routing: expert ids and weights per token
#ifndef MOE_SERVICES_NUMERICS_MOE_LAYER_H_
#define MOE_SERVICES_NUMERICS_MOE_LAYER_H_

#include <chrono>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "services/common/model_config.h"
#include "services/numerics/layer_weights.h"
#include "services/numerics/precision_mode.h"
#include "services/numerics/router.h"
#include "services/tensor/bf16.h"

namespace moe::numerics {

struct BudgetRule;  // dynamic_k.h

struct LayerOutput {
  std::vector<tensor::Bf16> out;  // [T, H]
  Routing routing;
};

// Wall time of each stage of one forward, in seconds.
struct LayerTimings {
  double router = 0, down_proj = 0, experts = 0, combine_norm = 0, up_proj = 0, shared = 0;
  double Total() const { return router + down_proj + experts + combine_norm + up_proj + shared; }
};

// Adds the wall time of its scope to one field of `timings` (nothing when it is null).
//   { StageTimer t(timings, &LayerTimings::router); ... }
class StageTimer {
 public:
  StageTimer(LayerTimings* timings, double LayerTimings::*field);
  ~StageTimer();
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;

 private:
  double* sink_;
  std::chrono::steady_clock::time_point start_;
};

// Checks x before any math: tokens >= 1, x.size() == tokens * width, width == H, every value
// finite. The message says which token and column is bad.
absl::Status ValidateHiddenStates(const ModelConfig& cfg, absl::Span<const tensor::Bf16> x,
                                  int64_t tokens, int64_t width);
// Checks that the weights have the shapes of cfg: the dense part if need_dense, and every
// expert [lo, hi) if need_experts.
absl::Status ValidateLayerWeights(const ModelConfig& cfg, const MoeLayerWeights& w, bool need_dense,
                                  bool need_experts);

namespace ref {

// Step 1. bias overrides the checkpoint's bias when not null ([E], fp32).
Routing Route(const ModelConfig& cfg, const MoeLayerWeights& w, const tensor::Bf16* x,
              int64_t tokens, const float* bias);
// Step 2: z = bf16(x . W_down^T) -> [T, D].
std::vector<tensor::Bf16> LatentDown(const ModelConfig& cfg, const MoeLayerWeights& w,
                                     const tensor::Bf16* x, int64_t tokens);
// Step 3 for every (token, slot): y: [T, k, D] in routing's slot order. Groups tokens by expert
// so that each expert's weights are dequantized once per batch. Every routed expert must be
// hosted by w.
std::vector<tensor::Bf16> RunExperts(const ModelConfig& cfg, const MoeLayerWeights& w,
                                     const Routing& routing, const tensor::Bf16* z,
                                     Precision precision = Precision::kW4A16,
                                     W4A8H h_order = W4A8H::kFromFp32);
// Steps 5 to 8 from the combined latent r: [T, D] -> out: [T, H].
std::vector<tensor::Bf16> FinishLayer(const ModelConfig& cfg, const MoeLayerWeights& w,
                                      const tensor::Bf16* x, int64_t tokens, const tensor::Bf16* r,
                                      LayerTimings* timings);

// Steps 1 to 8. Validates x and the weights first; needs the dense part and all E experts.
// budget: dynamic k's rule (dynamic_k.h) after the top-k; null: every token keeps k.
absl::StatusOr<LayerOutput> MoeLayerForward(const ModelConfig& cfg, const MoeLayerWeights& w,
                                            absl::Span<const tensor::Bf16> x, int64_t tokens,
                                            int64_t width, const float* bias = nullptr,
                                            LayerTimings* timings = nullptr,
                                            Precision precision = Precision::kW4A16,
                                            const BudgetRule* budget = nullptr,
                                            W4A8H h_order = W4A8H::kFromFp32);

}  // namespace ref
}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_MOE_LAYER_H_
