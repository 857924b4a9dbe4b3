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
