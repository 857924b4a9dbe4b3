#include "services/numerics/linear.h"

namespace moe::numerics::ref {

std::vector<float> TransposeToFloat(const Bf16* x, int64_t tokens, int64_t in) {
  std::vector<float> xt(static_cast<size_t>(in * tokens));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < in; ++i) xt[i * tokens + t] = x[t * in + i].ToFloat();
  }
  return xt;
}

void DotSequential(const float* xt, int64_t tokens, const float* w_row, int64_t in, float* acc) {
  for (int64_t t = 0; t < tokens; ++t) acc[t] = 0.0f;
  for (int64_t i = 0; i < in; ++i) {
    const float wi = w_row[i];
    const float* xi = xt + i * tokens;
    for (int64_t t = 0; t < tokens; ++t) acc[t] += xi[t] * wi;
  }
}

namespace {

template <typename Store>
void LinearImpl(const Bf16* x, int64_t tokens, int64_t in, const Bf16* w, int64_t out,
                Store store) {
  const std::vector<float> xt = TransposeToFloat(x, tokens, in);
  std::vector<float> w_row(static_cast<size_t>(in));
  std::vector<float> acc(static_cast<size_t>(tokens));
  for (int64_t j = 0; j < out; ++j) {
    for (int64_t i = 0; i < in; ++i) w_row[i] = w[j * in + i].ToFloat();
    DotSequential(xt.data(), tokens, w_row.data(), in, acc.data());
    for (int64_t t = 0; t < tokens; ++t) store(t * out + j, acc[t]);
  }
}

}  // namespace

void LinearF32(const Bf16* x, int64_t tokens, int64_t in, const Bf16* w, int64_t out, float* y) {
  LinearImpl(x, tokens, in, w, out, [y](int64_t k, float v) { y[k] = v; });
}

void LinearBf16(const Bf16* x, int64_t tokens, int64_t in, const Bf16* w, int64_t out, Bf16* y) {
  LinearImpl(x, tokens, in, w, out, [y](int64_t k, float v) { y[k] = Bf16::FromFloat(v); });
}

}  // namespace moe::numerics::ref
