// The always-on shared experts, merged into one SiTU-GLU MLP of width S = 2 * I on the
// full-width input (docs/math.md section 4 step 7), scalar reference:
//   sh = bf16( bf16(SiTU(bf16(x . G^T), bf16(x . U^T))) . Dn^T )
//
//   ref::SharedExpert(x, tokens, hidden, gate, up, down, shared, beta, linear_beta, sh);
#ifndef MOE_SERVICES_NUMERICS_SHARED_EXPERT_H_
#define MOE_SERVICES_NUMERICS_SHARED_EXPERT_H_

#include <cstdint>

#include "services/tensor/bf16.h"

namespace moe::numerics::ref {

// x: [tokens, hidden]; gate, up: [shared, hidden]; down: [hidden, shared] -> out: [tokens, hidden].
void SharedExpert(const tensor::Bf16* x, int64_t tokens, int64_t hidden, const tensor::Bf16* gate,
                  const tensor::Bf16* up, const tensor::Bf16* down, int64_t shared, float beta,
                  float linear_beta, tensor::Bf16* out);

}  // namespace moe::numerics::ref

#endif  // MOE_SERVICES_NUMERICS_SHARED_EXPERT_H_
