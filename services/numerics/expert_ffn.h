// One routed expert's FFN on MXFP4 weights with SiTU-GLU (docs/math.md section 4 step 3), scalar
// reference:
//   g = bf16(z . W1^T), u = bf16(z . W3^T)   [tokens, I]  (w1 = gate, w3 = up, as checkpointed)
//   h = bf16(SiTU(g, u))                     (W4A8: MXFP8(SiTU(g, u)), docs/math.md section 6)
//   y = bf16(h . W2^T)                       [tokens, D]
// Weights are dequantized exactly to fp32 one row at a time; sums run in ascending order over
// the reduction axis as in linear.h.
//
//   ExpertWeights w{w1, w3, w2};  // borrowed MXFP4 views
//   ref::ExpertFfn(w, z, tokens, cfg.situ_beta, cfg.situ_linear_beta, y);
#ifndef MOE_SERVICES_NUMERICS_EXPERT_FFN_H_
#define MOE_SERVICES_NUMERICS_EXPERT_FFN_H_

#include <cstdint>

#include "services/numerics/mxfp4.h"
#include "services/numerics/mxfp8.h"
#include "services/numerics/precision_mode.h"
#include "services/tensor/bf16.h"

namespace moe::numerics {

struct ExpertWeights {
  Mxfp4Matrix w1;  // gate: [I, D]
  Mxfp4Matrix w3;  // up:   [I, D]
  Mxfp4Matrix w2;  // down: [D, I]
};

namespace ref {
// z: [tokens, D] -> y: [tokens, D]. W4A8: z and h are rounded through MXFP8 (per token, blocks
// of 32) before FC1 and FC2 read them, h from the fp32 SiTU output unless h_order says via bf16;
// everything else as in W4A16.
void ExpertFfn(const ExpertWeights& w, const tensor::Bf16* z, int64_t tokens, float beta,
               float linear_beta, tensor::Bf16* y, Precision precision = Precision::kW4A16,
               W4A8H h_order = W4A8H::kFromFp32);
// W4A8 on z already in MXFP8 (z.rows tokens, as an expert server receives it).
void ExpertFfn(const ExpertWeights& w, const Mxfp8Rows& z, float beta, float linear_beta,
               tensor::Bf16* y, W4A8H h_order = W4A8H::kFromFp32);
}  // namespace ref

}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_EXPERT_FFN_H_
