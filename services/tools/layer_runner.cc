#include "services/tools/layer_runner.h"

#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/safetensors.h"
#include "services/checkpoint/synthetic.h"
#include "services/common/status_macros.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/numerics/dynamic_k.h"
#include "services/numerics/precision.h"
#include "services/numerics/router.h"
#include "services/tools/tensor_file.h"

namespace moe::tools {
namespace {

using tensor::Bf16;
using tensor::DType;

template <typename T>
std::vector<uint8_t> Bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

absl::StatusOr<std::vector<Bf16>> ReadInput(const std::string& path, const ModelConfig& cfg,
                                            int64_t* tokens) {
  MOE_ASSIGN_OR_RETURN(Matrix x, ReadMatrix(path, "x"));
  if (x.cols != cfg.hidden) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": x is ", x.cols, " wide; the layer takes hidden_size ", cfg.hidden));
  }
  *tokens = x.rows;
  return std::move(x.values);
}

}  // namespace

uint64_t Fnv1a64(const void* data, size_t size) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < size; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

namespace {

// Dynamic k's thresholds for req.budget from a calibration batch routed with the layer's
// checkpoint bias (the rule of docs/math.md section 4.1, solved exactly).
absl::Status CalibrateBudget(const ForwardRequest& req, checkpoint::Checkpoint& ckpt,
                             ForwardReport* rep, std::vector<Bf16>* calibration,
                             std::vector<float>* thresholds, numerics::BudgetRule* rule) {
  const int64_t k = rep->config.top_k, e = rep->config.num_experts;
  if (req.budget < 1 || req.budget >= k) {
    return absl::InvalidArgumentError(
        absl::StrCat("--budget ", req.budget, " outside [1, top-k - 1 = ", k - 1, "]"));
  }
  if (!(req.budget_window_floor > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--budget_window_floor ", req.budget_window_floor, " must be > 0"));
  }
  const int64_t m = req.budget_calibration_tokens > 0
                        ? req.budget_calibration_tokens
                        : numerics::BudgetWindowTokens(e, req.budget, req.budget_window_floor);
  rep->budget_calibration_tokens = m;
  rep->budget_window_floor = numerics::BudgetWindowFloor(e, req.budget, m);
  *calibration = checkpoint::SyntheticHiddenStates(rep->config, m, req.input_seed + 1000);
  checkpoint::LoadOptions dense_only;  // the gate and bias (the layer's own may be moved)
  dense_only.expert_hi = 0;
  MOE_ASSIGN_OR_RETURN(numerics::MoeLayerWeights dense,
                       checkpoint::LoadMoeLayer(ckpt, rep->config, rep->layer, dense_only));
  std::vector<float> scores(static_cast<size_t>(m * e));
  numerics::ref::RouterScores(calibration->data(), m, rep->config.hidden, dense.gate.data(), e,
                              scores.data());
  MOE_ASSIGN_OR_RETURN(*thresholds,
                       numerics::ExactBudgetThresholds(scores, m, e, dense.bias, k, 1));
  rule->k_min = 1;
  rule->thresholds = numerics::BudgetRow(*thresholds, req.budget, e);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ForwardReport> RunLayerForward(const ForwardRequest& req) {
  ForwardReport rep;
  MOE_ASSIGN_OR_RETURN(auto ckpt, checkpoint::Checkpoint::Open(req.checkpoint));
  MOE_ASSIGN_OR_RETURN(rep.config, ckpt->LoadConfig());
  rep.layer = req.layer >= 0 ? req.layer : rep.config.first_moe_layer;
  const auto load_start = std::chrono::steady_clock::now();
  MOE_ASSIGN_OR_RETURN(numerics::MoeLayerWeights weights,
                       checkpoint::LoadMoeLayer(*ckpt, rep.config, rep.layer, {}));
  rep.load_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();

  std::vector<Bf16> x;
  if (!req.input.empty()) {
    MOE_ASSIGN_OR_RETURN(x, ReadInput(req.input, rep.config, &rep.tokens));
  } else {
    rep.tokens = req.tokens;
    if (rep.tokens > 0)
      x = checkpoint::SyntheticHiddenStates(rep.config, rep.tokens, req.input_seed);
  }
  if (req.backend != "cpu" && req.backend != "ref") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown backend \"", req.backend, "\"; use cpu or ref"));
  }
  MOE_ASSIGN_OR_RETURN(const numerics::Precision precision,
                       numerics::ParsePrecision(req.precision));
  const numerics::W4A8H h_order =
      req.w4a8_h_via_bf16 ? numerics::W4A8H::kViaBf16 : numerics::W4A8H::kFromFp32;
  std::unique_ptr<numerics::cpu::CpuMoeLayer> cpu;
  if (req.backend == "cpu") {
    numerics::cpu::CpuLayerOptions lo;
    lo.w4a8_h = h_order;
    MOE_ASSIGN_OR_RETURN(cpu,
                         numerics::cpu::CpuMoeLayer::Create(rep.config, std::move(weights), lo));
    rep.backend = absl::StrCat("cpu/", numerics::cpu::KernelsName(cpu->kernels()), ", ",
                               cpu->threads(), " threads");
  } else {
    rep.backend = "ref (scalar reference, 1 thread)";
  }
  // Dynamic k: thresholds from a calibration batch, the layer's checkpoint bias.
  std::vector<Bf16> calibration;
  std::vector<float> thresholds;
  numerics::BudgetRule rule;
  const int64_t k = rep.config.top_k, e = rep.config.num_experts;
  if (req.budget != 0) {
    MOE_RETURN_IF_ERROR(CalibrateBudget(req, *ckpt, &rep, &calibration, &thresholds, &rule));
  }
  if (req.top_p != 0) {
    if (req.budget != 0 || !(req.top_p > 0 && req.top_p <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--top_p ", req.top_p, ": in (0, 1], and not together with --budget"));
    }
    rule.k_min = 1;
    rule.top_p = req.top_p;
  }
  const numerics::BudgetRule* budget = req.budget != 0 || req.top_p != 0 ? &rule : nullptr;
  numerics::LayerOutput best;
  for (int r = 0; r < std::max(1, req.repeat); ++r) {
    numerics::LayerTimings t;
    MOE_ASSIGN_OR_RETURN(
        numerics::LayerOutput y,
        cpu ? cpu->Forward(x, rep.tokens, rep.config.hidden, nullptr, &t, precision, budget)
            : numerics::ref::MoeLayerForward(rep.config, weights, x, rep.tokens, rep.config.hidden,
                                             nullptr, &t, precision, budget, h_order));
    if (r == 0 || t.Total() < rep.timings.Total()) rep.timings = t;
    best = std::move(y);
  }
  rep.checksum = Fnv1a64(best.out.data(), best.out.size() * sizeof(Bf16));
  for (const Bf16& v : best.out) rep.output_abs_sum += std::fabs(v.ToFloat());

  if (!req.output.empty()) {
    const int64_t t = rep.tokens, h = rep.config.hidden;
    std::vector<std::pair<checkpoint::TensorSpec, std::vector<uint8_t>>> tensors = {
        {{"x", DType::kBF16, {t, h}}, Bytes(x)},
        {{"out", DType::kBF16, {t, h}}, Bytes(best.out)},
        {{"expert_ids", DType::kI32, {t, k}}, Bytes(best.routing.expert_ids)},
        {{"weights", DType::kF32, {t, k}}, Bytes(best.routing.weights)}};
    if (req.budget != 0) {
      const int64_t m = static_cast<int64_t>(calibration.size()) / h;
      tensors.push_back({{"thresholds", DType::kF32, {k - 1, e}}, Bytes(thresholds)});
      tensors.push_back({{"calibration_x", DType::kBF16, {m, h}}, Bytes(calibration)});
    }
    MOE_RETURN_IF_ERROR(checkpoint::WriteSafetensors(req.output, tensors,
                                                     {{"layer", std::to_string(rep.layer)},
                                                      {"checkpoint", req.checkpoint},
                                                      {"budget", std::to_string(req.budget)},
                                                      {"k_min", "1"}}));
  }
  return rep;
}

}  // namespace moe::tools
