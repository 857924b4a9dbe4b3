#include "services/numerics/combine.h"

#include <algorithm>
#include <numeric>
#include <vector>

namespace moe::numerics::ref {

void Combine(const Routing& routing, const tensor::Bf16* y, int64_t latent, tensor::Bf16* r) {
  const int64_t k = routing.top_k;
  std::vector<int64_t> slots(static_cast<size_t>(k));
  std::vector<float> acc(static_cast<size_t>(latent));
  for (int64_t t = 0; t < routing.tokens; ++t) {
    const int32_t* ids = routing.expert_ids.data() + t * k;
    std::iota(slots.begin(), slots.end(), 0);
    std::sort(slots.begin(), slots.end(), [ids](int64_t a, int64_t b) { return ids[a] < ids[b]; });
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t slot : slots) {
      if (ids[slot] < 0) continue;  // dropped by the budget (dynamic_k.h)
      const float w = routing.weights[t * k + slot];
      const tensor::Bf16* ys = y + (t * k + slot) * latent;
      for (int64_t d = 0; d < latent; ++d) {
        const float product = ys[d].ToFloat() * w;
        acc[d] = acc[d] + product;
      }
    }
    for (int64_t d = 0; d < latent; ++d) r[t * latent + d] = tensor::Bf16::FromFloat(acc[d]);
  }
}

}  // namespace moe::numerics::ref

namespace moe::numerics {

std::vector<int64_t> PartialSums(const tensor::Bf16* y, int64_t rows, int64_t latent,
                                 const int32_t* token_index, const float* weights,
                                 int64_t num_tokens, std::vector<float>* out) {
  // Memory in the rows, never in num_tokens (a caller's claim: a small batch may say 2^30).
  (void)num_tokens;
  std::vector<int64_t> distinct(token_index, token_index + rows);
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  out->assign(distinct.size() * static_cast<size_t>(latent), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t slot =
        std::lower_bound(distinct.begin(), distinct.end(), int64_t{token_index[r]}) -
        distinct.begin();
    float* a = out->data() + slot * latent;
    const tensor::Bf16* yr = y + r * latent;
    const float w = weights[r];
    for (int64_t c = 0; c < latent; ++c) a[c] += yr[c].ToFloat() * w;
  }
  return distinct;
}

void AddPartialSums(const float* part, const std::vector<int64_t>& tokens, int64_t latent,
                    float* acc) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    float* a = acc + tokens[i] * latent;
    const float* p = part + static_cast<int64_t>(i) * latent;
    for (int64_t c = 0; c < latent; ++c) a[c] += p[c];
  }
}

}  // namespace moe::numerics
