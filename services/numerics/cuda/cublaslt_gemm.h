// Dense projections through cuBLASLt: out[M, N] (fp32, row-major) = x[M, K] . W[N, K]^T with
// fp32 accumulation; bf16 inputs (latent down/up, shared experts) or fp32 inputs (the router,
// CUBLAS_COMPUTE_32F, no TF32). Row-major operands map onto cuBLASLt's column-major view as
// out^T = W . x^T (A = W with transpose, B = x). No Abseil: the standalone GPU check uses it.
//
//   CublasLtGemm g;  g.Init();
//   g.Run(GemmInput::kBf16, x, w, out, M, N, K, stream);  // cublasStatus_t
#ifndef MOE_SERVICES_NUMERICS_CUDA_CUBLASLT_GEMM_H_
#define MOE_SERVICES_NUMERICS_CUDA_CUBLASLT_GEMM_H_

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moe::numerics::cuda {

enum class GemmInput { kBf16, kF32 };

class CublasLtGemm {
 public:
  CublasLtGemm() = default;
  ~CublasLtGemm();
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  cublasStatus_t Init(size_t workspace_bytes = size_t{32} << 20);
  // x: [M, K], w: [N, K] (device, row-major, of `input` type); out: [M, N] fp32 (device).
  cublasStatus_t Run(GemmInput input, const void* x, const void* w, float* out, int64_t m,
                     int64_t n, int64_t k, cudaStream_t stream);

 private:
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

}  // namespace moe::numerics::cuda

#endif  // MOE_SERVICES_NUMERICS_CUDA_CUBLASLT_GEMM_H_
