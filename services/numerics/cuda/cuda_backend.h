// The CUDA op layer: device discovery and the routed experts on the GPU with the contract of
// cpu::RunExperts, turning the kernels' cudaError_t into absl::Status. Built with the real
// implementation when nvcc is found (MOE_ENABLE_CUDA), with a stub that reports UNAVAILABLE
// otherwise; binaries linking it start without a GPU or driver and fall back to the CPU.
//
//   if (CudaDeviceStatus().ok()) {
//     MOE_ASSIGN_OR_RETURN(auto gpu, CudaExperts::Create(cfg, weights));
//     MOE_ASSIGN_OR_RETURN(std::vector<Bf16> y, gpu->Run(routing, z));
//   }
#ifndef MOE_SERVICES_NUMERICS_CUDA_CUDA_BACKEND_H_
#define MOE_SERVICES_NUMERICS_CUDA_CUDA_BACKEND_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/common/model_config.h"
#include "services/numerics/layer_weights.h"
#include "services/numerics/router.h"
#include "services/tensor/bf16.h"

namespace moe::numerics::cuda {

// OK when CUDA support is built in and a device is usable; else UNAVAILABLE with the reason
// (no driver: cudaGetDeviceCount's error, e.g. 35; no device; built without CUDA).
absl::Status CudaDeviceStatus();
// Device 0: whether it is usable (status), its name and compute capability.
struct CudaDeviceInfo {
  absl::Status status;
  std::string name;
  int major = 0, minor = 0;
};
CudaDeviceInfo QueryCudaDevice();
// "cuda/<device name>" or the reason there is none.
std::string CudaDeviceName();

class CudaExperts {
 public:
  // Copies the hosted experts [expert_lo, expert_hi) of `weights` to the device, after
  // ValidateCudaExperts (expert_checks.h) accepted them.
  static absl::StatusOr<std::unique_ptr<CudaExperts>> Create(const ModelConfig& cfg,
                                                             const MoeLayerWeights& weights);
  ~CudaExperts();

  // z: [T, D] -> y: [T, k, D] in routing's slot order (every routed expert hosted).
  absl::StatusOr<std::vector<tensor::Bf16>> Run(const Routing& routing, const tensor::Bf16* z);

  class Impl;

 private:
  explicit CudaExperts(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::numerics::cuda

#endif  // MOE_SERVICES_NUMERICS_CUDA_CUDA_BACKEND_H_
