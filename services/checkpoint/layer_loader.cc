#include "services/checkpoint/layer_loader.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "services/checkpoint/k3_names.h"
#include "services/common/status_macros.h"
#include "services/numerics/mxfp4.h"

namespace moe::checkpoint {
namespace {

using numerics::MoeLayerWeights;
using tensor::Bf16;

absl::StatusOr<TensorRef> GetChecked(Checkpoint& ckpt, const TensorSpec& spec) {
  MOE_ASSIGN_OR_RETURN(TensorRef ref, ckpt.Get(spec.name));
  if (ref.info->dtype != spec.dtype || ref.info->shape != spec.shape) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor \"", spec.name, "\": checkpoint has ", tensor::DTypeName(ref.info->dtype), " ",
        ShapeString(ref.info->shape), ", the config needs ", tensor::DTypeName(spec.dtype), " ",
        ShapeString(spec.shape)));
  }
  return ref;
}

template <typename T>
absl::Status CopyFinite(const TensorRef& ref, std::vector<T>* out) {
  out->resize(ref.data.size() / sizeof(T));
  std::memcpy(out->data(), ref.data.data(), ref.data.size());  // also fixes any misalignment
  for (size_t i = 0; i < out->size(); ++i) {
    float v;
    if constexpr (std::is_same_v<T, Bf16>) {
      v = (*out)[i].ToFloat();
    } else {
      v = (*out)[i];
    }
    if (!std::isfinite(v)) {
      return absl::DataLossError(
          absl::StrCat("tensor \"", ref.info->name, "\": non-finite value at element ", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MoeLayerWeights> LoadMoeLayer(Checkpoint& ckpt, const ModelConfig& cfg,
                                             int64_t layer, const LoadOptions& options) {
  MOE_RETURN_IF_ERROR(ValidateConfig(cfg));
  if (!cfg.IsMoeLayer(layer)) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " is not a MoE layer of this model (MoE layers are [",
                     cfg.first_moe_layer, ", ", cfg.num_layers, "))"));
  }
  const int64_t lo = options.expert_lo;
  const int64_t hi = options.expert_hi < 0 ? cfg.num_experts : options.expert_hi;
  if (lo < 0 || lo > hi || hi > cfg.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert range [", lo, ", ", hi, ") is not inside [0, ", cfg.num_experts, ")"));
  }
  MoeLayerWeights w;
  w.layer = layer;
  w.expert_lo = lo;
  w.expert_hi = hi;
  if (options.dense) {
    const std::vector<TensorSpec> specs = DenseTensorSpecs(cfg, layer);
    std::vector<Bf16>* targets[] = {&w.gate,    nullptr,        &w.down_proj, &w.norm,
                                    &w.up_proj, &w.shared_gate, &w.shared_up, &w.shared_down};
    for (size_t i = 0; i < specs.size(); ++i) {
      MOE_ASSIGN_OR_RETURN(TensorRef ref, GetChecked(ckpt, specs[i]));
      if (targets[i] == nullptr) {
        MOE_RETURN_IF_ERROR(CopyFinite(ref, &w.bias));
      } else {
        MOE_RETURN_IF_ERROR(CopyFinite(ref, targets[i]));
      }
    }
    w.has_dense = true;
  }
  w.experts.resize(static_cast<size_t>(hi - lo));
  for (int64_t e = lo; e < hi; ++e) {
    const std::vector<TensorSpec> specs = ExpertTensorSpecs(cfg, layer, e);
    numerics::Mxfp4Matrix* mats[] = {&w.experts[e - lo].w1, &w.experts[e - lo].w3,
                                     &w.experts[e - lo].w2};
    for (int m = 0; m < 3; ++m) {
      MOE_ASSIGN_OR_RETURN(TensorRef packed, GetChecked(ckpt, specs[2 * m]));
      MOE_ASSIGN_OR_RETURN(TensorRef scales, GetChecked(ckpt, specs[2 * m + 1]));
      const int64_t nan = numerics::FindE8M0NaN(scales.data.data(), scales.data.size());
      if (nan >= 0) {
        return absl::DataLossError(
            absl::StrCat("tensor \"", specs[2 * m + 1].name, "\": E8M0 scale at byte ", nan,
                         " is 0xFF (NaN), which MXFP4 weights may not hold"));
      }
      numerics::Mxfp4Matrix& mat = *mats[m];
      mat.rows = packed.info->shape[0];
      mat.cols = packed.info->shape[1] * 2;
      mat.packed = packed.data.data();
      mat.scales = scales.data.data();
      for (const TensorRef* r : {&packed, &scales}) {
        bool held = false;
        for (const auto& b : w.backing) held = held || b.get() == r->file.get();
        if (!held) w.backing.push_back(r->file);
      }
    }
    if (options.on_expert_loaded) options.on_expert_loaded(cfg.ExpertBytes());
  }
  return w;
}

}  // namespace moe::checkpoint
