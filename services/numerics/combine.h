// Combine with late routing weights (SPEC.md section 4 step 4), scalar reference:
//   r[t] = bf16( sum_k fp32(y[t, k]) * w[t, k] )
// The fp32 sum runs over the token's experts in ascending expert id (not rank order), starting
// from 0.0f; each product fp32(y) * w is rounded to fp32 before it is added (no FMA).
//
//   ref::Combine(routing, y, latent, r);  // y: [T, k, D] in routing's slot order
#ifndef MOE_SERVICES_NUMERICS_COMBINE_H_
#define MOE_SERVICES_NUMERICS_COMBINE_H_

#include <cstdint>

#include "services/numerics/router.h"
#include "services/tensor/bf16.h"

namespace moe::numerics::ref {

// y: [tokens, top_k, latent] bf16, slot j of token t from expert routing.expert_ids[t*k + j]
// -> r: [tokens, latent] bf16.
void Combine(const Routing& routing, const tensor::Bf16* y, int64_t latent, tensor::Bf16* r);

}  // namespace moe::numerics::ref

#endif  // MOE_SERVICES_NUMERICS_COMBINE_H_
