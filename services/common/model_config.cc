#include "services/common/model_config.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "services/common/status_macros.h"

namespace moe {
namespace {

using Json = nlohmann::json;

ModelConfig MakePreset(const char* name, int64_t h, int64_t i, int64_t e, int64_t k,
                       int64_t layers) {
  ModelConfig c;
  c.name = name;
  c.hidden = h;
  c.latent = h / 2;
  c.intermediate = i;
  c.num_experts = e;
  c.top_k = k;
  c.num_shared_experts = 2;
  c.num_layers = layers;
  c.first_moe_layer = 1;
  return c;
}

absl::Status FieldError(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("config field ", field, ": ", what));
}

absl::StatusOr<int64_t> GetInt(const Json& obj, const char* field, bool required,
                               int64_t fallback) {
  auto it = obj.find(field);
  if (it == obj.end() || it->is_null()) {
    if (required) return FieldError(field, "missing");
    return fallback;
  }
  if (!it->is_number_integer() && !it->is_number_unsigned()) {
    return FieldError(field, absl::StrCat("must be an integer, got ", it->dump()));
  }
  return it->get<int64_t>();
}

absl::StatusOr<double> GetNumber(const Json& obj, const char* field, double fallback) {
  auto it = obj.find(field);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_number())
    return FieldError(field, absl::StrCat("must be a number, got ", it->dump()));
  return it->get<double>();
}

absl::StatusOr<bool> GetBool(const Json& obj, const char* field, bool fallback) {
  auto it = obj.find(field);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_boolean())
    return FieldError(field, absl::StrCat("must be a boolean, got ", it->dump()));
  return it->get<bool>();
}

absl::Status ExpectString(const Json& obj, const char* field, const char* expected) {
  auto it = obj.find(field);
  if (it == obj.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_string() || it->get<std::string>() != expected) {
    return FieldError(field,
                      absl::StrCat("only \"", expected, "\" is supported, got ", it->dump()));
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<int64_t> ModelConfig::MoeLayers() const {
  std::vector<int64_t> layers;
  for (int64_t l = first_moe_layer; l < num_layers; ++l) layers.push_back(l);
  return layers;
}

int64_t ModelConfig::ExpertBytes() const {
  // w1 and w3: [I, D] -> I*D/2 packed + I*D/32 scales; w2: [D, I] the same count.
  const int64_t per_matrix = intermediate * latent / 2 + intermediate * latent / 32;
  return 3 * per_matrix;
}

absl::Status ValidateConfig(const ModelConfig& c) {
  constexpr int64_t kMaxDim = int64_t{1} << 20;
  auto positive = [&](const char* field, int64_t v) -> absl::Status {
    if (v <= 0 || v > kMaxDim) {
      return FieldError(field, absl::StrCat("must be in [1, ", kMaxDim, "], got ", v));
    }
    return absl::OkStatus();
  };
  MOE_RETURN_IF_ERROR(positive("hidden_size", c.hidden));
  MOE_RETURN_IF_ERROR(positive("routed_expert_hidden_size", c.latent));
  MOE_RETURN_IF_ERROR(positive("moe_intermediate_size", c.intermediate));
  MOE_RETURN_IF_ERROR(positive("num_experts", c.num_experts));
  MOE_RETURN_IF_ERROR(positive("num_shared_experts", c.num_shared_experts));
  // MXFP4 blocks of 32 run along each expert matrix's reduction axis: D for w1/w3, I for w2.
  if (c.latent % 32 != 0) {
    return FieldError("routed_expert_hidden_size",
                      absl::StrCat("must be a multiple of 32 (MXFP4 block), got ", c.latent));
  }
  if (c.intermediate % 32 != 0) {
    return FieldError("moe_intermediate_size",
                      absl::StrCat("must be a multiple of 32 (MXFP4 block), got ", c.intermediate));
  }
  if (c.top_k < 1 || c.top_k >= c.num_experts) {
    return FieldError(
        "num_experts_per_token",
        absl::StrCat("must be in [1, num_experts = ", c.num_experts, "), got ", c.top_k));
  }
  if (!(c.rms_norm_eps > 0.0f) || !std::isfinite(c.rms_norm_eps)) {
    return FieldError("rms_norm_eps",
                      absl::StrCat("must be positive and finite, got ", c.rms_norm_eps));
  }
  if (!(c.routed_scaling_factor > 0.0f) || !std::isfinite(c.routed_scaling_factor)) {
    return FieldError("routed_scaling_factor",
                      absl::StrCat("must be positive and finite, got ", c.routed_scaling_factor));
  }
  if (!(c.situ_beta > 0.0f) || !std::isfinite(c.situ_beta)) {
    return FieldError("activation_situ_beta",
                      absl::StrCat("must be positive and finite, got ", c.situ_beta));
  }
  if (!(c.situ_linear_beta > 0.0f) || !std::isfinite(c.situ_linear_beta)) {
    return FieldError("activation_situ_linear_beta",
                      absl::StrCat("must be positive and finite, got ", c.situ_linear_beta));
  }
  if (c.num_layers < 1 || c.num_layers > 4096) {
    return FieldError("num_hidden_layers",
                      absl::StrCat("must be in [1, 4096], got ", c.num_layers));
  }
  if (c.first_moe_layer < 0 || c.first_moe_layer >= c.num_layers) {
    return FieldError("first_k_dense_replace",
                      absl::StrCat("must be in [0, num_hidden_layers = ", c.num_layers,
                                   ") so that at least one layer is MoE, got ", c.first_moe_layer));
  }
  return absl::OkStatus();
}

std::vector<std::string> PresetNames() { return {"k3", "mid", "tiny"}; }

absl::StatusOr<ModelConfig> PresetConfig(absl::string_view name) {
  if (name == "k3") return MakePreset("k3", 7168, 3072, 896, 16, 93);
  if (name == "mid") return MakePreset("mid", 1024, 448, 128, 8, 4);
  if (name == "tiny") return MakePreset("tiny", 128, 64, 16, 4, 3);
  return absl::InvalidArgumentError(
      absl::StrCat("unknown preset \"", name, "\"; known: ", absl::StrJoin(PresetNames(), ", ")));
}

absl::StatusOr<ModelConfig> ParseHfConfig(absl::string_view json_text) {
  Json root = Json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return absl::InvalidArgumentError("config.json is not valid JSON");
  if (!root.is_object()) return absl::InvalidArgumentError("config.json must be a JSON object");
  const Json* t = &root;
  auto tc = root.find("text_config");
  if (tc != root.end()) {
    if (!tc->is_object()) return FieldError("text_config", "must be an object");
    t = &*tc;
  }
  ModelConfig c;
  c.name = "config.json";
  auto preset = root.find("preset");  // written by ToHfConfigJson for synthetic checkpoints
  if (preset != root.end() && preset->is_string()) c.name = preset->get<std::string>();
  MOE_ASSIGN_OR_RETURN(c.hidden, GetInt(*t, "hidden_size", true, 0));
  MOE_ASSIGN_OR_RETURN(c.latent, GetInt(*t, "routed_expert_hidden_size", true, 0));
  MOE_ASSIGN_OR_RETURN(c.intermediate, GetInt(*t, "moe_intermediate_size", true, 0));
  MOE_ASSIGN_OR_RETURN(c.num_experts, GetInt(*t, "num_experts", true, 0));
  MOE_ASSIGN_OR_RETURN(c.top_k, GetInt(*t, "num_experts_per_token", true, 0));
  MOE_ASSIGN_OR_RETURN(c.num_shared_experts, GetInt(*t, "num_shared_experts", true, 0));
  MOE_ASSIGN_OR_RETURN(c.num_layers, GetInt(*t, "num_hidden_layers", true, 0));
  MOE_ASSIGN_OR_RETURN(c.first_moe_layer, GetInt(*t, "first_k_dense_replace", false, 0));
  MOE_ASSIGN_OR_RETURN(c.renormalize, GetBool(*t, "moe_renormalize", true));
  MOE_ASSIGN_OR_RETURN(double scale, GetNumber(*t, "routed_scaling_factor", 1.0));
  MOE_ASSIGN_OR_RETURN(double eps, GetNumber(*t, "rms_norm_eps", 1e-5));
  MOE_ASSIGN_OR_RETURN(double beta, GetNumber(*t, "activation_situ_beta", 4.0));
  MOE_ASSIGN_OR_RETURN(double lbeta, GetNumber(*t, "activation_situ_linear_beta", 25.0));
  c.routed_scaling_factor = static_cast<float>(scale);
  c.rms_norm_eps = static_cast<float>(eps);
  c.situ_beta = static_cast<float>(beta);
  c.situ_linear_beta = static_cast<float>(lbeta);
  MOE_RETURN_IF_ERROR(ExpectString(*t, "moe_router_activation_func", "sigmoid"));
  MOE_RETURN_IF_ERROR(ExpectString(*t, "hidden_act", "situ"));
  MOE_RETURN_IF_ERROR(ExpectString(*t, "topk_method", "noaux_tc"));
  // The combined latent is RMSNorm-ed before the up-projection (math.md); the variant without
  // it is not implemented, so it is refused rather than served with the norm.
  MOE_ASSIGN_OR_RETURN(bool use_norm, GetBool(*t, "latent_moe_use_norm", true));
  if (!use_norm) {
    return FieldError("latent_moe_use_norm",
                      "false (LatentMoE without the RMSNorm of the combined latent) is not "
                      "supported; must be true");
  }
  for (const char* field : {"num_expert_group", "topk_group", "n_group"}) {
    MOE_ASSIGN_OR_RETURN(int64_t groups, GetInt(*t, field, false, 1));
    if (groups != 1) {
      return FieldError(
          field, absl::StrCat("group-limited routing is not supported; must be 1, got ", groups));
    }
  }
  MOE_RETURN_IF_ERROR(ValidateConfig(c));
  return c;
}

absl::StatusOr<ModelConfig> LoadHfConfigFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open config file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  auto cfg = ParseHfConfig(ss.str());
  if (!cfg.ok()) {
    return absl::Status(cfg.status().code(), absl::StrCat(path, ": ", cfg.status().message()));
  }
  return cfg;
}

std::string ToHfConfigJson(const ModelConfig& c) {
  Json t = {
      {"model_type", "kimi_linear"},
      {"hidden_size", c.hidden},
      {"routed_expert_hidden_size", c.latent},
      {"moe_intermediate_size", c.intermediate},
      {"num_experts", c.num_experts},
      {"num_experts_per_token", c.top_k},
      {"num_shared_experts", c.num_shared_experts},
      {"moe_router_activation_func", "sigmoid"},
      {"topk_method", "noaux_tc"},
      {"moe_renormalize", c.renormalize},
      {"latent_moe_use_norm", true},
      {"routed_scaling_factor", c.routed_scaling_factor},
      {"num_expert_group", 1},
      {"topk_group", 1},
      {"rms_norm_eps", c.rms_norm_eps},
      {"hidden_act", "situ"},
      {"activation_situ_beta", c.situ_beta},
      {"activation_situ_linear_beta", c.situ_linear_beta},
      {"num_hidden_layers", c.num_layers},
      {"first_k_dense_replace", c.first_moe_layer},
  };
  Json root = {{"model_type", "kimi_linear"}, {"preset", c.name}, {"text_config", t}};
  return root.dump(2) + "\n";
}

absl::StatusOr<ModelConfig> ResolveConfig(absl::string_view preset_or_path) {
  for (const std::string& p : PresetNames()) {
    if (preset_or_path == p) return PresetConfig(p);
  }
  return LoadHfConfigFile(std::string(preset_or_path));
}

}  // namespace moe
