#include "services/numerics/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "services/numerics/cuda/expert_checks.h"
#include "services/numerics/cuda/kernels.h"
#include "services/numerics/cuda/launch_plan.h"
#include "services/numerics/mxfp4.h"

namespace moe::numerics::cuda {

using tensor::Bf16;

namespace {

absl::Status FromCuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": CUDA error ", static_cast<int>(e), " (", cudaGetErrorString(e), ")"));
}

#define MOE_CUDA_RETURN(expr, what)                                    \
  do {                                                                 \
    if (absl::Status s_ = FromCuda((expr), what); !s_.ok()) return s_; \
  } while (0)

// A device buffer that frees itself.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
  cudaError_t Reserve(size_t n) {
    if (n <= bytes) return cudaSuccess;
    if (ptr != nullptr) cudaFree(ptr);
    ptr = nullptr;
    bytes = 0;
    cudaError_t e = cudaMalloc(&ptr, n);
    if (e == cudaSuccess) bytes = n;
    return e;
  }
};

}  // namespace

absl::Status CudaDeviceStatus() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("no usable CUDA device: cudaGetDeviceCount error ",
                                               static_cast<int>(e), " (", cudaGetErrorString(e),
                                               ")"));
  }
  if (count == 0) return absl::UnavailableError("no CUDA device");
  return absl::OkStatus();
}

CudaDeviceInfo QueryCudaDevice() {
  CudaDeviceInfo info;
  info.status = CudaDeviceStatus();
  if (!info.status.ok()) return info;
  cudaDeviceProp p = {};
  if (cudaError_t e = cudaGetDeviceProperties(&p, 0); e != cudaSuccess) {
    info.status = FromCuda(e, "cudaGetDeviceProperties");
    return info;
  }
  info.name = p.name;
  info.major = p.major;
  info.minor = p.minor;
  return info;
}

std::string CudaDeviceName() {
  if (absl::Status s = CudaDeviceStatus(); !s.ok()) return std::string(s.message());
  cudaDeviceProp p = {};
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return "cuda/unknown";
  return absl::StrCat("cuda/", p.name);
}

class CudaExperts::Impl {
 public:
  ModelConfig cfg;
  int64_t lo = 0, hi = 0;
  DeviceBuffer weights;                 // every hosted expert's six arrays, back to back
  std::vector<DeviceExpert> host_ptrs;  // [hi - lo]
  DeviceBuffer experts, tiles, z, h, y;
  cudaStream_t stream = nullptr;
  ~Impl() {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

CudaExperts::CudaExperts(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaExperts::~CudaExperts() = default;

absl::StatusOr<std::unique_ptr<CudaExperts>> CudaExperts::Create(const ModelConfig& cfg,
                                                                 const MoeLayerWeights& w) {
  if (absl::Status s = ValidateCudaExperts(cfg, w); !s.ok()) return s;
  if (absl::Status s = CudaDeviceStatus(); !s.ok()) return s;
  auto impl = std::make_unique<Impl>();
  impl->cfg = cfg;
  impl->lo = w.expert_lo;
  impl->hi = w.expert_hi;
  const int64_t d = cfg.latent, i = cfg.intermediate;
  const size_t sizes[6] = {
      static_cast<size_t>(i * Mxfp4PackedBytes(d)), static_cast<size_t>(i * Mxfp4ScaleBytes(d)),
      static_cast<size_t>(i * Mxfp4PackedBytes(d)), static_cast<size_t>(i * Mxfp4ScaleBytes(d)),
      static_cast<size_t>(d * Mxfp4PackedBytes(i)), static_cast<size_t>(d * Mxfp4ScaleBytes(i))};
  size_t per_expert = 0;
  for (size_t s : sizes) per_expert += (s + 255) / 256 * 256;
  const int64_t n = w.expert_hi - w.expert_lo;
  MOE_CUDA_RETURN(cudaStreamCreate(&impl->stream), "cudaStreamCreate");
  MOE_CUDA_RETURN(impl->weights.Reserve(per_expert * static_cast<size_t>(n)), "cudaMalloc weights");
  auto* base = static_cast<uint8_t*>(impl->weights.ptr);
  for (int64_t e = 0; e < n; ++e) {
    const ExpertWeights& x = w.experts[static_cast<size_t>(e)];
    const uint8_t* src[6] = {x.w1.packed, x.w1.scales, x.w3.packed,
                             x.w3.scales, x.w2.packed, x.w2.scales};
    uint8_t* dst[6];
    uint8_t* p = base + per_expert * static_cast<size_t>(e);
    for (int m = 0; m < 6; ++m) {
      dst[m] = p;
      MOE_CUDA_RETURN(cudaMemcpy(p, src[m], sizes[m], cudaMemcpyHostToDevice), "upload weights");
      p += (sizes[m] + 255) / 256 * 256;
    }
    impl->host_ptrs.push_back({dst[0], dst[1], dst[2], dst[3], dst[4], dst[5]});
  }
  MOE_CUDA_RETURN(impl->experts.Reserve(sizeof(DeviceExpert) * static_cast<size_t>(n)),
                  "cudaMalloc experts");
  MOE_CUDA_RETURN(cudaMemcpy(impl->experts.ptr, impl->host_ptrs.data(),
                             sizeof(DeviceExpert) * static_cast<size_t>(n), cudaMemcpyHostToDevice),
                  "upload expert table");
  return std::unique_ptr<CudaExperts>(new CudaExperts(std::move(impl)));
}

absl::StatusOr<std::vector<Bf16>> CudaExperts::Run(const Routing& routing, const Bf16* z) {
  Impl& m = *impl_;
  const int64_t d = m.cfg.latent, i = m.cfg.intermediate, k = routing.top_k;
  const std::vector<std::vector<int64_t>> pairs = PairsByExpert(routing, m.cfg.num_experts);
  // Rows grouped by expert (ascending), 16-row tiles that never straddle two experts.
  std::vector<Bf16> rows;
  std::vector<int64_t> pair_of_row;
  std::vector<RowTile> tiles;
  for (int64_t e = 0; e < m.cfg.num_experts; ++e) {
    if (pairs[e].empty()) continue;
    if (e < m.lo || e >= m.hi) {
      return absl::InvalidArgumentError(absl::StrCat("expert ", e, " is not on this GPU"));
    }
    const int32_t start = static_cast<int32_t>(pair_of_row.size());
    for (int64_t p : pairs[e]) {
      const Bf16* src = z + (p / k) * d;
      rows.insert(rows.end(), src, src + d);
      pair_of_row.push_back(p);
    }
    const int32_t end = static_cast<int32_t>(pair_of_row.size());
    AppendRowTiles(static_cast<int32_t>(e - m.lo), start, end, &tiles);
  }
  std::vector<Bf16> y(static_cast<size_t>(routing.tokens * k * d));
  if (tiles.empty()) return y;
  const size_t total = pair_of_row.size();
  MOE_CUDA_RETURN(m.z.Reserve(total * d * 2), "cudaMalloc z");
  MOE_CUDA_RETURN(m.h.Reserve(total * i * 2), "cudaMalloc h");
  MOE_CUDA_RETURN(m.y.Reserve(total * d * 2), "cudaMalloc y");
  MOE_CUDA_RETURN(m.tiles.Reserve(tiles.size() * sizeof(RowTile)), "cudaMalloc tiles");
  MOE_CUDA_RETURN(
      cudaMemcpyAsync(m.z.ptr, rows.data(), total * d * 2, cudaMemcpyHostToDevice, m.stream),
      "upload z");
  MOE_CUDA_RETURN(cudaMemcpyAsync(m.tiles.ptr, tiles.data(), tiles.size() * sizeof(RowTile),
                                  cudaMemcpyHostToDevice, m.stream),
                  "upload tiles");
  // At most 65,535 row tiles per launch (gridDim.y): larger batches in chunks of tiles.
  for (const auto& [first, count] : TileChunks(static_cast<int64_t>(tiles.size()))) {
    MOE_CUDA_RETURN(
        LaunchExpertFfn(static_cast<const DeviceExpert*>(m.experts.ptr),
                        static_cast<const RowTile*>(m.tiles.ptr) + first, static_cast<int>(count),
                        static_cast<const uint16_t*>(m.z.ptr), static_cast<int>(d),
                        static_cast<int>(i), m.cfg.situ_beta, m.cfg.situ_linear_beta,
                        static_cast<uint16_t*>(m.h.ptr), static_cast<uint16_t*>(m.y.ptr), m.stream),
        "expert FFN kernels");
  }
  std::vector<Bf16> out(total * d);
  MOE_CUDA_RETURN(
      cudaMemcpyAsync(out.data(), m.y.ptr, total * d * 2, cudaMemcpyDeviceToHost, m.stream),
      "download y");
  MOE_CUDA_RETURN(cudaStreamSynchronize(m.stream), "expert FFN");
  for (size_t r = 0; r < total; ++r) {
    std::copy_n(out.data() + r * d, d, y.data() + pair_of_row[r] * d);
  }
  return y;
}

}  // namespace moe::numerics::cuda
