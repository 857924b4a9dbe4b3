#include "expert-svc/expert_backend.h"

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/numerics/cpu/cpu_isa.h"
#include "services/numerics/cpu/expert_ffn.h"
#include "services/numerics/cpu/kernel_choice.h"
#include "services/numerics/cuda/cuda_backend.h"
#include "services/numerics/cuda/launch_plan.h"
#include "services/numerics/mxfp8.h"
#include "services/numerics/precision_mode.h"

namespace moe::expert_svc {

namespace {

class CpuBackend final : public ExpertBackend {
 public:
  CpuBackend(const ModelConfig& cfg, const numerics::MoeLayerWeights& w,
             const numerics::cpu::KernelTable& k, numerics::cpu::ThreadPool* pool,
             numerics::W4A8H w4a8_h)
      : cfg_(cfg), w_(w), k_(k), pool_(pool), w4a8_h_(w4a8_h) {}
  std::string name() const override { return absl::StrCat("cpu/", numerics::cpu::KernelsName(k_)); }
  absl::StatusOr<std::vector<tensor::Bf16>> Run(const numerics::Routing& routing,
                                                const tensor::Activations& z) override {
    switch (z.format()) {
      case tensor::ActivationFormat::kMxfp8:
        return numerics::cpu::RunExperts(k_, pool_, cfg_, w_, routing, z.mxfp8(), w4a8_h_);
      case tensor::ActivationFormat::kBf16:
        return numerics::cpu::RunExperts(k_, pool_, cfg_, w_, routing, z.bf16().data());
    }
    return absl::InternalError("unknown activation format");
  }
  std::vector<numerics::Precision> precisions() const override {
    return {numerics::Precision::kW4A16, numerics::Precision::kW4A8};
  }

 private:
  const ModelConfig cfg_;
  const numerics::MoeLayerWeights& w_;
  const numerics::cpu::KernelTable& k_;
  numerics::cpu::ThreadPool* pool_;
  const numerics::W4A8H w4a8_h_;
};

class CudaBackend final : public ExpertBackend {
 public:
  explicit CudaBackend(std::unique_ptr<numerics::cuda::CudaExperts> experts)
      : experts_(std::move(experts)), name_(numerics::cuda::CudaDeviceName()) {}
  std::string name() const override { return name_; }
  // The CUDA kernels read bf16 activations only (W4A8 on the GPU is not built).
  absl::StatusOr<std::vector<tensor::Bf16>> Run(const numerics::Routing& routing,
                                                const tensor::Activations& z) override {
    if (z.format() != tensor::ActivationFormat::kBf16) {
      return absl::UnimplementedError(
          absl::StrCat("backend ", name_, " computes w4a16 only; w4a8 needs the cpu backend"));
    }
    return experts_->Run(routing, z.bf16().data());
  }
  std::vector<numerics::Precision> precisions() const override {
    return {numerics::Precision::kW4A16};
  }

 private:
  std::unique_ptr<numerics::cuda::CudaExperts> experts_;
  std::string name_;
};

// No compute: y[r] = z[r] (MXFP8 rows decoded to bf16), the shapes an expert FFN answers.
class EchoBackend final : public ExpertBackend {
 public:
  std::string name() const override { return "echo"; }
  absl::StatusOr<std::vector<tensor::Bf16>> Run(const numerics::Routing&,
                                                const tensor::Activations& z) override {
    if (z.format() == tensor::ActivationFormat::kBf16) {
      // One memcpy: a copy of the vector itself went two bytes at a time (Bf16's member
      // initializer keeps it from being trivial): 10% of the CPU samples of a 2 MiB round trip.
      std::vector<tensor::Bf16> y(z.bf16().size());
      if (!y.empty()) std::memcpy(y.data(), z.bf16().data(), y.size() * sizeof(tensor::Bf16));
      return y;
    }
    std::vector<tensor::Bf16> y(static_cast<size_t>(z.rows() * z.cols()));
    std::vector<float> row(static_cast<size_t>(z.cols()));
    for (int64_t r = 0; r < z.rows(); ++r) {
      numerics::DequantizeMxfp8Row(z.mxfp8(), r, row.data());
      for (int64_t c = 0; c < z.cols(); ++c) y[r * z.cols() + c] = tensor::Bf16::FromFloat(row[c]);
    }
    return y;
  }
  std::vector<numerics::Precision> precisions() const override {
    return {numerics::Precision::kW4A16, numerics::Precision::kW4A8};
  }
};

}  // namespace

absl::StatusOr<BackendChoice> ChooseBackend(Backend requested,
                                            const numerics::cuda::CudaDeviceInfo& gpu) {
  if (requested == Backend::kCpu || requested == Backend::kEcho)
    return BackendChoice{requested, ""};
  std::string why;
  if (!gpu.status.ok()) {
    why = std::string(gpu.status.message());
  } else if (gpu.major < numerics::cuda::kMinComputeMajor) {
    why = absl::StrCat("GPU ", gpu.name, " has compute capability ", gpu.major, ".", gpu.minor,
                       "; the CUDA kernels need ", numerics::cuda::kMinComputeMajor,
                       ".0 (Ampere) or newer");
  }
  if (why.empty()) return BackendChoice{Backend::kCuda, ""};
  if (requested == Backend::kCuda) {
    // No usable device: its own code (UNAVAILABLE); a device too old: FAILED_PRECONDITION.
    return absl::Status(gpu.status.ok() ? absl::StatusCode::kFailedPrecondition : gpu.status.code(),
                        absl::StrCat("backend cuda: ", why));
  }
  return BackendChoice{Backend::kCpu, absl::StrCat("auto chose the CPU: ", why)};
}

absl::StatusOr<std::unique_ptr<ExpertBackend>> MakeExpertBackend(
    Backend backend, const ModelConfig& cfg, const numerics::MoeLayerWeights& weights,
    const numerics::cpu::KernelTable& kernels, numerics::cpu::ThreadPool* pool,
    numerics::W4A8H w4a8_h) {
  const numerics::cuda::CudaDeviceInfo gpu = backend == Backend::kCuda || backend == Backend::kAuto
                                                 ? numerics::cuda::QueryCudaDevice()
                                                 : numerics::cuda::CudaDeviceInfo{};
  MOE_ASSIGN_OR_RETURN(BackendChoice choice, ChooseBackend(backend, gpu));
  if (choice.backend == Backend::kEcho) return std::unique_ptr<ExpertBackend>(new EchoBackend());
  std::string note = choice.note;
  if (choice.backend == Backend::kCuda) {
    auto experts = numerics::cuda::CudaExperts::Create(cfg, weights);
    if (experts.ok()) return std::unique_ptr<ExpertBackend>(new CudaBackend(std::move(*experts)));
    if (backend == Backend::kCuda) {
      return absl::Status(experts.status().code(),
                          absl::StrCat("backend cuda: ", experts.status().message()));
    }
    note = absl::StrCat("auto chose the CPU: CUDA experts: ", experts.status().message());
  }
  auto cpu = std::unique_ptr<ExpertBackend>(new CpuBackend(cfg, weights, kernels, pool, w4a8_h));
  cpu->note = note;
  return cpu;
}

}  // namespace moe::expert_svc
