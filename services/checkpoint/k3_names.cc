#include "services/checkpoint/k3_names.h"

#include "absl/strings/str_cat.h"

namespace moe::checkpoint {

using tensor::DType;

std::string MoePrefix(int64_t layer) {
  return absl::StrCat("language_model.model.layers.", layer, ".block_sparse_moe.");
}
std::string GateWeightName(int64_t layer) { return MoePrefix(layer) + "gate.weight"; }
std::string GateBiasName(int64_t layer) {
  return MoePrefix(layer) + "gate.e_score_correction_bias";
}
std::string DownProjName(int64_t layer) {
  return MoePrefix(layer) + "routed_expert_down_proj.weight";
}
std::string NormWeightName(int64_t layer) { return MoePrefix(layer) + "routed_expert_norm.weight"; }
std::string UpProjName(int64_t layer) { return MoePrefix(layer) + "routed_expert_up_proj.weight"; }
std::string SharedExpertName(int64_t layer, absl::string_view proj) {
  return absl::StrCat(MoePrefix(layer), "shared_experts.", proj, ".weight");
}
std::string ExpertTensorName(int64_t layer, int64_t expert, absl::string_view matrix,
                             absl::string_view part) {
  return absl::StrCat(MoePrefix(layer), "experts.", expert, ".", matrix, ".", part);
}

std::vector<TensorSpec> DenseTensorSpecs(const ModelConfig& c, int64_t layer) {
  const int64_t h = c.hidden, d = c.latent, e = c.num_experts, s = c.shared_intermediate();
  return {
      {GateWeightName(layer), DType::kBF16, {e, h}},
      {GateBiasName(layer), DType::kF32, {e}},
      {DownProjName(layer), DType::kBF16, {d, h}},
      {NormWeightName(layer), DType::kBF16, {d}},
      {UpProjName(layer), DType::kBF16, {h, d}},
      {SharedExpertName(layer, "gate_proj"), DType::kBF16, {s, h}},
      {SharedExpertName(layer, "up_proj"), DType::kBF16, {s, h}},
      {SharedExpertName(layer, "down_proj"), DType::kBF16, {h, s}},
  };
}

std::vector<TensorSpec> ExpertTensorSpecs(const ModelConfig& c, int64_t layer, int64_t expert) {
  const int64_t d = c.latent, i = c.intermediate;
  std::vector<TensorSpec> specs;
  for (const char* m : {"w1", "w3", "w2"}) {
    const bool down = absl::string_view(m) == "w2";
    const int64_t rows = down ? d : i, cols = down ? i : d;
    specs.push_back(
        {ExpertTensorName(layer, expert, m, "weight_packed"), DType::kU8, {rows, cols / 2}});
    specs.push_back(
        {ExpertTensorName(layer, expert, m, "weight_scale"), DType::kU8, {rows, cols / 32}});
  }
  return specs;
}

}  // namespace moe::checkpoint
