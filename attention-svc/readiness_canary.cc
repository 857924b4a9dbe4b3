#include "attention-svc/readiness_canary.h"

#include "absl/strings/str_cat.h"
#include "services/checkpoint/synthetic.h"
#include "services/numerics/moe_layer.h"
#include "services/numerics/shared_expert.h"
#include "services/numerics/tolerance.h"
#include "services/transport/tensor_codec.h"

namespace moe::attention_svc {

CanaryOracle::CanaryOracle(const ModelConfig& cfg, const numerics::MoeLayerWeights* w,
                           int64_t tokens, uint64_t seed)
    : cfg_(cfg),
      w_(w),
      tokens_(tokens),
      x_(checkpoint::SyntheticHiddenStates(cfg, tokens, seed)),
      shared_(static_cast<size_t>(tokens * cfg.hidden)) {
  numerics::ref::SharedExpert(x_.data(), tokens, cfg.hidden, w->shared_gate.data(),
                              w->shared_up.data(), w->shared_down.data(), cfg.shared_intermediate(),
                              cfg.situ_beta, cfg.situ_linear_beta, shared_.data());
}

v1::ForwardRequest CanaryOracle::Request(int32_t layer) const {
  v1::ForwardRequest req;
  req.set_layer(layer);
  transport::EncodeBf16Into(x_, tokens_, cfg_.hidden, req.mutable_hidden_states());
  req.mutable_options()->set_reply_mode(v1::REPLY_MODE_PER_PAIR);
  req.mutable_options()->set_precision(v1::PRECISION_W4A16);
  return req;
}

absl::StatusOr<std::vector<tensor::Bf16>> CanaryOracle::Want(const BiasEntry& bias) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = want_.find(bias.version);
    if (it != want_.end()) return it->second;
  }
  auto out = numerics::ref::MoeLayerForward(cfg_, *w_, x_, tokens_, cfg_.hidden, bias.bias.data());
  if (!out.ok()) return out.status();
  std::lock_guard<std::mutex> lock(mu_);
  if (want_.size() >= 8) want_.clear();  // old versions: at most a few live at once
  return want_[bias.version] = std::move(out->out);
}

CanaryOutcome CanaryOracle::Judge(const v1::ForwardResponse& resp, const BiasEntry& bias,
                                  std::string* detail) {
  if (resp.bias_version() != bias.version) {
    *detail =
        absl::StrCat("served under bias version ", resp.bias_version(), ", not ", bias.version);
    return CanaryOutcome::kSkipped;
  }
  auto got = transport::DecodeBf16Matrix(resp.output(), "output", cfg_.hidden, false);
  if (!got.ok() || got->rows != tokens_) {
    *detail = got.ok() ? absl::StrCat(got->rows, " rows, not ", tokens_) : got.status().ToString();
    return CanaryOutcome::kError;
  }
  auto want = Want(bias);
  if (!want.ok()) {
    *detail = want.status().ToString();
    return CanaryOutcome::kError;
  }
  numerics::UlpStats stats;
  stats.AddRows(got->values.data(), want->data(), tokens_, cfg_.hidden, shared_.data());
  *detail = stats.Str();
  // The hard bound alone (tolerance.h): the suite's fractions are stated over its batches at its
  // shapes; at K3's the optimized layer itself fails them on a canary's 4 tokens.
  return stats.Within(numerics::HardBound(numerics::kLayerTolerance)) ? CanaryOutcome::kMatch
                                                                      : CanaryOutcome::kMismatch;
}

}  // namespace moe::attention_svc
