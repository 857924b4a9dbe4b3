// Dense projections, scalar reference: y[t, j] = sum_i x[t, i] * W[j, i] with W stored [out, in]
// like torch.nn.Linear.
//
// Every product of two bf16 values is exact in fp32, so the only roundings are the fp32
// additions. The reference fixes their order: i ascending from 0.0f, one running sum per output
// (docs/math.md section 8 asks the oracle to fix what PyTorch leaves open). The NumPy reference
// (tests/reference) sums in the same order, so both agree bit for bit up to transcendental
// functions.
//
//   ref::LinearBf16(x, tokens, in, w, out, y);   // bf16 result (RNE), fp32 accumulation
//   ref::LinearF32(x, tokens, in, w, out, logits);  // fp32 result (the router)
#ifndef MOE_SERVICES_NUMERICS_LINEAR_H_
#define MOE_SERVICES_NUMERICS_LINEAR_H_

#include <cstdint>
#include <vector>

#include "services/tensor/bf16.h"

namespace moe::numerics::ref {

using tensor::Bf16;

// x: [tokens, in] bf16 -> xt: [in, tokens] fp32 (so that the per-output sums of all tokens can
// run side by side while each keeps its own sequential order).
std::vector<float> TransposeToFloat(const Bf16* x, int64_t tokens, int64_t in);

// acc[t] = sum over i ascending of xt[i, t] * w_row[i], fp32, starting from 0.
void DotSequential(const float* xt, int64_t tokens, const float* w_row, int64_t in, float* acc);

// x: [tokens, in], w: [out, in] -> y: [tokens, out] fp32.
void LinearF32(const Bf16* x, int64_t tokens, int64_t in, const Bf16* w, int64_t out, float* y);
// x: [tokens, in], w: [out, in] -> y: [tokens, out] bf16 (fp32 sums rounded once).
void LinearBf16(const Bf16* x, int64_t tokens, int64_t in, const Bf16* w, int64_t out, Bf16* y);

}  // namespace moe::numerics::ref

#endif  // MOE_SERVICES_NUMERICS_LINEAR_H_
