#include "services/numerics/router.h"

#include <algorithm>
#include <numeric>

#include "services/numerics/linear.h"
#include "services/numerics/situ.h"

namespace moe::numerics {

Routing SelectExperts(const float* scores, const float* bias, int64_t tokens, int64_t num_experts,
                      int64_t top_k, bool renormalize, float scaling_factor) {
  Routing r;
  r.tokens = tokens;
  r.top_k = top_k;
  r.expert_ids.resize(static_cast<size_t>(tokens * top_k));
  r.weights.resize(static_cast<size_t>(tokens * top_k));
  std::vector<int32_t> order(static_cast<size_t>(num_experts));
  std::vector<float> biased(static_cast<size_t>(num_experts));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* s = scores + t * num_experts;
    for (int64_t e = 0; e < num_experts; ++e) biased[e] = s[e] + (bias ? bias[e] : 0.0f);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int32_t a, int32_t b) {
                        if (biased[a] != biased[b]) return biased[a] > biased[b];
                        return a < b;
                      });
    float sum = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) sum += s[order[j]];
    const float denom = sum + kRouterWeightEpsilon;
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t e = order[j];
      r.expert_ids[t * top_k + j] = e;
      r.weights[t * top_k + j] =
          renormalize ? (s[e] / denom) * scaling_factor : s[e] * scaling_factor;
    }
  }
  return r;
}

namespace ref {

void RouterScores(const tensor::Bf16* x, int64_t tokens, int64_t hidden,
                  const tensor::Bf16* gate, int64_t num_experts, float* scores) {
  LinearF32(x, tokens, hidden, gate, num_experts, scores);
  for (int64_t i = 0; i < tokens * num_experts; ++i) scores[i] = Sigmoid(scores[i]);
}

}  // namespace ref
}  // namespace moe::numerics
