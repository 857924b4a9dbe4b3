// The sigmoid router with a selection-only bias (docs/math.md section 4 step 1), scalar reference.
//
//   logits = x . Wg^T (fp32), s = sigmoid(logits), c = s + bias, ids = top-k(c),
//   w = s[ids] / (sum s[ids] + 1e-20) * routed_scaling_factor   (renormalize = true)
//   w = s[ids] * routed_scaling_factor                          (renormalize = false)
//
// Tie rule (SPEC asks to choose): order by biased score descending, then expert id ascending,
// so among equal biased scores the lower expert id wins. ids are returned in that order (rank
// order) and the weight sum runs over them in rank order, in fp32.
//
//   std::vector<float> scores(T * E);
//   ref::RouterScores(x, T, H, gate, E, scores.data());
//   Routing r = SelectExperts(scores.data(), bias.data(), T, E, k, true, 1.0f);
#ifndef MOE_SERVICES_NUMERICS_ROUTER_H_
#define MOE_SERVICES_NUMERICS_ROUTER_H_

#include <cstdint>
#include <vector>

#include "services/tensor/bf16.h"

namespace moe::numerics {

// The routing decision for a batch: an output of the layer as well as an input of dispatch.
struct Routing {
  int64_t tokens = 0;
  int64_t top_k = 0;
  std::vector<int32_t> expert_ids;  // [tokens, top_k], rank order
  std::vector<float> weights;       // [tokens, top_k], matching expert_ids
};

inline constexpr float kRouterWeightEpsilon = 1e-20f;

// The mixture weight of a chosen expert with unbiased score s, where sum is the fp32 sum of the
// chosen experts' scores in rank order (the one formula of SelectExperts and dynamic k's
// ApplyBudget, so both round alike).
inline float RouterWeight(float s, float sum, bool renormalize, float scaling_factor) {
  return renormalize ? (s / (sum + kRouterWeightEpsilon)) * scaling_factor : s * scaling_factor;
}

// The k largest of values[0, n) in rank order (value descending, then index ascending), written
// to out[0, k). k <= n; values must not be NaN. O(n) for small k (insertion into a sorted list).
void TopK(const float* values, int64_t n, int64_t k, int32_t* out);

// Selects the top-k experts of each token from fp32 scores [T, E] plus bias [E] (bias may be
// null: zero). Scores must be finite; the caller validates.
Routing SelectExperts(const float* scores, const float* bias, int64_t tokens, int64_t num_experts,
                      int64_t top_k, bool renormalize, float scaling_factor);

// The (token, slot) pairs of each expert: result[e] holds token * top_k + slot for every slot
// routed to e, ascending (so tokens ascending); slots a budget dropped (id -1) belong to none.
// Grouping by expert lets an expert's weights stream once per batch.
std::vector<std::vector<int64_t>> PairsByExpert(const Routing& routing, int64_t num_experts);

namespace ref {
// x: [T, H] bf16, gate: [E, H] bf16 -> scores: [T, E] fp32 sigmoid scores.
void RouterScores(const tensor::Bf16* x, int64_t tokens, int64_t hidden, const tensor::Bf16* gate,
                  int64_t num_experts, float* scores);
}  // namespace ref

}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_ROUTER_H_
