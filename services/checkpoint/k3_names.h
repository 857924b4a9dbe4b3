// The K3 checkpoint's tensor names, dtypes and shapes for one MoE layer (docs/math.md section 2).
//
//   GateWeightName(3) == "language_model.model.layers.3.block_sparse_moe.gate.weight"
//   ExpertTensorName(3, 17, "w1", "weight_packed")
//     == "language_model.model.layers.3.block_sparse_moe.experts.17.w1.weight_packed"
#ifndef MOE_SERVICES_CHECKPOINT_K3_NAMES_H_
#define MOE_SERVICES_CHECKPOINT_K3_NAMES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "services/checkpoint/safetensors.h"
#include "services/common/model_config.h"

namespace moe::checkpoint {

std::string MoePrefix(int64_t layer);  // "language_model.model.layers.{L}.block_sparse_moe."
std::string GateWeightName(int64_t layer);
std::string GateBiasName(int64_t layer);
std::string DownProjName(int64_t layer);
std::string NormWeightName(int64_t layer);
std::string UpProjName(int64_t layer);
// proj: "gate_proj", "up_proj" or "down_proj".
std::string SharedExpertName(int64_t layer, absl::string_view proj);
// matrix: "w1" (gate), "w3" (up) or "w2" (down); part: "weight_packed" or "weight_scale".
std::string ExpertTensorName(int64_t layer, int64_t expert, absl::string_view matrix,
                             absl::string_view part);

// The eight dense tensors of a layer, with their dtypes and shapes.
std::vector<TensorSpec> DenseTensorSpecs(const ModelConfig& cfg, int64_t layer);
// The six tensors of one routed expert.
std::vector<TensorSpec> ExpertTensorSpecs(const ModelConfig& cfg, int64_t layer, int64_t expert);

}  // namespace moe::checkpoint

#endif  // MOE_SERVICES_CHECKPOINT_K3_NAMES_H_
