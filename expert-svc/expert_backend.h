// The backend registry of expert-svc: where a hosted layer's routed experts run.
//   "cpu"   the optimized CPU kernels (numerics::cpu::RunExperts);
//   "cuda"  the CUDA kernels (numerics::cuda::CudaExperts); fails at start without a usable GPU;
//   "auto"  CUDA when a device is usable, else the CPU (the default);
//   "echo"  no expert compute: each row is answered with its own activations (bf16), so a
//           cluster measures its data plane alone (tests/bench/dispatch_bench.cc).
// Both honour RunExperts' contract: y [T, k, D] in the routing's slot order, written where the
// caller says (a data plane's registered send buffer: no copy after the compute).
//
//   MOE_ASSIGN_OR_RETURN(auto backend, MakeExpertBackend(Backend::kAuto, cfg, weights, kernels,
//                                                        &pool));
//   std::vector<Bf16> y(routing.tokens * routing.top_k * cfg.latent);
//   MOE_RETURN_IF_ERROR(backend->Run(routing, z, {}, absl::MakeSpan(y)));  // z: Activations
#ifndef MOE_EXPERT_SVC_EXPERT_BACKEND_H_
#define MOE_EXPERT_SVC_EXPERT_BACKEND_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "services/common/enum_names.h"
#include "services/common/model_config.h"
#include "services/common/thread_pool.h"
#include "services/numerics/cpu/kernels.h"
#include "services/numerics/cuda/cuda_backend.h"
#include "services/numerics/layer_weights.h"
#include "services/numerics/mxfp8.h"
#include "services/numerics/precision_mode.h"
#include "services/numerics/router.h"
#include "services/tensor/activations.h"
#include "services/tensor/bf16.h"

namespace moe::expert_svc {

class ExpertBackend {
 public:
  virtual ~ExpertBackend() = default;
  // e.g. "cpu/avx512", "cuda/NVIDIA H200".
  virtual std::string name() const = 0;
  // z: [routing.tokens, D], or with z_rows (one per routing token: the row of z it reads) the
  // distinct rows they read, as an expert server's batch arrives (no gathered copy); its format
  // is the mode (bf16: W4A16, MXFP8: W4A8). y: exactly routing.tokens * routing.top_k * D
  // values, each written. INVALID_ARGUMENT for another size or a row outside z; UNIMPLEMENTED
  // for a format whose mode precisions() lacks.
  virtual absl::Status Run(const numerics::Routing& routing, const tensor::Activations& z,
                           absl::Span<const int32_t> z_rows, absl::Span<tensor::Bf16> y) = 0;
  // The precision modes this backend computes (W4A16 always).
  virtual std::vector<numerics::Precision> precisions() const = 0;
  // Why this backend and not the one asked for (auto's fallback to the CPU), or "".
  std::string note;
};

enum class Backend { kAuto, kCpu, kCuda, kEcho };
inline constexpr EnumNames<Backend, 4> kBackends{"backend",
                                                 {{{Backend::kAuto, "auto"},
                                                   {Backend::kCpu, "cpu"},
                                                   {Backend::kCuda, "cuda"},
                                                   {Backend::kEcho, "echo"}}}};
inline const char* BackendName(Backend b) { return kBackends.Name(b); }
inline absl::StatusOr<Backend> ParseBackend(const std::string& name) {
  return kBackends.Parse(name);
}

// Where a requested backend runs, given device 0 (a pure rule, tested by table): auto picks CUDA
// on a usable GPU of compute capability 8.0 (Ampere) or newer, else the CPU with the reason in
// `note`; cuda without a usable GPU is UNAVAILABLE, on an older one FAILED_PRECONDITION, naming
// it; cpu and echo run as asked.
struct BackendChoice {
  Backend backend = Backend::kCpu;  // kCpu, kCuda or kEcho
  std::string note;                 // why auto did not pick CUDA ("" otherwise)
};
absl::StatusOr<BackendChoice> ChooseBackend(Backend requested,
                                            const numerics::cuda::CudaDeviceInfo& gpu);

// weights, kernels and pool must outlive the backend. auto falls back to the CPU (with the
// reason in the backend's note()) when the GPU is unusable, too old, or CudaExperts::Create
// fails; cuda does not fall back.
// w4a8_h: where the CPU backend's W4A8 quantizes h (precision_mode.h).
absl::StatusOr<std::unique_ptr<ExpertBackend>> MakeExpertBackend(
    Backend backend, const ModelConfig& cfg, const numerics::MoeLayerWeights& weights,
    const numerics::cpu::KernelTable& kernels, ThreadPool* pool,
    numerics::W4A8H w4a8_h = numerics::W4A8H::kFromFp32);

}  // namespace moe::expert_svc

#endif  // MOE_EXPERT_SVC_EXPERT_BACKEND_H_
