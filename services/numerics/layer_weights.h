// The weights of one Stable LatentMoE layer as the math uses them (docs/math.md section 2), without
// any knowledge of files: services/checkpoint fills this from safetensors, tests and the
// synthetic generator fill it in memory.
//
// An attention node holds the dense part (has_dense) and possibly no experts; an expert server
// holds only the experts [expert_lo, expert_hi). Expert matrices are borrowed views (often into
// a mapped checkpoint); `backing` keeps whatever owns those bytes alive.
//
//   const ExpertWeights* e = layer.Expert(17);  // nullptr when 17 is not hosted here
#ifndef MOE_SERVICES_NUMERICS_LAYER_WEIGHTS_H_
#define MOE_SERVICES_NUMERICS_LAYER_WEIGHTS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "services/numerics/expert_ffn.h"
#include "services/tensor/bf16.h"

namespace moe::numerics {

struct MoeLayerWeights {
  int64_t layer = 0;

  // Dense (full-width) part: router, latent projections, latent norm, shared experts.
  bool has_dense = false;
  std::vector<tensor::Bf16> gate;         // gate.weight: [E, H]
  std::vector<float> bias;                // gate.e_score_correction_bias: [E]
  std::vector<tensor::Bf16> down_proj;    // routed_expert_down_proj.weight: [D, H]
  std::vector<tensor::Bf16> norm;         // routed_expert_norm.weight: [D]
  std::vector<tensor::Bf16> up_proj;      // routed_expert_up_proj.weight: [H, D]
  std::vector<tensor::Bf16> shared_gate;  // shared_experts.gate_proj.weight: [S, H]
  std::vector<tensor::Bf16> shared_up;    // shared_experts.up_proj.weight: [S, H]
  std::vector<tensor::Bf16> shared_down;  // shared_experts.down_proj.weight: [H, S]

  // Routed experts [expert_lo, expert_hi).
  int64_t expert_lo = 0;
  int64_t expert_hi = 0;
  std::vector<ExpertWeights> experts;  // experts[e - expert_lo]
  std::vector<std::shared_ptr<const void>> backing;

  bool HostsExpert(int64_t e) const { return e >= expert_lo && e < expert_hi; }
  const ExpertWeights* Expert(int64_t e) const {
    return HostsExpert(e) ? &experts[static_cast<size_t>(e - expert_lo)] : nullptr;
  }
};

}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_LAYER_WEIGHTS_H_
