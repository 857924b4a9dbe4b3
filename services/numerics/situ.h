// SiTU-GLU activation of K3's expert and shared MLPs (docs/math.md section 5).
//
//   SiTU(g, u) = [b1 * tanh(g / b1) * sigmoid(g)] * [b2 * tanh(u / b2)],  b1 = 4, b2 = 25
//
// Computed in fp32 from bf16 inputs, in exactly this order: gate = (b1 * tanh(g / b1)) *
// sigmoid(g); up = b2 * tanh(u / b2); result = gate * up. The sigmoid takes the raw gate g.
// The reference evaluates exp and tanh in double and rounds once to fp32 (the correctly
// rounded fp32 value in all but ~2^-29 of cases), so that it does not depend on which C
// library's expf/tanhf is linked; every other operation is a plain fp32 operation. Optimized
// kernels use their own approximations and are measured against this with named tolerances.
// The gate factor lies in about (-0.28, 4) and the up factor in (-25, 25), so |SiTU| < 100.
//
//   float h = moe::numerics::Situ(g, u, 4.0f, 25.0f);
#ifndef MOE_SERVICES_NUMERICS_SITU_H_
#define MOE_SERVICES_NUMERICS_SITU_H_

#include <cmath>

namespace moe::numerics {

// exp and tanh rounded once from double to fp32.
inline float ExpF32(float x) { return static_cast<float>(std::exp(static_cast<double>(x))); }
inline float TanhF32(float x) { return static_cast<float>(std::tanh(static_cast<double>(x))); }

// fp32 logistic sigmoid 1 / (1 + exp(-x)), as the router and SiTU use it.
inline float Sigmoid(float x) { return 1.0f / (1.0f + ExpF32(-x)); }

inline float Situ(float g, float u, float beta, float linear_beta) {
  const float gate = (beta * TanhF32(g / beta)) * Sigmoid(g);
  const float up = linear_beta * TanhF32(u / linear_beta);
  return gate * up;
}

}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_SITU_H_
