#include "services/numerics/cuda/cublaslt_gemm.h"

namespace moe::numerics::cuda {

CublasLtGemm::~CublasLtGemm() {
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

cublasStatus_t CublasLtGemm::Init(size_t workspace_bytes) {
  if (cublasStatus_t s = cublasLtCreate(&handle_); s != CUBLAS_STATUS_SUCCESS) return s;
  if (cudaMalloc(&workspace_, workspace_bytes) != cudaSuccess) {
    workspace_ = nullptr;
    return CUBLAS_STATUS_ALLOC_FAILED;
  }
  workspace_bytes_ = workspace_bytes;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t CublasLtGemm::Run(GemmInput input, const void* x, const void* w, float* out,
                                 int64_t m, int64_t n, int64_t k, cudaStream_t stream) {
  const cudaDataType_t type = input == GemmInput::kBf16 ? CUDA_R_16BF : CUDA_R_32F;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  cublasStatus_t s = cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  const cublasOperation_t trans = CUBLAS_OP_T, no = CUBLAS_OP_N;
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans));
  }
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &no, sizeof(no));
  }
  // Column-major: A = W as [K, N] (ld K, transposed), B = x as [K, M] (ld K), C = [N, M] (ld N).
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&a, type, k, n, k);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&b, type, k, m, k);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&c, CUDA_R_32F, n, m, n);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulPreferenceCreate(&pref);
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &workspace_bytes_, sizeof(workspace_bytes_));
  }
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatmulAlgoGetHeuristic(handle_, desc, a, b, c, c, pref, 1, &heuristic, &found);
    if (s == CUBLAS_STATUS_SUCCESS && found == 0) s = CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const float alpha = 1.0f, beta = 0.0f;
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatmul(handle_, desc, &alpha, w, a, x, b, &beta, out, c, out, c, &heuristic.algo,
                       workspace_, workspace_bytes_, stream);
  }
  if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
  if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
  if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
  if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
  if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  return s;
}

}  // namespace moe::numerics::cuda
