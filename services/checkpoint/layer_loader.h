// Loads one MoE layer's weights from a checkpoint into numerics::MoeLayerWeights: the dense
// part (copied, checked finite) and/or an expert range [lo, hi) (zero-copy views into the
// mapped shards, every E8M0 scale checked for 0xFF). Every tensor's dtype and shape is checked
// against docs/math.md section 2; errors name the tensor.
//
//   LoadOptions opt; opt.dense = false; opt.expert_lo = 0; opt.expert_hi = 448;
//   MOE_ASSIGN_OR_RETURN(MoeLayerWeights w, LoadMoeLayer(*ckpt, cfg, /*layer=*/1, opt));
#ifndef MOE_SERVICES_CHECKPOINT_LAYER_LOADER_H_
#define MOE_SERVICES_CHECKPOINT_LAYER_LOADER_H_

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "services/checkpoint/checkpoint.h"
#include "services/common/model_config.h"
#include "services/numerics/layer_weights.h"

namespace moe::checkpoint {

struct LoadOptions {
  bool dense = true;
  int64_t expert_lo = 0;
  int64_t expert_hi = -1;  // -1: all experts
  // After each expert: its bytes (MXFP4 packed + scales), read and checked.
  std::function<void(int64_t bytes)> on_expert_loaded;
};

absl::StatusOr<numerics::MoeLayerWeights> LoadMoeLayer(Checkpoint& ckpt, const ModelConfig& cfg,
                                                       int64_t layer, const LoadOptions& options);

}  // namespace moe::checkpoint

#endif  // MOE_SERVICES_CHECKPOINT_LAYER_LOADER_H_
