#include "services/common/model_config.h"

#include <string>

#include "gtest/gtest.h"

namespace moe {
namespace {

TEST(ModelConfig, K3PresetMatchesSpecSectionOne) {
  const ModelConfig c = *PresetConfig("k3");
  EXPECT_EQ(c.hidden, 7168);
  EXPECT_EQ(c.latent, 3584);
  EXPECT_EQ(c.intermediate, 3072);
  EXPECT_EQ(c.num_experts, 896);
  EXPECT_EQ(c.top_k, 16);
  EXPECT_EQ(c.shared_intermediate(), 6144);
  EXPECT_EQ(c.num_layers, 93);
  EXPECT_EQ(c.first_moe_layer, 1);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f);
  EXPECT_FLOAT_EQ(c.situ_beta, 4.0f);
  EXPECT_FLOAT_EQ(c.situ_linear_beta, 25.0f);
  EXPECT_TRUE(c.renormalize);
  EXPECT_EQ(c.ExpertBytes(), 17547264);  // docs/math.md section 3
  EXPECT_EQ(c.MoeLayers().size(), 92u);
}

TEST(ModelConfig, SmallPresetsKeepTheStructure) {
  for (const char* name : {"mid", "tiny"}) {
    const ModelConfig c = *PresetConfig(name);
    EXPECT_TRUE(ValidateConfig(c).ok()) << name;
    EXPECT_EQ(c.latent * 2, c.hidden) << name;
    EXPECT_EQ(c.shared_intermediate(), 2 * c.intermediate) << name;
  }
  EXPECT_EQ(PresetConfig("mid")->num_experts, 128);
  EXPECT_EQ(PresetConfig("mid")->top_k, 8);
  EXPECT_FALSE(PresetConfig("huge").ok());
}

TEST(ModelConfig, HfConfigRoundTrips) {
  const ModelConfig k3 = *PresetConfig("k3");
  const auto back = ParseHfConfig(ToHfConfigJson(k3));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->hidden, k3.hidden);
  EXPECT_EQ(back->latent, k3.latent);
  EXPECT_EQ(back->intermediate, k3.intermediate);
  EXPECT_EQ(back->num_experts, k3.num_experts);
  EXPECT_EQ(back->top_k, k3.top_k);
  EXPECT_EQ(back->num_shared_experts, 2);
  EXPECT_EQ(back->name, "k3");
}

TEST(ModelConfig, AcceptsARealStyleConfigJson) {
  const char* json = R"({
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "text_config": {
      "model_type": "kimi_linear", "hidden_size": 7168, "routed_expert_hidden_size": 3584,
      "moe_intermediate_size": 3072, "num_experts": 896, "num_experts_per_token": 16,
      "num_shared_experts": 2, "moe_router_activation_func": "sigmoid",
      "topk_method": "noaux_tc", "moe_renormalize": true, "routed_scaling_factor": 1.0,
      "num_expert_group": 1, "topk_group": 1, "rms_norm_eps": 1e-05, "hidden_act": "situ",
      "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
      "num_hidden_layers": 93, "first_k_dense_replace": 1, "vocab_size": 163840
    }})";
  const auto c = ParseHfConfig(json);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->ExpertBytes(), 17547264);
}

// Each case: a text_config body and a word the error must contain (the field's name).
struct BadConfig {
  std::string body;
  std::string field;
};
void PrintTo(const BadConfig& c, std::ostream* os) { *os << c.field; }

class ModelConfigRejects : public ::testing::TestWithParam<BadConfig> {};

TEST_P(ModelConfigRejects, NamingTheField) {
  const std::string base =
      R"("hidden_size": 128, "routed_expert_hidden_size": 64, "moe_intermediate_size": 64,
         "num_experts": 16, "num_experts_per_token": 4, "num_shared_experts": 2,
         "num_hidden_layers": 3, "first_k_dense_replace": 1)";
  const std::string json = "{\"text_config\": {" + base + GetParam().body + "}}";
  const auto c = ParseHfConfig(json);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(c.status().message()).find(GetParam().field), std::string::npos)
      << c.status();
}

INSTANTIATE_TEST_SUITE_P(
    Fields, ModelConfigRejects,
    ::testing::Values(
        BadConfig{R"(, "num_experts_per_token": 16)", "num_experts_per_token"},
        BadConfig{R"(, "num_experts_per_token": 0)", "num_experts_per_token"},
        BadConfig{R"(, "routed_expert_hidden_size": 48)", "routed_expert_hidden_size"},
        BadConfig{R"(, "moe_intermediate_size": 100)", "moe_intermediate_size"},
        BadConfig{R"(, "hidden_size": -1)", "hidden_size"},
        BadConfig{R"(, "hidden_size": "128")", "hidden_size"},
        BadConfig{R"(, "moe_router_activation_func": "softmax")", "moe_router_activation_func"},
        BadConfig{R"(, "hidden_act": "silu")", "hidden_act"},
        BadConfig{R"(, "topk_group": 4)", "topk_group"},
        BadConfig{R"(, "rms_norm_eps": 0)", "rms_norm_eps"},
        BadConfig{R"(, "first_k_dense_replace": 3)", "first_k_dense_replace"},
        BadConfig{R"(, "moe_renormalize": 1)", "moe_renormalize"},
        // The LatentMoE variant without the latent's RMSNorm is not served with the norm.
        BadConfig{R"(, "latent_moe_use_norm": false)", "latent_moe_use_norm"},
        BadConfig{R"(, "latent_moe_use_norm": "yes")", "latent_moe_use_norm"}));

TEST(ModelConfig, MissingFieldAndBadJsonAreClear) {
  auto missing = ParseHfConfig(R"({"text_config": {"hidden_size": 128}})");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(std::string(missing.status().message()).find("routed_expert_hidden_size"),
            std::string::npos);
  EXPECT_FALSE(ParseHfConfig("{not json").ok());
  EXPECT_FALSE(ParseHfConfig("[1, 2]").ok());
  EXPECT_FALSE(LoadHfConfigFile("/nonexistent/config.json").ok());
}

}  // namespace
}  // namespace moe
