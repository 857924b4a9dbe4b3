#include "services/numerics/expert_ffn.h"

#include <vector>

#include "services/numerics/linear.h"
#include "services/numerics/precision_mode.h"
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

// The FFN from z as fp32 [tokens, D] (W4A8: already through MXFP8).
void FfnFromFloat(const ExpertWeights& w, const std::vector<float>& zf, int64_t tokens, float beta,
                  float linear_beta, Bf16* y, Precision precision, W4A8H h_order) {
  const int64_t latent = w.w1.cols;
  const int64_t inter = w.w1.rows;
  std::vector<float> zt(zf.size());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < latent; ++i) zt[i * tokens + t] = zf[t * latent + i];
  }
  std::vector<float> g(static_cast<size_t>(tokens * inter));
  std::vector<float> u(static_cast<size_t>(tokens * inter));
  Mxfp4Linear(w.w1, zt.data(), tokens, g.data());
  Mxfp4Linear(w.w3, zt.data(), tokens, u.data());
  // h: [tokens, inter], then [inter, tokens] (transposed for the down projection).
  std::vector<float> h(static_cast<size_t>(tokens * inter));
  // W4A8 (as deployed): MXFP8 from the fp32 SiTU output; W4A16, or W4A8 via bf16: bf16 first.
  const bool fp32_h = precision == Precision::kW4A8 && h_order == W4A8H::kFromFp32;
  for (int64_t k = 0; k < tokens * inter; ++k) {
    const float s = Situ(g[k], u[k], beta, linear_beta);
    h[k] = fp32_h ? s : tensor::RoundBf16(s);
  }
  if (precision == Precision::kW4A8) RoundTripMxfp8Rows(h.data(), tokens, inter);
  std::vector<float> ht(static_cast<size_t>(inter * tokens));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < inter; ++i) ht[i * tokens + t] = h[t * inter + i];
  }
  std::vector<float> out(static_cast<size_t>(tokens * latent));
  Mxfp4Linear(w.w2, ht.data(), tokens, out.data());
  for (int64_t k = 0; k < tokens * latent; ++k) y[k] = Bf16::FromFloat(out[k]);
}

}  // namespace

void ExpertFfn(const ExpertWeights& w, const Bf16* z, int64_t tokens, float beta, float linear_beta,
               Bf16* y, Precision precision, W4A8H h_order) {
  const int64_t latent = w.w1.cols;
  std::vector<float> zf(static_cast<size_t>(tokens * latent));
  for (int64_t i = 0; i < tokens * latent; ++i) zf[i] = z[i].ToFloat();
  if (precision == Precision::kW4A8) RoundTripMxfp8Rows(zf.data(), tokens, latent);
  FfnFromFloat(w, zf, tokens, beta, linear_beta, y, precision, h_order);
}

void ExpertFfn(const ExpertWeights& w, const Mxfp8Rows& z, float beta, float linear_beta, Bf16* y,
               W4A8H h_order) {
  std::vector<float> zf(static_cast<size_t>(z.rows * z.cols));
  for (int64_t r = 0; r < z.rows; ++r) DequantizeMxfp8Row(z, r, zf.data() + r * z.cols);
  FfnFromFloat(w, zf, z.rows, beta, linear_beta, y, Precision::kW4A8, h_order);
}

}  // namespace moe::numerics::ref
