#include "expert-svc/expert_backend.h"

#include <cstring>

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

// y holds [routing.tokens * routing.top_k, D] values; z [routing.tokens, D], or with z_rows
// one row of z per routing token.
absl::Status CheckShapes(const numerics::Routing& routing, const tensor::Activations& z,
                         absl::Span<const int32_t> z_rows, absl::Span<const tensor::Bf16> y) {
  const int64_t want = routing.tokens * routing.top_k * z.cols();
  const int64_t inputs = z_rows.empty() ? z.rows() : static_cast<int64_t>(z_rows.size());
  if (static_cast<int64_t>(y.size()) != want || inputs != routing.tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert backend: ", routing.tokens, " tokens x ", routing.top_k, " experts of ", z.cols(),
        " values need ", want, " outputs, given ", y.size(), " (activations: ", inputs, " rows)"));
  }
  for (size_t i = 0; i < z_rows.size(); ++i) {
    if (z_rows[i] < 0 || z_rows[i] >= z.rows()) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert backend: token ", i, " reads row ", z_rows[i], " of ", z.rows()));
    }
  }
  return absl::OkStatus();
}

class CpuBackend final : public ExpertBackend {
 public:
  CpuBackend(const ModelConfig& cfg, const numerics::MoeLayerWeights& w,
             const numerics::cpu::KernelTable& k, ThreadPool* pool, numerics::W4A8H w4a8_h)
      : cfg_(cfg), w_(w), k_(k), pool_(pool), w4a8_h_(w4a8_h) {}
  std::string name() const override { return absl::StrCat("cpu/", numerics::cpu::KernelsName(k_)); }
  absl::Status Run(const numerics::Routing& routing, const tensor::Activations& z,
                   absl::Span<const int32_t> z_rows, absl::Span<tensor::Bf16> y) override {
    MOE_RETURN_IF_ERROR(CheckShapes(routing, z, z_rows, y));
    switch (z.format()) {
      case tensor::ActivationFormat::kMxfp8:
        numerics::cpu::RunExperts(k_, pool_, cfg_, w_, routing, z.mxfp8(), z_rows, y.data(),
                                  w4a8_h_);
        return absl::OkStatus();
      case tensor::ActivationFormat::kBf16:
        numerics::cpu::RunExperts(k_, pool_, cfg_, w_, routing, z.bf16().data(), z_rows, y.data());
        return absl::OkStatus();
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
  ThreadPool* pool_;
  const numerics::W4A8H w4a8_h_;
};

class CudaBackend final : public ExpertBackend {
 public:
  explicit CudaBackend(std::unique_ptr<numerics::cuda::CudaExperts> experts)
      : experts_(std::move(experts)), name_(numerics::cuda::CudaDeviceName()) {}
  std::string name() const override { return name_; }
  // The CUDA kernels read bf16 activations only (W4A8 on the GPU is not built).
  absl::Status Run(const numerics::Routing& routing, const tensor::Activations& z,
                   absl::Span<const int32_t> z_rows, absl::Span<tensor::Bf16> y) override {
    if (z.format() != tensor::ActivationFormat::kBf16) {
      return absl::UnimplementedError(
          absl::StrCat("backend ", name_, " computes w4a16 only; w4a8 needs the cpu backend"));
    }
    MOE_RETURN_IF_ERROR(CheckShapes(routing, z, z_rows, y));
    // The CUDA kernels read one row per token: rows shared by several pairs gathered here.
    const tensor::Activations gathered =
        z_rows.empty() ? tensor::Activations()
                       : z.Gather(z_rows.data(), static_cast<int64_t>(z_rows.size()));
    MOE_ASSIGN_OR_RETURN(std::vector<tensor::Bf16> computed,
                         experts_->Run(routing, (z_rows.empty() ? z : gathered).bf16().data()));
    if (computed.size() != y.size()) {
      return absl::InternalError(
          absl::StrCat("backend ", name_, " answered ", computed.size(), " values for ", y.size()));
    }
    std::memcpy(y.data(), computed.data(), y.size() * sizeof(tensor::Bf16));
    return absl::OkStatus();
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
  absl::Status Run(const numerics::Routing& routing, const tensor::Activations& z,
                   absl::Span<const int32_t> z_rows, absl::Span<tensor::Bf16> y) override {
    MOE_RETURN_IF_ERROR(CheckShapes(routing, z, z_rows, y));
    const int64_t d = z.cols(), k = routing.top_k;
    const size_t row_bytes = static_cast<size_t>(d) * sizeof(tensor::Bf16);
    if (z.format() == tensor::ActivationFormat::kBf16 && k == 1 && z_rows.empty()) {
      // One memcpy: a copy of a vector went two bytes at a time (Bf16's member initializer
      // keeps it from being trivial): 10% of the CPU samples of a 2 MiB round trip.
      if (!y.empty()) std::memcpy(y.data(), z.bf16().data(), y.size() * sizeof(tensor::Bf16));
      return absl::OkStatus();
    }
    std::vector<tensor::Bf16> row(static_cast<size_t>(d));
    std::vector<float> decoded(static_cast<size_t>(d));
    for (int64_t t = 0; t < routing.tokens; ++t) {
      const int64_t r = z_rows.empty() ? t : z_rows[t];
      const tensor::Bf16* src = nullptr;
      if (z.format() == tensor::ActivationFormat::kBf16) {
        src = z.bf16().data() + r * d;
      } else {
        numerics::DequantizeMxfp8Row(z.mxfp8(), r, decoded.data());
        for (int64_t c = 0; c < d; ++c) row[c] = tensor::Bf16::FromFloat(decoded[c]);
        src = row.data();
      }
      for (int64_t j = 0; j < k; ++j) {  // every slot of the token answers its activations
        std::memcpy(y.data() + (t * k + j) * d, src, row_bytes);
      }
    }
    return absl::OkStatus();
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
    const numerics::cpu::KernelTable& kernels, ThreadPool* pool, numerics::W4A8H w4a8_h) {
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
