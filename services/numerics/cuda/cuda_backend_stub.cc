// The op layer when the build has no CUDA (nvcc not found): every entry point says so.
#include "services/numerics/cuda/cuda_backend.h"
#include "services/numerics/cuda/expert_checks.h"

namespace moe::numerics::cuda {

absl::Status CudaDeviceStatus() {
  return absl::UnavailableError("built without CUDA (MOE_ENABLE_CUDA=OFF)");
}

std::string CudaDeviceName() { return "built without CUDA"; }

CudaDeviceInfo QueryCudaDevice() { return {CudaDeviceStatus(), "", 0, 0}; }

class CudaExperts::Impl {};

CudaExperts::CudaExperts(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaExperts::~CudaExperts() = default;

absl::StatusOr<std::unique_ptr<CudaExperts>> CudaExperts::Create(const ModelConfig& cfg,
                                                                 const MoeLayerWeights& w) {
  if (absl::Status s = ValidateCudaExperts(cfg, w); !s.ok()) return s;
  return CudaDeviceStatus();
}

absl::StatusOr<std::vector<tensor::Bf16>> CudaExperts::Run(const Routing&, const tensor::Bf16*) {
  return CudaDeviceStatus();
}

}  // namespace moe::numerics::cuda
