#include "services/numerics/cuda/expert_checks.h"

#include "absl/strings/str_cat.h"
#include "services/numerics/mxfp4.h"

namespace moe::numerics::cuda {

absl::Status ValidateCudaExperts(const ModelConfig& cfg, const MoeLayerWeights& w) {
  const int64_t d = cfg.latent, i = cfg.intermediate;
  if (d <= 0 || i <= 0 || d % 64 != 0 || i % 64 != 0 || cfg.top_k < 1 || cfg.top_k > 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CUDA experts need D and I positive multiples of 64 and 1 <= k <= 32 (D ",
                     d, ", I ", i, ", k ", cfg.top_k, ")"));
  }
  const int64_t n = w.expert_hi - w.expert_lo;
  if (w.expert_lo < 0 || n <= 0 || w.expert_hi > cfg.num_experts ||
      static_cast<int64_t>(w.experts.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("expert range [", w.expert_lo, ", ", w.expert_hi,
                                                   ") of ", cfg.num_experts, " experts with ",
                                                   w.experts.size(), " experts' weights"));
  }
  struct Matrix {
    const char* name;
    int64_t rows, cols;
  };
  const Matrix shapes[3] = {{"w1", i, d}, {"w3", i, d}, {"w2", d, i}};
  for (int64_t e = 0; e < n; ++e) {
    const ExpertWeights& x = w.experts[static_cast<size_t>(e)];
    const Mxfp4Matrix* m[3] = {&x.w1, &x.w3, &x.w2};
    for (int j = 0; j < 3; ++j) {
      const std::string what = absl::StrCat("expert ", w.expert_lo + e, " ", shapes[j].name);
      if (m[j]->packed == nullptr || m[j]->scales == nullptr || m[j]->rows != shapes[j].rows ||
          m[j]->cols != shapes[j].cols) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": [", m[j]->rows, ", ", m[j]->cols, "] (need [", shapes[j].rows,
                         ", ", shapes[j].cols, "] with packed values and scales)"));
      }
      const int64_t blocks = Mxfp4ScaleBytes(shapes[j].cols);
      const int64_t bad = FindE8M0NaN(m[j]->scales, static_cast<size_t>(shapes[j].rows * blocks));
      if (bad >= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, " scales: row ", bad / blocks, " block ", bad % blocks,
                         " is 0xFF, NaN in E8M0 (the GPU would decode it to +Inf); refused"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace moe::numerics::cuda
