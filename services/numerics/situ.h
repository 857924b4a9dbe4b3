// SiTU-GLU activation of K3's expert and shared MLPs (SPEC.md section 5).
//
//   SiTU(g, u) = [b1 * tanh(g / b1) * sigmoid(g)] * [b2 * tanh(u / b2)],  b1 = 4, b2 = 25
//
// Computed in fp32 from bf16 inputs, in exactly this order: gate = (b1 * tanh(g / b1)) *
// sigmoid(g); up = b2 * tanh(u / b2); result = gate * up. The sigmoid takes the raw gate g.
// The gate factor lies in about (-0.28, 4) and the up factor in (-25, 25), so |SiTU| < 100.
//
//   float h = moe::numerics::Situ(g, u, 4.0f, 25.0f);
#ifndef MOE_SERVICES_NUMERICS_SITU_H_
#define MOE_SERVICES_NUMERICS_SITU_H_

#include <cmath>

namespace moe::numerics {

// fp32 logistic sigmoid 1 / (1 + exp(-x)), as the router and SiTU use it.
inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

inline float Situ(float g, float u, float beta, float linear_beta) {
  const float gate = (beta * std::tanh(g / beta)) * Sigmoid(g);
  const float up = linear_beta * std::tanh(u / linear_beta);
  return gate * up;
}

}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_SITU_H_
