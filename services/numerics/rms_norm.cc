#include "services/numerics/rms_norm.h"

#include <cmath>

namespace moe::numerics::ref {

void RmsNorm(const tensor::Bf16* r, int64_t tokens, int64_t dim, const tensor::Bf16* gamma,
             float eps, tensor::Bf16* out) {
  for (int64_t t = 0; t < tokens; ++t) {
    const tensor::Bf16* row = r + t * dim;
    float sum_sq = 0.0f;
    for (int64_t d = 0; d < dim; ++d) {
      const float v = row[d].ToFloat();
      sum_sq += v * v;
    }
    const float mean = sum_sq / static_cast<float>(dim);
    const float inv = 1.0f / std::sqrt(mean + eps);
    for (int64_t d = 0; d < dim; ++d) {
      const float n = tensor::RoundBf16(row[d].ToFloat() * inv);
      out[t * dim + d] = tensor::Bf16::FromFloat(gamma[d].ToFloat() * n);
    }
  }
}

}  // namespace moe::numerics::ref
