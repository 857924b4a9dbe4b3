#include "services/numerics/moe_layer.h"

#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/numerics/combine.h"
#include "services/numerics/dynamic_k.h"
#include "services/numerics/expert_ffn.h"
#include "services/numerics/linear.h"
#include "services/numerics/precision_mode.h"
#include "services/numerics/rms_norm.h"
#include "services/numerics/shared_expert.h"

namespace moe::numerics {

using tensor::Bf16;

namespace {

absl::Status CheckSize(const char* tensor, size_t got, int64_t want) {
  if (static_cast<int64_t>(got) != want) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer weights: ", tensor, " has ", got, " elements, config needs ", want));
  }
  return absl::OkStatus();
}

absl::Status CheckMxfp4(int64_t expert, const char* name, const Mxfp4Matrix& m, int64_t rows,
                        int64_t cols) {
  if (m.rows != rows || m.cols != cols || m.packed == nullptr || m.scales == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("layer weights: expert ", expert, " ", name,
                                                      " is [", m.rows, ", ", m.cols,
                                                      "], config needs [", rows, ", ", cols, "]"));
  }
  return absl::OkStatus();
}

}  // namespace

StageTimer::StageTimer(LayerTimings* timings, double LayerTimings::*field)
    : sink_(timings == nullptr ? nullptr : &(timings->*field)),
      start_(std::chrono::steady_clock::now()) {}

StageTimer::~StageTimer() {
  if (sink_ != nullptr) {
    *sink_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
}

absl::Status ValidateHiddenStates(const ModelConfig& cfg, absl::Span<const Bf16> x, int64_t tokens,
                                  int64_t width) {
  if (tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden states have ", tokens, " tokens; a forward needs at least one"));
  }
  if (width != cfg.hidden) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hidden states are ", width, " wide; this layer takes hidden_size ", cfg.hidden));
  }
  if (static_cast<int64_t>(x.size()) != tokens * width) {
    return absl::InvalidArgumentError(absl::StrCat("hidden states hold ", x.size(), " values; [",
                                                   tokens, ", ", width, "] needs ",
                                                   tokens * width));
  }
  for (size_t i = 0; i < x.size(); ++i) {
    const float v = x[i].ToFloat();
    if (!std::isfinite(v)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "hidden states hold ", std::isnan(v) ? "NaN" : "Inf", " at token ",
          static_cast<int64_t>(i) / width, ", column ", static_cast<int64_t>(i) % width));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateLayerWeights(const ModelConfig& cfg, const MoeLayerWeights& w, bool need_dense,
                                  bool need_experts) {
  const int64_t h = cfg.hidden, d = cfg.latent, e = cfg.num_experts, s = cfg.shared_intermediate();
  if (need_dense) {
    if (!w.has_dense) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", w.layer,
                       ": the dense weights (router, projections, shared "
                       "experts) are not loaded"));
    }
    MOE_RETURN_IF_ERROR(CheckSize("gate.weight", w.gate.size(), e * h));
    MOE_RETURN_IF_ERROR(CheckSize("gate.e_score_correction_bias", w.bias.size(), e));
    MOE_RETURN_IF_ERROR(CheckSize("routed_expert_down_proj.weight", w.down_proj.size(), d * h));
    MOE_RETURN_IF_ERROR(CheckSize("routed_expert_norm.weight", w.norm.size(), d));
    MOE_RETURN_IF_ERROR(CheckSize("routed_expert_up_proj.weight", w.up_proj.size(), h * d));
    MOE_RETURN_IF_ERROR(CheckSize("shared_experts.gate_proj.weight", w.shared_gate.size(), s * h));
    MOE_RETURN_IF_ERROR(CheckSize("shared_experts.up_proj.weight", w.shared_up.size(), s * h));
    MOE_RETURN_IF_ERROR(CheckSize("shared_experts.down_proj.weight", w.shared_down.size(), h * s));
  }
  if (need_experts) {
    if (w.expert_lo != 0 || w.expert_hi != e) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", w.layer, ": experts [", w.expert_lo, ", ", w.expert_hi,
                       ") are loaded; the in-process layer needs all [0, ", e, ")"));
    }
  }
  if (static_cast<int64_t>(w.experts.size()) != w.expert_hi - w.expert_lo) {
    return absl::FailedPreconditionError(absl::StrCat("layer ", w.layer, ": ", w.experts.size(),
                                                      " experts loaded for the range [",
                                                      w.expert_lo, ", ", w.expert_hi, ")"));
  }
  for (int64_t id = w.expert_lo; id < w.expert_hi; ++id) {
    const ExpertWeights& x = *w.Expert(id);
    MOE_RETURN_IF_ERROR(CheckMxfp4(id, "w1", x.w1, cfg.intermediate, d));
    MOE_RETURN_IF_ERROR(CheckMxfp4(id, "w3", x.w3, cfg.intermediate, d));
    MOE_RETURN_IF_ERROR(CheckMxfp4(id, "w2", x.w2, d, cfg.intermediate));
  }
  return absl::OkStatus();
}

namespace ref {

Routing Route(const ModelConfig& cfg, const MoeLayerWeights& w, const Bf16* x, int64_t tokens,
              const float* bias) {
  std::vector<float> scores(static_cast<size_t>(tokens * cfg.num_experts));
  RouterScores(x, tokens, cfg.hidden, w.gate.data(), cfg.num_experts, scores.data());
  return SelectExperts(scores.data(), bias != nullptr ? bias : w.bias.data(), tokens,
                       cfg.num_experts, cfg.top_k, cfg.renormalize, cfg.routed_scaling_factor);
}

std::vector<Bf16> LatentDown(const ModelConfig& cfg, const MoeLayerWeights& w, const Bf16* x,
                             int64_t tokens) {
  std::vector<Bf16> z(static_cast<size_t>(tokens * cfg.latent));
  LinearBf16(x, tokens, cfg.hidden, w.down_proj.data(), cfg.latent, z.data());
  return z;
}

std::vector<Bf16> RunExperts(const ModelConfig& cfg, const MoeLayerWeights& w,
                             const Routing& routing, const Bf16* z, Precision precision,
                             W4A8H h_order) {
  const int64_t d = cfg.latent, k = routing.top_k;
  std::vector<Bf16> y(static_cast<size_t>(routing.tokens * k * d));
  const std::vector<std::vector<int64_t>> pairs = PairsByExpert(routing, cfg.num_experts);
  std::vector<Bf16> zin, yout;
  for (int64_t e = 0; e < cfg.num_experts; ++e) {
    const std::vector<int64_t>& list = pairs[e];
    if (list.empty()) continue;
    const int64_t n = static_cast<int64_t>(list.size());
    zin.resize(static_cast<size_t>(n * d));
    yout.resize(static_cast<size_t>(n * d));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t token = list[i] / k;
      std::copy(z + token * d, z + (token + 1) * d, zin.begin() + i * d);
    }
    ExpertFfn(*w.Expert(e), zin.data(), n, cfg.situ_beta, cfg.situ_linear_beta, yout.data(),
              precision, h_order);
    for (int64_t i = 0; i < n; ++i) {
      std::copy(yout.begin() + i * d, yout.begin() + (i + 1) * d, y.begin() + list[i] * d);
    }
  }
  return y;
}

std::vector<Bf16> FinishLayer(const ModelConfig& cfg, const MoeLayerWeights& w, const Bf16* x,
                              int64_t tokens, const Bf16* r, LayerTimings* timings) {
  const int64_t h = cfg.hidden, d = cfg.latent;
  std::vector<Bf16> normed(static_cast<size_t>(tokens * d));
  {
    StageTimer timer(timings, &LayerTimings::combine_norm);
    RmsNorm(r, tokens, d, w.norm.data(), cfg.rms_norm_eps, normed.data());
  }
  std::vector<Bf16> o(static_cast<size_t>(tokens * h));
  {
    StageTimer timer(timings, &LayerTimings::up_proj);
    LinearBf16(normed.data(), tokens, d, w.up_proj.data(), h, o.data());
  }
  std::vector<Bf16> sh(static_cast<size_t>(tokens * h));
  {
    StageTimer timer(timings, &LayerTimings::shared);
    SharedExpert(x, tokens, h, w.shared_gate.data(), w.shared_up.data(), w.shared_down.data(),
                 cfg.shared_intermediate(), cfg.situ_beta, cfg.situ_linear_beta, sh.data());
    for (int64_t i = 0; i < tokens * h; ++i) {
      o[i] = Bf16::FromFloat(o[i].ToFloat() + sh[i].ToFloat());
    }
  }
  return o;
}

absl::StatusOr<LayerOutput> MoeLayerForward(const ModelConfig& cfg, const MoeLayerWeights& w,
                                            absl::Span<const Bf16> x, int64_t tokens, int64_t width,
                                            const float* bias, LayerTimings* timings,
                                            Precision precision, const BudgetRule* budget,
                                            W4A8H h_order) {
  MOE_RETURN_IF_ERROR(ValidateHiddenStates(cfg, x, tokens, width));
  MOE_RETURN_IF_ERROR(ValidateLayerWeights(cfg, w, /*need_dense=*/true, /*need_experts=*/true));
  LayerOutput result;
  {
    StageTimer timer(timings, &LayerTimings::router);
    std::vector<float> scores(static_cast<size_t>(tokens * cfg.num_experts));
    RouterScores(x.data(), tokens, cfg.hidden, w.gate.data(), cfg.num_experts, scores.data());
    result.routing =
        SelectExperts(scores.data(), bias != nullptr ? bias : w.bias.data(), tokens,
                      cfg.num_experts, cfg.top_k, cfg.renormalize, cfg.routed_scaling_factor);
    if (budget != nullptr) {
      ApplyBudget(scores.data(), cfg.num_experts, *budget, cfg.renormalize,
                  cfg.routed_scaling_factor, &result.routing);
    }
  }
  std::vector<Bf16> z;
  {
    StageTimer timer(timings, &LayerTimings::down_proj);
    z = LatentDown(cfg, w, x.data(), tokens);
  }
  std::vector<Bf16> y;
  {
    StageTimer timer(timings, &LayerTimings::experts);
    y = RunExperts(cfg, w, result.routing, z.data(), precision, h_order);
  }
  std::vector<Bf16> r(static_cast<size_t>(tokens * cfg.latent));
  {
    StageTimer timer(timings, &LayerTimings::combine_norm);
    Combine(result.routing, y.data(), cfg.latent, r.data());
  }
  result.out = FinishLayer(cfg, w, x.data(), tokens, r.data(), timings);
  return result;
}

}  // namespace ref
}  // namespace moe::numerics
