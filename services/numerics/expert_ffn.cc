#include "services/numerics/expert_ffn.h"

#include <vector>

#include "services/numerics/linear.h"
#include "services/numerics/situ.h"

namespace moe::numerics::ref {

using tensor::Bf16;

namespace {

// xt: [in, tokens] fp32 -> out[t * out_rows + r] = bf16(sum_i xt[i, t] * W[r, i]).
void Mxfp4Linear(const Mxfp4Matrix& w, const float* xt, int64_t tokens, float* out) {
  std::vector<float> row(static_cast<size_t>(w.cols));
  std::vector<float> acc(static_cast<size_t>(tokens));
  const int64_t packed_stride = Mxfp4PackedBytes(w.cols);
  const int64_t scale_stride = Mxfp4ScaleBytes(w.cols);
  for (int64_t r = 0; r < w.rows; ++r) {
    DequantizeMxfp4Row(w.packed + r * packed_stride, w.scales + r * scale_stride, w.cols,
                       row.data());
    DotSequential(xt, tokens, row.data(), w.cols, acc.data());
    for (int64_t t = 0; t < tokens; ++t) out[t * w.rows + r] = tensor::RoundBf16(acc[t]);
  }
}

}  // namespace

void ExpertFfn(const ExpertWeights& w, const Bf16* z, int64_t tokens, float beta, float linear_beta,
               Bf16* y) {
  const int64_t latent = w.w1.cols;
  const int64_t inter = w.w1.rows;
  const std::vector<float> zt = TransposeToFloat(z, tokens, latent);
  std::vector<float> g(static_cast<size_t>(tokens * inter));
  std::vector<float> u(static_cast<size_t>(tokens * inter));
  Mxfp4Linear(w.w1, zt.data(), tokens, g.data());
  Mxfp4Linear(w.w3, zt.data(), tokens, u.data());
  // h: [inter, tokens] (already transposed for the down projection).
  std::vector<float> ht(static_cast<size_t>(inter * tokens));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < inter; ++i) {
      ht[i * tokens + t] =
          tensor::RoundBf16(Situ(g[t * inter + i], u[t * inter + i], beta, linear_beta));
    }
  }
  std::vector<float> out(static_cast<size_t>(tokens * latent));
  Mxfp4Linear(w.w2, ht.data(), tokens, out.data());
  for (int64_t k = 0; k < tokens * latent; ++k) y[k] = Bf16::FromFloat(out[k]);
}

}  // namespace moe::numerics::ref
