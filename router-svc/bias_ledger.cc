#include "router-svc/bias_ledger.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/k3_names.h"
#include "services/common/status_macros.h"

namespace moe::router_svc {

BiasLedger::BiasLedger(int32_t layer, std::vector<float> checkpoint_bias, BiasMode mode,
                       int64_t continuous_tokens, int64_t now_unix_ms, ExpertBudget budget)
    : layer_(layer), mode_(mode), continuous_tokens_(continuous_tokens) {
  history_.push_back(
      {layer, 0, mode, std::move(checkpoint_bias), "checkpoint", now_unix_ms, std::move(budget)});
}

BiasLedger::BiasLedger(int32_t layer, std::vector<BiasVersion> history, BiasMode mode,
                       int64_t continuous_tokens)
    : layer_(layer),
      mode_(mode),
      continuous_tokens_(continuous_tokens),
      history_(std::move(history)) {}

const BiasVersion& BiasLedger::Append(std::vector<float> bias, const std::string& reason,
                                      int64_t now_unix_ms) {
  ExpertBudget budget = current().budget;
  return Append(std::move(bias), std::move(budget), reason, now_unix_ms);
}

const BiasVersion& BiasLedger::Append(std::vector<float> bias, ExpertBudget budget,
                                      const std::string& reason, int64_t now_unix_ms) {
  history_.push_back(
      {layer_, history_.size(), mode_, std::move(bias), reason, now_unix_ms, std::move(budget)});
  return history_.back();
}

absl::StatusOr<const BiasVersion*> BiasLedger::Rollback(uint64_t to, int64_t now_unix_ms) {
  if (mode_ == BiasMode::kFrozen) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer_, " is frozen: SetBiasMode first"));
  }
  if (to >= history_.size()) {
    return absl::NotFoundError(absl::StrCat("layer ", layer_, " has no bias version ", to,
                                            " (newest ", current().version, ")"));
  }
  std::vector<float> bias = history_[to].bias;
  ExpertBudget budget = history_[to].budget;
  return &Append(std::move(bias), std::move(budget), absl::StrCat("rollback to ", to), now_unix_ms);
}

absl::StatusOr<bool> BiasLedger::SetMode(BiasMode mode, int64_t continuous_tokens,
                                         int64_t now_unix_ms) {
  if (continuous_tokens < 0) {
    return absl::InvalidArgumentError("continuous_tokens must be >= 0");
  }
  mode_ = mode;
  if (continuous_tokens > 0) continuous_tokens_ = continuous_tokens;
  if (mode == BiasMode::kFrozen && history_.front().bias != current().bias) {
    std::vector<float> bias = history_.front().bias;
    Append(std::move(bias), "frozen: checkpoint bias", now_unix_ms);
    return true;
  }
  history_.back().mode = mode_;
  return false;
}

absl::StatusOr<std::map<int32_t, std::vector<float>>> CheckpointBiases(
    const std::string& checkpoint, const std::vector<int64_t>& wanted, ModelConfig* cfg) {
  if (checkpoint.empty()) {
    return absl::InvalidArgumentError("router-svc needs --checkpoint (config and routing bias)");
  }
  MOE_ASSIGN_OR_RETURN(auto ckpt, checkpoint::Checkpoint::Open(checkpoint));
  MOE_ASSIGN_OR_RETURN(*cfg, ckpt->LoadConfig());
  std::vector<int64_t> layers = wanted;
  if (layers.empty()) {
    for (int64_t l : cfg->MoeLayers()) {
      if (ckpt->Contains(checkpoint::GateBiasName(l))) layers.push_back(l);
    }
  }
  if (layers.empty()) return absl::NotFoundError("the checkpoint holds no MoE layer's bias");
  std::map<int32_t, std::vector<float>> out;
  for (int64_t layer : layers) {
    if (!cfg->IsMoeLayer(layer)) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " is not a MoE layer"));
    }
    MOE_ASSIGN_OR_RETURN(checkpoint::TensorRef t, ckpt->Get(checkpoint::GateBiasName(layer)));
    if (t.data.size() != static_cast<size_t>(cfg->num_experts) * 4) {
      return absl::InvalidArgumentError(absl::StrCat(checkpoint::GateBiasName(layer), " has ",
                                                     t.data.size(), " bytes, expected ",
                                                     cfg->num_experts * 4));
    }
    std::vector<float> bias(static_cast<size_t>(cfg->num_experts));
    std::memcpy(bias.data(), t.data.data(), t.data.size());
    for (size_t j = 0; j < bias.size(); ++j) {
      if (!std::isfinite(bias[j])) {
        return absl::InvalidArgumentError(
            absl::StrCat(checkpoint::GateBiasName(layer), "[", j, "] is not finite"));
      }
    }
    out[static_cast<int32_t>(layer)] = std::move(bias);
  }
  return out;
}

}  // namespace moe::router_svc
