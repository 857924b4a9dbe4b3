// The CUDA backend on a real GPU, in one run (issue: CUDA backend). Standalone: needs only CUDA
// (nvcc, cudart, cuBLASLt) and the project's Abseil-free reference sources, because the GPU
// machine has none of the Debian -dev packages. Built and run by tests/gpu/run.sh.
//
// 1. Every CUDA op against the CPU reference with named tolerances (exit status 1 on a miss):
//    router top-k, combine and RMSNorm bit-exact for equal inputs; the MXFP4 expert FFN (K3
//    shapes, 1..40 tokens per expert, several seeds) within a named tolerance measured on an
//    H200 by the same harness as the CPU consistency test (services/numerics/tolerance.h);
//    cuBLASLt bf16 and fp32
//    projections within the fp32 summation bound.
// 2. Figures for K3 shapes: device-to-device copy bandwidth (the limit); expert decode (1 token
//    per expert, 64 experts = 1.1 GB of MXFP4) as weight bytes/s and its fraction of the copy
//    bandwidth (target >= 0.6); prefill (256 tokens per expert, 8 experts) TFLOP/s.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "services/numerics/combine.h"
#include "services/numerics/cuda/cublaslt_gemm.h"
#include "services/numerics/cuda/kernels.h"
#include "services/numerics/expert_ffn.h"
#include "services/numerics/linear.h"
#include "services/numerics/mxfp4.h"
#include "services/numerics/rms_norm.h"
#include "services/numerics/router.h"
#include "services/numerics/situ.h"
#include "services/numerics/tolerance.h"

namespace mn = moe::numerics;
namespace mc = moe::numerics::cuda;
using moe::tensor::Bf16;

namespace {

// Named tolerances, measured the way the CPU consistency test measures (numerics/tolerance.h:
// UlpStats, bf16 ulps of each row's RMS, fractions over all outputs). Expert FFN, measured on an
// H200 (tensor-core sums are not IEEE adds in order) over 29 draws of 5 experts x 77 rows (the
// first run's draw and seeds 1-28): per draw 0.16-1.01% of outputs differ and 0.015-0.162% by
// more than one ulp; every difference is within 2 ulps of its row's scale but in 3 draws, where
// it reached 4 (what a one-ulp flip of an output four times its row's RMS amounts to). The
// check holds the draws of a run together (default 4) to the bound below: 4 row ulps, as the
// CPU's W4A8 bound, 0.2% over one ulp, 1% differing. The first bound, 2 row ulps and 0.2%, set
// from seeds 1-4, was broken by seeds 13-20; 21-28 then passed this one.
constexpr mn::Tolerance kGpuExpertFfnTolerance = {4.0, 2e-3, 0.01, -1};
// RMSNorm: bit-exact (the kernel sums the squares in the reference's order).
constexpr mn::Tolerance kGpuRmsNormTolerance = {0.0, 0.0, 0.0, 0};
constexpr double kGemmRelativeBound = 1e-5;  // |diff| <= bound * sum_i |x_i w_i|
// K3 shapes.
constexpr int kH = 7168, kD = 3584, kI = 3072, kE = 896, kK = 16;
constexpr float kBeta = 4.0f, kLinearBeta = 25.0f;

int g_failures = 0;

#define CUDA_OK(expr)                                                                            \
  do {                                                                                           \
    cudaError_t e_ = (expr);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(2);                                                                              \
    }                                                                                            \
  } while (0)

void Report(const char* check, bool ok, const std::string& detail) {
  std::printf("%-34s %s  %s\n", check, ok ? "PASS" : "FAIL", detail.c_str());
  if (!ok) ++g_failures;
}

// The fastest of `reps` runs of run() on the default stream, in ms (CUDA events).
template <typename F>
float BestMs(int reps, F run) {
  cudaEvent_t e0, e1;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));
  float best = 1e30f;
  for (int rep = 0; rep < reps; ++rep) {
    cudaEventRecord(e0);
    run();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    best = std::min(best, ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return best;
}

template <typename T>
T* Upload(const std::vector<T>& v) {
  T* d = nullptr;
  CUDA_OK(cudaMalloc(&d, std::max<size_t>(1, v.size() * sizeof(T))));
  CUDA_OK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
uint16_t* UploadBf16(const std::vector<Bf16>& v) {
  std::vector<uint16_t> bits(v.size());
  std::memcpy(bits.data(), v.data(), v.size() * sizeof(Bf16));
  return Upload(bits);
}

// Scratch for one grouped FFN run over `rows` rows.
struct FfnBuffers {
  uint16_t *z = nullptr, *h = nullptr, *y = nullptr;
  FfnBuffers(const std::vector<Bf16>& zin, int rows) {
    z = UploadBf16(zin);
    CUDA_OK(cudaMalloc(&h, (size_t)rows * kI * 2));
    CUDA_OK(cudaMalloc(&y, (size_t)rows * kD * 2));
  }
  ~FfnBuffers() {
    cudaFree(z);
    cudaFree(h);
    cudaFree(y);
  }
};

template <typename T>
std::vector<T> Download(const T* d, size_t n) {
  std::vector<T> v(n);
  CUDA_OK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

std::vector<Bf16> RandomBf16(size_t n, float scale, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<Bf16> v(n);
  for (Bf16& x : v) x = Bf16::FromFloat(nd(rng));
  return v;
}

// Compares bf16 outputs [rows, cols] with a named tolerance (the shared harness); returns
// whether they are within it and a description.
bool CompareBf16(const std::vector<Bf16>& got, const std::vector<Bf16>& want, int64_t rows,
                 int64_t cols, const mn::Tolerance& tolerance, std::string* detail) {
  mn::UlpStats stats;
  stats.AddRows(got.data(), want.data(), rows, cols);
  *detail = stats.Str();
  return stats.Within(tolerance);
}

// |got - want| <= kGemmRelativeBound * sum_i |x_i w_i| for every output (x: [m, k], w: [n, k]).
bool GemmWithinBound(const std::vector<float>& got, const std::vector<float>& want,
                     const std::vector<Bf16>& x, const std::vector<Bf16>& w, int m, int n, int k,
                     std::string* detail) {
  double worst = 0;
  for (int r = 0; r < m; ++r) {
    for (int o = 0; o < n; ++o) {
      double bound = 0;
      for (int i = 0; i < k; ++i) {
        bound += std::fabs((double)x[(size_t)r * k + i].ToFloat() * w[(size_t)o * k + i].ToFloat());
      }
      worst = std::max(
          worst, std::fabs(got[(size_t)r * n + o] - want[(size_t)r * n + o]) / (bound + 1e-30));
    }
  }
  char buf[128];
  std::snprintf(buf, sizeof(buf), "worst |diff| / sum|x w| = %.2e (bound %.0e)", worst,
                kGemmRelativeBound);
  *detail = buf;
  return worst <= kGemmRelativeBound;
}

struct HostExpert {
  std::vector<uint8_t> w1p, w1s, w3p, w3s, w2p, w2s;
  mn::ExpertWeights view;
};

void QuantizeMatrix(int rows, int cols, float std_dev, std::mt19937& rng, std::vector<uint8_t>* p,
                    std::vector<uint8_t>* s) {
  std::normal_distribution<float> nd(0.0f, std_dev);
  p->resize(static_cast<size_t>(rows) * cols / 2);
  s->resize(static_cast<size_t>(rows) * cols / 32);
  std::vector<float> row(cols);
  for (int r = 0; r < rows; ++r) {
    for (float& v : row) v = nd(rng);
    mn::QuantizeMxfp4Row(row.data(), cols, p->data() + static_cast<size_t>(r) * cols / 2,
                         s->data() + static_cast<size_t>(r) * cols / 32);
  }
}

void FreeExpert(const std::vector<mc::DeviceExpert>& dev) {
  for (const auto& d : dev) {
    for (const void* p :
         {d.w1_packed, d.w1_scales, d.w3_packed, d.w3_scales, d.w2_packed, d.w2_scales})
      cudaFree(const_cast<void*>(p));
  }
}

HostExpert MakeExpert(std::mt19937& rng) {
  HostExpert e;
  QuantizeMatrix(kI, kD, 1.0f / std::sqrt((float)kD), rng, &e.w1p, &e.w1s);
  QuantizeMatrix(kI, kD, 1.0f / std::sqrt((float)kD), rng, &e.w3p, &e.w3s);
  QuantizeMatrix(kD, kI, 1.0f / std::sqrt((float)kI), rng, &e.w2p, &e.w2s);
  e.view.w1 = {kI, kD, e.w1p.data(), e.w1s.data()};
  e.view.w3 = {kI, kD, e.w3p.data(), e.w3s.data()};
  e.view.w2 = {kD, kI, e.w2p.data(), e.w2s.data()};
  return e;
}

mc::DeviceExpert UploadExpert(const HostExpert& e) {
  return {Upload(e.w1p), Upload(e.w1s), Upload(e.w3p), Upload(e.w3s), Upload(e.w2p), Upload(e.w2s)};
}

// Runs the grouped FFN over groups of `counts` rows each (rows of z back to back).
void RunFfn(const std::vector<mc::DeviceExpert>& experts, const std::vector<int>& counts,
            const uint16_t* dz, uint16_t* dh, uint16_t* dy, mc::DeviceExpert** dexp,
            mc::RowTile** dtiles, int* num_tiles) {
  std::vector<mc::RowTile> tiles;
  int row = 0;
  for (size_t g = 0; g < counts.size(); ++g) {
    mc::AppendRowTiles(static_cast<int32_t>(g), row, row + counts[g], &tiles);
    row += counts[g];
  }
  if (*dexp == nullptr) *dexp = Upload(experts);
  if (*dtiles == nullptr) *dtiles = Upload(tiles);
  *num_tiles = (int)tiles.size();
  CUDA_OK(
      mc::LaunchExpertFfn(*dexp, *dtiles, *num_tiles, dz, kD, kI, kBeta, kLinearBeta, dh, dy, 0));
}

// Router top-k: equal logits in, bit-exact ids and weights out; combine and the latent RMSNorm
// on that routing.
void CheckRouterCombineNorm(std::mt19937& rng) {
  const int t = 64;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> logits(static_cast<size_t>(t) * kE), bias(kE), scores(logits.size());
  for (float& v : logits) v = nd(rng);
  for (float& v : bias) v = 0.05f * nd(rng);
  for (size_t i = 0; i < logits.size(); ++i) scores[i] = mn::Sigmoid(logits[i]);
  const mn::Routing want = mn::SelectExperts(scores.data(), bias.data(), t, kE, kK, true, 1.0f);
  float* dl = Upload(logits);
  float* db = Upload(bias);
  int32_t* di = nullptr;
  float *dw = nullptr, *ds = nullptr;
  CUDA_OK(cudaMalloc(&di, t * kK * sizeof(int32_t)));
  CUDA_OK(cudaMalloc(&dw, t * kK * sizeof(float)));
  CUDA_OK(cudaMalloc(&ds, logits.size() * sizeof(float)));
  CUDA_OK(mc::LaunchRouterTopK(dl, db, t, kE, kK, true, 1.0f, di, dw, ds, 0));
  const auto ids = Download(di, t * kK);
  const auto w = Download(dw, t * kK);
  const auto s = Download(ds, logits.size());
  const bool ok = ids == want.expert_ids && w == want.weights && s == scores;
  Report("router top-k (K3, 64 tokens)", ok, "ids, weights and sigmoid scores bit-exact");

  // Combine on that routing: bit-exact.
  const std::vector<Bf16> y = RandomBf16(static_cast<size_t>(t) * kK * kD, 0.05f, rng);
  std::vector<Bf16> r_want(static_cast<size_t>(t) * kD);
  mn::ref::Combine(want, y.data(), kD, r_want.data());
  uint16_t* dy = UploadBf16(y);
  uint16_t* dr = nullptr;
  CUDA_OK(cudaMalloc(&dr, r_want.size() * 2));
  CUDA_OK(mc::LaunchCombine(dy, di, dw, t, kK, kD, dr, 0));
  const auto r = Download(dr, r_want.size());
  Report("combine (K3, 64 tokens)", std::memcmp(r.data(), r_want.data(), r.size() * 2) == 0,
         "bit-exact (ascending expert id, no FMA)");

  // RMSNorm.
  const std::vector<Bf16> gamma = RandomBf16(kD, 1.0f, rng);
  std::vector<Bf16> n_want(r_want.size());
  mn::ref::RmsNorm(r_want.data(), t, kD, gamma.data(), 1e-5f, n_want.data());
  uint16_t* dg = UploadBf16(gamma);
  uint16_t* dn = nullptr;
  CUDA_OK(cudaMalloc(&dn, n_want.size() * 2));
  CUDA_OK(mc::LaunchRmsNorm(dr, t, kD, dg, 1e-5f, dn, 0));
  const auto n = Download(dn, n_want.size());
  std::vector<Bf16> n_got(n.size());
  std::memcpy(n_got.data(), n.data(), n.size() * 2);
  std::string detail;
  const bool nok = CompareBf16(n_got, n_want, t, kD, kGpuRmsNormTolerance, &detail);
  Report("latent RMSNorm (K3, 64 tokens)", nok, detail);
  const float best = BestMs(20, [&] { CUDA_OK(mc::LaunchRmsNorm(dr, t, kD, dg, 1e-5f, dn, 0)); });
  std::printf("  latent RMSNorm, 64 tokens: %.1f us (in-order sum of squares)\n", best * 1e3);
}

// cuBLASLt projections: bf16 (latent down) and fp32 (router), against the sequential fp32 sums.
void CheckCublasLt(std::mt19937& rng) {
  const int t = 32;
  mc::CublasLtGemm gemm;
  if (gemm.Init() != CUBLAS_STATUS_SUCCESS) {
    Report("cuBLASLt init", false, "");
  } else {
    const std::vector<Bf16> x = RandomBf16(static_cast<size_t>(t) * kH, 1.0f, rng);
    const std::vector<Bf16> w =
        RandomBf16(static_cast<size_t>(kD) * kH, 1.0f / std::sqrt((float)kH), rng);
    std::vector<float> want(static_cast<size_t>(t) * kD);
    mn::ref::LinearF32(x.data(), t, kH, w.data(), kD, want.data());
    uint16_t* dx = UploadBf16(x);
    uint16_t* dwt = UploadBf16(w);
    float* dout = nullptr;
    CUDA_OK(cudaMalloc(&dout, want.size() * 4));
    const bool ran =
        gemm.Run(mc::GemmInput::kBf16, dx, dwt, dout, t, kD, kH, 0) == CUBLAS_STATUS_SUCCESS;
    const auto got = Download(dout, want.size());
    std::string detail;
    const bool ok = GemmWithinBound(got, want, x, w, t, kD, kH, &detail);
    Report("cuBLASLt bf16 down-proj (32 tokens)", ran && ok, detail);

    // fp32 router GEMM: x as fp32, gate as fp32.
    const std::vector<Bf16> g =
        RandomBf16(static_cast<size_t>(kE) * kH, 1.0f / std::sqrt((float)kH), rng);
    std::vector<float> xf(x.size()), gf(g.size()), rwant(static_cast<size_t>(t) * kE);
    for (size_t i = 0; i < x.size(); ++i) xf[i] = x[i].ToFloat();
    for (size_t i = 0; i < g.size(); ++i) gf[i] = g[i].ToFloat();
    mn::ref::LinearF32(x.data(), t, kH, g.data(), kE, rwant.data());
    float* dxf = Upload(xf);
    float* dgf = Upload(gf);
    float* dlog = nullptr;
    CUDA_OK(cudaMalloc(&dlog, rwant.size() * 4));
    const bool ran32 =
        gemm.Run(mc::GemmInput::kF32, dxf, dgf, dlog, t, kE, kH, 0) == CUBLAS_STATUS_SUCCESS;
    const auto rgot = Download(dlog, rwant.size());
    const bool ok32 = GemmWithinBound(rgot, rwant, x, g, t, kE, kH, &detail);
    Report("cuBLASLt fp32 router (32 tokens)", ran32 && ok32, detail);
  }
}

// Expert FFN at K3 shapes: groups of 1, 3, 16, 17 and 40 rows (one tile, partial tiles,
// several tiles), against ref::ExpertFfn, over several seeds (MOE_GPU_SEEDS, "first,count":
// the tolerance below was measured on seeds 1-4; a run on other seeds checks it out of sample).
void CheckExpertFfn() {
  int first_seed = 1, seed_count = 4;
  if (const char* env = std::getenv("MOE_GPU_SEEDS")) {
    std::sscanf(env, "%d,%d", &first_seed, &seed_count);
  }
  const std::vector<int> counts = {1, 3, 16, 17, 40};
  int rows = 0;
  for (int c : counts) rows += c;
  mn::UlpStats all;
  for (int seed = first_seed; seed < first_seed + seed_count; ++seed) {
    std::mt19937 srng(seed);
    std::vector<HostExpert> host;
    std::vector<mc::DeviceExpert> dev;
    for (size_t g = 0; g < counts.size(); ++g) {
      host.push_back(MakeExpert(srng));
      dev.push_back(UploadExpert(host.back()));
    }
    const std::vector<Bf16> z = RandomBf16(static_cast<size_t>(rows) * kD, 1.0f, srng);
    std::vector<Bf16> want(z.size());
    int row = 0;
    for (size_t g = 0; g < counts.size(); ++g) {
      mn::ref::ExpertFfn(host[g].view, z.data() + (size_t)row * kD, counts[g], kBeta, kLinearBeta,
                         want.data() + (size_t)row * kD);
      row += counts[g];
    }
    FfnBuffers buf(z, rows);
    mc::DeviceExpert* dexp = nullptr;
    mc::RowTile* dtiles = nullptr;
    int tiles = 0;
    RunFfn(dev, counts, buf.z, buf.h, buf.y, &dexp, &dtiles, &tiles);
    CUDA_OK(cudaDeviceSynchronize());
    const auto y = Download(buf.y, want.size());
    std::vector<Bf16> got(y.size());
    std::memcpy(got.data(), y.data(), y.size() * 2);
    mn::UlpStats one;
    one.AddRows(got.data(), want.data(), rows, kD);
    all.AddRows(got.data(), want.data(), rows, kD);
    std::printf("  expert FFN seed %d: %s\n", seed, one.Str().c_str());
    FreeExpert(dev);
    cudaFree(dexp);
    cudaFree(dtiles);
  }
  char name[64];
  std::snprintf(name, sizeof(name), "expert FFN MXFP4 (K3, %d x 77 rows)", seed_count);
  Report(name, all.Within(kGpuExpertFfnTolerance), all.Str());
}

// Device-to-device copy bandwidth, read + write, of 1 GiB.
double CopyBandwidth() {
  const size_t bytes = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  CUDA_OK(cudaMalloc(&a, bytes));
  CUDA_OK(cudaMalloc(&b, bytes));
  CUDA_OK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
  const float best = BestMs(5, [&] { cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice); });
  const double copy_bw = 2.0 * bytes / (best * 1e-3);  // read + write
  std::printf("device-to-device copy, 1 GiB: %.0f GB/s (read + write)\n", copy_bw / 1e9);
  cudaFree(a);
  cudaFree(b);
  return copy_bw;
}

// The grouped FFN of `experts` random K3 experts, `per_expert` rows each: best of 5 in ms, and
// the weight bytes/s and FLOP/s that makes.
float TimeFfn(std::mt19937& rng, int experts, int per_expert, double* weight_bytes, double* flops) {
  std::vector<HostExpert> host;
  std::vector<mc::DeviceExpert> dev;
  for (int g = 0; g < experts; ++g) {
    host.push_back(MakeExpert(rng));
    dev.push_back(UploadExpert(host.back()));
  }
  const int rows = experts * per_expert;
  const std::vector<Bf16> z = RandomBf16(static_cast<size_t>(rows) * kD, 1.0f, rng);
  FfnBuffers buf(z, rows);
  uint16_t *dz = buf.z, *dh = buf.h, *dy = buf.y;
  mc::DeviceExpert* dexp = nullptr;
  mc::RowTile* dtiles = nullptr;
  int tiles = 0;
  std::vector<int> counts(experts, per_expert);
  RunFfn(dev, counts, dz, dh, dy, &dexp, &dtiles, &tiles);
  CUDA_OK(cudaDeviceSynchronize());
  const float best = BestMs(5, [&] { RunFfn(dev, counts, dz, dh, dy, &dexp, &dtiles, &tiles); });
  const double expert_bytes = 2.0 * kI * kD * (0.5 + 1.0 / 32) + 1.0 * kD * kI * (0.5 + 1.0 / 32);
  *weight_bytes = experts * expert_bytes / (best * 1e-3);
  *flops = 2.0 * rows * 3.0 * kD * kI / (best * 1e-3);
  FreeExpert(dev);
  cudaFree(dexp);
  cudaFree(dtiles);
  return best;
}

}  // namespace

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("no CUDA device: nothing to check\n");
    return 77;
  }
  cudaDeviceProp prop = {};
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d, %d SMs, %.0f GB)\n\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, prop.totalGlobalMem / 1e9);
  std::mt19937 rng(7);
  CheckRouterCombineNorm(rng);
  CheckCublasLt(rng);
  CheckExpertFfn();

  // Figures.
  std::printf("\n");
  const double copy_bw = CopyBandwidth();
  double bw = 0, fl = 0;
  float ms = TimeFfn(rng, 64, 1, &bw, &fl);
  std::printf(
      "expert decode, 1 token x 64 experts (1.12 GB MXFP4): %.3f ms, %.0f GB/s of weights = %.2f "
      "of copy bandwidth (target >= 0.6)\n",
      ms, bw / 1e9, bw / copy_bw);
  ms = TimeFfn(rng, 8, 256, &bw, &fl);
  std::printf(
      "expert prefill, 256 tokens x 8 experts: %.3f ms, %.1f TFLOP/s (bf16 MMA, fp32 accumulate)\n",
      ms, fl / 1e12);
  std::printf("\n%s: %d check(s) failed\n", g_failures ? "FAIL" : "PASS", g_failures);
  return g_failures ? 1 : 0;
}
