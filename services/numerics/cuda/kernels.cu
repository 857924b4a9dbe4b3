// Build with --fmad=false (CMake sets it): the reference rounds every product before the add,
// and the bit-exact kernels (router top-k, combine) rely on the same.
#include <cuda_bf16.h>
#include <mma.h>

#include <climits>
#include <cmath>

#include "services/numerics/cuda/kernels.h"
#include "services/numerics/cuda/launch_plan.h"

namespace moe::numerics::cuda {

namespace {

__device__ __forceinline__ float Bf16ToFloat(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}
__device__ __forceinline__ uint16_t FloatToBf16(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
__device__ __forceinline__ float RoundBf16(float f) { return Bf16ToFloat(FloatToBf16(f)); }

// exp and tanh evaluated in double and rounded once, as situ.h does on the host.
__device__ __forceinline__ float ExpF32(float x) {
  return static_cast<float>(exp(static_cast<double>(x)));
}
__device__ __forceinline__ float TanhF32(float x) {
  return static_cast<float>(tanh(static_cast<double>(x)));
}
__device__ __forceinline__ float Sigmoid(float x) {
  return __fdiv_rn(1.0f, __fadd_rn(1.0f, ExpF32(-x)));
}
__device__ __forceinline__ float Situ(float g, float u, float beta, float linear_beta) {
  const float gate = __fmul_rn(__fmul_rn(beta, TanhF32(__fdiv_rn(g, beta))), Sigmoid(g));
  const float up = __fmul_rn(linear_beta, TanhF32(__fdiv_rn(u, linear_beta)));
  return __fmul_rn(gate, up);
}

// E2M1 (docs/math.md section 3, mxfp4.h kE2M1Values): bit 3 sign, bits 2..1 exponent, bit 0
// mantissa; exponent 0 is subnormal (0 or 0.5).
__device__ __forceinline__ float E2M1(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const float mag = e == 0
                        ? 0.5f * static_cast<float>(m)
                        : (1.0f + 0.5f * static_cast<float>(m)) * static_cast<float>(1u << (e - 1));
  return (code & 8u) ? -mag : mag;
}
// 2^(s - 127), exact (s != 0xFF: loaders reject NaN scales).
__device__ __forceinline__ float E8M0(uint32_t s) {
  return s == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(s << 23);
}

constexpr int kRouterThreads = 256;

__global__ void RouterTopKKernel(const float* logits, const float* bias, int experts, int top_k,
                                 bool renormalize, float scaling_factor, int32_t* ids,
                                 float* weights, float* scores) {
  extern __shared__ float shared[];
  float* s = shared;            // [E] sigmoid scores
  float* c = shared + experts;  // [E] biased scores, -inf once chosen
  __shared__ float warp_value[kRouterThreads / 32];
  __shared__ int warp_index[kRouterThreads / 32];
  __shared__ int chosen[32];
  const int t = blockIdx.x;
  for (int j = threadIdx.x; j < experts; j += blockDim.x) {
    const float sv = Sigmoid(logits[static_cast<size_t>(t) * experts + j]);
    s[j] = sv;
    c[j] = bias != nullptr ? __fadd_rn(sv, bias[j]) : sv;
    if (scores != nullptr) scores[static_cast<size_t>(t) * experts + j] = sv;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int r = 0; r < top_k; ++r) {
    float best = -INFINITY;
    int best_i = INT_MAX;
    for (int j = threadIdx.x; j < experts; j += blockDim.x) {
      if (c[j] > best || (c[j] == best && j < best_i)) {
        best = c[j];
        best_i = j;
      }
    }
    for (int off = 16; off > 0; off >>= 1) {
      const float v = __shfl_down_sync(0xffffffffu, best, off);
      const int i = __shfl_down_sync(0xffffffffu, best_i, off);
      if (v > best || (v == best && i < best_i)) {
        best = v;
        best_i = i;
      }
    }
    if (lane == 0) {
      warp_value[warp] = best;
      warp_index[warp] = best_i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) {
        if (warp_value[w] > best || (warp_value[w] == best && warp_index[w] < best_i)) {
          best = warp_value[w];
          best_i = warp_index[w];
        }
      }
      chosen[r] = best_i;
      c[best_i] = -INFINITY;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float sum = 0.0f;  // rank order, as the reference
    for (int r = 0; r < top_k; ++r) sum = __fadd_rn(sum, s[chosen[r]]);
    for (int r = 0; r < top_k; ++r) {
      const float sv = s[chosen[r]];
      const float w = renormalize ? __fmul_rn(__fdiv_rn(sv, __fadd_rn(sum, 1e-20f)), scaling_factor)
                                  : __fmul_rn(sv, scaling_factor);
      ids[t * top_k + r] = chosen[r];
      weights[t * top_k + r] = w;
    }
  }
}

__global__ void CombineKernel(const uint16_t* y, const int32_t* ids, const float* weights,
                              int top_k, int latent, uint16_t* r) {
  __shared__ int order[32];
  const int t = blockIdx.x;
  if (threadIdx.x == 0) {  // slots by ascending expert id (insertion sort, k <= 32)
    for (int j = 0; j < top_k; ++j) {
      int p = j;
      while (p > 0 && ids[t * top_k + order[p - 1]] > ids[t * top_k + j]) {
        order[p] = order[p - 1];
        --p;
      }
      order[p] = j;
    }
  }
  __syncthreads();
  for (int d = threadIdx.x; d < latent; d += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < top_k; ++j) {
      const int slot = order[j];
      const float v = Bf16ToFloat(y[(static_cast<size_t>(t) * top_k + slot) * latent + d]);
      acc = __fadd_rn(acc, __fmul_rn(v, weights[t * top_k + slot]));
    }
    r[static_cast<size_t>(t) * latent + d] = FloatToBf16(acc);
  }
}

constexpr int kNormThreads = 256;

__global__ void RmsNormKernel(const uint16_t* r, int dim, const uint16_t* gamma, float eps,
                              uint16_t* out) {
  // The sum of squares in the reference's order (one fp32 add per element, ascending d), so the
  // output is bit-exact: a bf16 square is exact in fp32, only the adds round, and a tree of
  // partial sums rounds differently (measured on an H200: 147 of 229,376 outputs moved, up to
  // 2 ulp). One thread walks the row (3,584 dependent adds, a few microseconds per row, rows in
  // parallel); the others wait for it and then scale the row together.
  __shared__ float total;
  const int t = blockIdx.x;
  const uint16_t* row = r + static_cast<size_t>(t) * dim;
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int d = 0; d < dim; ++d) {
      const float v = Bf16ToFloat(row[d]);
      sum = __fadd_rn(sum, __fmul_rn(v, v));
    }
    total = sum;
  }
  __syncthreads();
  const float mean = __fdiv_rn(total, static_cast<float>(dim));
  const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    const float n = RoundBf16(__fmul_rn(Bf16ToFloat(row[d]), inv));
    out[static_cast<size_t>(t) * dim + d] = FloatToBf16(__fmul_rn(Bf16ToFloat(gamma[d]), n));
  }
}

// One block: 16 rows (tokens of one expert) x 64 output columns; 4 warps, each 16x16 of the
// output with WMMA bf16 16x16x16, fp32 accumulators. The K loop walks 32-column MX blocks: the
// activations tile and the weight rows (decoded from MXFP4 with their E8M0 scale) go through
// shared memory as bf16.
constexpr int kTileRows = 16;
constexpr int kTileCols = 64;
constexpr int kChunk = 32;
constexpr int kPad =
    40;  // row stride in shared memory (elements): a multiple of 8, fewer conflicts

template <int kMats>
__global__ void __launch_bounds__(128)
    MxfpGemmKernel(const DeviceExpert* experts, const RowTile* tiles, const uint16_t* in, int k_dim,
                   int n_dim, float beta, float linear_beta, uint16_t* out) {
  using namespace nvcuda;
  __shared__ __align__(32) __nv_bfloat16 a_sh[kTileRows * kPad];
  __shared__ __align__(32) __nv_bfloat16 b_sh[kMats][kTileCols * kPad];
  __shared__ __align__(32) float stage[kMats][4][16 * 16];
  const RowTile tile = tiles[blockIdx.y];
  const DeviceExpert ex = experts[tile.group];
  const int n0 = blockIdx.x * kTileCols;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint8_t* packed[2];
  const uint8_t* scales[2];
  if (kMats == 2) {
    packed[0] = ex.w1_packed;
    scales[0] = ex.w1_scales;
    packed[1] = ex.w3_packed;
    scales[1] = ex.w3_scales;
  } else {
    packed[0] = ex.w2_packed;
    scales[0] = ex.w2_scales;
  }
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kMats];
  for (int m = 0; m < kMats; ++m) wmma::fill_fragment(acc[m], 0.0f);
  const int chunks = k_dim / kChunk;
  for (int kc = 0; kc < chunks; ++kc) {
    {  // activations: 16 rows x 32 columns, 4 per thread; rows past the group are zero
      const int row = threadIdx.x / 8, col = (threadIdx.x % 8) * 4;
      const int g = tile.row + row;
      for (int i = 0; i < 4; ++i) {
        const uint16_t v =
            g < tile.row_end ? in[static_cast<size_t>(g) * k_dim + kc * kChunk + col + i] : 0;
        a_sh[row * kPad + col + i] = __ushort_as_bfloat16(v);
      }
    }
    for (int m = 0; m < kMats; ++m) {  // weights: 64 rows x 32 columns, 16 per thread
      const int row = threadIdx.x / 2, half = threadIdx.x % 2;
      const size_t wrow = static_cast<size_t>(n0 + row);
      const uint8_t* p = packed[m] + wrow * (k_dim / 2) + kc * (kChunk / 2) + half * 8;
      const float scale = E8M0(scales[m][wrow * (k_dim / kChunk) + kc]);
      for (int b = 0; b < 8; ++b) {
        const uint32_t byte = p[b];
        const int col = half * 16 + 2 * b;
        b_sh[m][row * kPad + col] = __float2bfloat16_rn(E2M1(byte & 0xFu) * scale);
        b_sh[m][row * kPad + col + 1] = __float2bfloat16_rn(E2M1(byte >> 4) * scale);
      }
    }
    __syncthreads();
    for (int ks = 0; ks < kChunk; ks += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
      wmma::load_matrix_sync(a, a_sh + ks, kPad);
      for (int m = 0; m < kMats; ++m) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b;
        wmma::load_matrix_sync(b, &b_sh[m][warp * 16 * kPad + ks], kPad);
        wmma::mma_sync(acc[m], a, b, acc[m]);
      }
    }
    __syncthreads();
  }
  for (int m = 0; m < kMats; ++m) {
    wmma::store_matrix_sync(stage[m][warp], acc[m], 16, wmma::mem_row_major);
  }
  __syncwarp();
  for (int e = 0; e < 8; ++e) {
    const int idx = lane * 8 + e, r = idx / 16, c = idx % 16;
    const int g = tile.row + r;
    if (g >= tile.row_end) continue;
    const size_t o = static_cast<size_t>(g) * n_dim + n0 + warp * 16 + c;
    if (kMats == 2) {
      const float gate = RoundBf16(stage[0][warp][idx]);
      const float up = RoundBf16(stage[1][warp][idx]);
      out[o] = FloatToBf16(Situ(gate, up, beta, linear_beta));
    } else {
      out[o] = FloatToBf16(stage[0][warp][idx]);
    }
  }
}

}  // namespace

cudaError_t LaunchRouterTopK(const float* logits, const float* bias, int tokens, int experts,
                             int top_k, bool renormalize, float scaling_factor, int32_t* ids,
                             float* weights, float* scores, cudaStream_t stream) {
  if (tokens <= 0 || experts <= 0 || experts > 4096 || top_k <= 0 || top_k > 32 ||
      top_k > experts) {
    return cudaErrorInvalidValue;
  }
  RouterTopKKernel<<<tokens, kRouterThreads, 2 * experts * sizeof(float), stream>>>(
      logits, bias, experts, top_k, renormalize, scaling_factor, ids, weights, scores);
  return cudaGetLastError();
}

cudaError_t LaunchCombine(const uint16_t* y, const int32_t* ids, const float* weights, int tokens,
                          int top_k, int latent, uint16_t* r, cudaStream_t stream) {
  if (tokens <= 0 || top_k <= 0 || top_k > 32 || latent <= 0) return cudaErrorInvalidValue;
  CombineKernel<<<tokens, 256, 0, stream>>>(y, ids, weights, top_k, latent, r);
  return cudaGetLastError();
}

cudaError_t LaunchRmsNorm(const uint16_t* r, int tokens, int dim, const uint16_t* gamma, float eps,
                          uint16_t* out, cudaStream_t stream) {
  if (tokens <= 0 || dim <= 0) return cudaErrorInvalidValue;
  RmsNormKernel<<<tokens, kNormThreads, 0, stream>>>(r, dim, gamma, eps, out);
  return cudaGetLastError();
}

cudaError_t LaunchExpertFfn(const DeviceExpert* experts, const RowTile* tiles, int num_tiles,
                            const uint16_t* z, int latent, int intermediate, float beta,
                            float linear_beta, uint16_t* h, uint16_t* y, cudaStream_t stream) {
  // The grids from the host's launch plan (launch_plan.h, tested at the limits on the CPU).
  const GridDims up = ExpertFfnGrid(num_tiles, intermediate, kTileCols);
  const GridDims down = ExpertFfnGrid(num_tiles, latent, kTileCols);
  if (!up.ok || !down.ok) return cudaErrorInvalidValue;
  MxfpGemmKernel<2>
      <<<dim3(static_cast<unsigned>(up.x), static_cast<unsigned>(up.y)), 128, 0, stream>>>(
          experts, tiles, z, latent, intermediate, beta, linear_beta, h);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  MxfpGemmKernel<1>
      <<<dim3(static_cast<unsigned>(down.x), static_cast<unsigned>(down.y)), 128, 0, stream>>>(
          experts, tiles, h, intermediate, latent, beta, linear_beta, y);
  return cudaGetLastError();
}

}  // namespace moe::numerics::cuda
