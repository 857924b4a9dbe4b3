// Latent RMSNorm (docs/math.md section 4 step 5), scalar reference:
//   n  = bf16( fp32(r) * (1 / sqrt(mean(fp32(r)^2) + eps)) )
//   r' = bf16( gamma * n )
// The sum of squares runs over d ascending in fp32 (each square of a bf16 is exact), the mean
// is that sum divided by D in fp32, and the reciprocal square root is 1.0f / sqrtf(.) (both
// correctly rounded IEEE operations).
//
//   ref::RmsNorm(r, tokens, latent, gamma, cfg.rms_norm_eps, normed);
#ifndef MOE_SERVICES_NUMERICS_RMS_NORM_H_
#define MOE_SERVICES_NUMERICS_RMS_NORM_H_

#include <cstdint>

#include "services/tensor/bf16.h"

namespace moe::numerics::ref {

// r: [tokens, dim], gamma: [dim] -> out: [tokens, dim].
void RmsNorm(const tensor::Bf16* r, int64_t tokens, int64_t dim, const tensor::Bf16* gamma,
             float eps, tensor::Bf16* out);

}  // namespace moe::numerics::ref

#endif  // MOE_SERVICES_NUMERICS_RMS_NORM_H_
