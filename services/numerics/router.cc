#include "services/numerics/router.h"

#include "services/numerics/linear.h"
#include "services/numerics/situ.h"

namespace moe::numerics {

void TopK(const float* values, int64_t n, int64_t k, int32_t* out) {
  // out[0, filled) is sorted in rank order. Candidates come in ascending index, so a candidate
  // equal to an entry ranks below it: it enters only above strictly smaller values.
  if (k <= 0) return;
  int64_t filled = 0;
  auto insert = [&](int64_t j) {
    const float v = values[j];
    int64_t p = filled < k ? filled : k - 1;
    while (p > 0 && values[out[p - 1]] < v) {
      out[p] = out[p - 1];
      --p;
    }
    out[p] = static_cast<int32_t>(j);
    if (filled < k) ++filled;
  };
  int64_t j = 0;
  for (; j < n && filled < k; ++j) insert(j);
  // Full: most values do not beat the k-th. Blocks of 16 are tested branch-free (the compiler
  // vectorizes the fixed-length compare); only a block holding a value above the k-th as it was
  // at the block's start is walked in order, each value against the k-th as it is then. The
  // k-th only grows, so a value the block test passes over would fail the walk too: the result
  // is the scalar loop's, ties included.
  constexpr int64_t kBlock = 16;
  for (; j + kBlock <= n; j += kBlock) {
    const float kth = values[out[k - 1]];
    int any = 0;
    for (int64_t x = 0; x < kBlock; ++x) any |= values[j + x] > kth;
    if (any == 0) continue;
    for (int64_t x = j; x < j + kBlock; ++x) {
      if (values[x] > values[out[k - 1]]) insert(x);
    }
  }
  for (; j < n; ++j) {
    if (values[j] > values[out[k - 1]]) insert(j);
  }
}

Routing SelectExperts(const float* scores, const float* bias, int64_t tokens, int64_t num_experts,
                      int64_t top_k, bool renormalize, float scaling_factor) {
  Routing r;
  r.tokens = tokens;
  r.top_k = top_k;
  r.expert_ids.resize(static_cast<size_t>(tokens * top_k));
  r.weights.resize(static_cast<size_t>(tokens * top_k));
  std::vector<int32_t> order(static_cast<size_t>(top_k));
  std::vector<float> biased(static_cast<size_t>(num_experts));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* s = scores + t * num_experts;
    for (int64_t e = 0; e < num_experts; ++e) biased[e] = s[e] + (bias ? bias[e] : 0.0f);
    TopK(biased.data(), num_experts, top_k, order.data());
    float sum = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) sum += s[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t e = order[j];
      r.expert_ids[t * top_k + j] = e;
      r.weights[t * top_k + j] = RouterWeight(s[e], sum, renormalize, scaling_factor);
    }
  }
  return r;
}

std::vector<std::vector<int64_t>> PairsByExpert(const Routing& routing, int64_t num_experts) {
  std::vector<std::vector<int64_t>> pairs(static_cast<size_t>(num_experts));
  for (int64_t p = 0; p < routing.tokens * routing.top_k; ++p) {
    const int32_t e = routing.expert_ids[p];
    if (e >= 0) pairs[e].push_back(p);  // a negative id: a slot the budget dropped (dynamic_k.h)
  }
  return pairs;
}

namespace ref {

void RouterScores(const tensor::Bf16* x, int64_t tokens, int64_t hidden, const tensor::Bf16* gate,
                  int64_t num_experts, float* scores) {
  LinearF32(x, tokens, hidden, gate, num_experts, scores);
  for (int64_t i = 0; i < tokens * num_experts; ++i) scores[i] = Sigmoid(scores[i]);
}

}  // namespace ref
}  // namespace moe::numerics
