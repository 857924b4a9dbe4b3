// ModelConfig: the shapes and constants of one Stable LatentMoE layer (docs/math.md section 1).
//
// Three presets keep K3's structure (D = H/2, S = 2*I, sigmoid router, SiTU betas 4 and 25):
//   "k3"   the released Kimi K3 shapes exactly (H 7168, D 3584, I 3072, E 896, k 16)
//   "mid"  runs a layer in well under a second on two cores (H 1024, E 128, k 8)
//   "tiny" for unit tests (H 128, E 16, k 4)
// A real Hugging Face config.json is accepted too (its text_config fields, or top-level ones).
//
//   MOE_ASSIGN_OR_RETURN(ModelConfig cfg, PresetConfig("mid"));
//   MOE_ASSIGN_OR_RETURN(ModelConfig real, LoadHfConfigFile("ckpt/config.json"));
#ifndef MOE_SERVICES_COMMON_MODEL_CONFIG_H_
#define MOE_SERVICES_COMMON_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe {

struct ModelConfig {
  std::string name = "custom";
  int64_t hidden = 0;              // H, hidden_size
  int64_t latent = 0;              // D, routed_expert_hidden_size
  int64_t intermediate = 0;        // I, moe_intermediate_size
  int64_t num_experts = 0;         // E, num_experts
  int64_t top_k = 0;               // k, num_experts_per_token
  int64_t num_shared_experts = 0;  // merged into one MLP of width num_shared_experts * I
  bool renormalize = true;         // moe_renormalize
  float routed_scaling_factor = 1.0f;
  float rms_norm_eps = 1e-5f;
  float situ_beta = 4.0f;          // activation_situ_beta (gate factor)
  float situ_linear_beta = 25.0f;  // activation_situ_linear_beta (up factor)
  int64_t num_layers = 0;          // num_hidden_layers
  int64_t first_moe_layer = 1;     // first_k_dense_replace: layers [first, num_layers) are MoE

  int64_t shared_intermediate() const { return num_shared_experts * intermediate; }
  bool IsMoeLayer(int64_t layer) const { return layer >= first_moe_layer && layer < num_layers; }
  std::vector<int64_t> MoeLayers() const;
  // Bytes of one routed expert's MXFP4 weights (three matrices, packed nibbles + E8M0 scales).
  int64_t ExpertBytes() const;
};

// Checks ranges and the constraints the kernels rely on; the error names the offending field.
absl::Status ValidateConfig(const ModelConfig& cfg);

// "k3", "mid" or "tiny".
absl::StatusOr<ModelConfig> PresetConfig(absl::string_view name);
std::vector<std::string> PresetNames();

// Parses a Hugging Face config.json (model_type kimi_linear; fields under text_config or at the
// top level). Unsupported routing variants (softmax router, group-limited routing, another
// activation) are rejected with the field's name.
absl::StatusOr<ModelConfig> ParseHfConfig(absl::string_view json_text);
absl::StatusOr<ModelConfig> LoadHfConfigFile(const std::string& path);
// Writes the config as a config.json that ParseHfConfig reads back to the same values.
std::string ToHfConfigJson(const ModelConfig& cfg);

// "k3"/"mid"/"tiny" gives a preset; anything else is read as a path to a config.json.
absl::StatusOr<ModelConfig> ResolveConfig(absl::string_view preset_or_path);

}  // namespace moe

#endif  // MOE_SERVICES_COMMON_MODEL_CONFIG_H_
