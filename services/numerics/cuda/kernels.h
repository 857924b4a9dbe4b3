// CUDA kernels of the Stable LatentMoE layer (docs/math.md section 4), Hopper/Ampere (sm_90,
// sm_80). Kernels take raw device pointers and a stream and return cudaError_t; the op layer
// (cuda_backend.h) turns that into absl::Status. bf16 values travel as uint16_t bit patterns
// (tensor::Bf16), MXFP4 in the checkpoint layout of mxfp4.h (decoded to bf16 on the fly:
// Hopper has no FP4 tensor cores).
//
//   LaunchRouterTopK(logits, bias, T, E, k, true, 1.0f, ids, weights, scores, stream);
#ifndef MOE_SERVICES_NUMERICS_CUDA_KERNELS_H_
#define MOE_SERVICES_NUMERICS_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

namespace moe::numerics::cuda {

// Step 1 after the fp32 router GEMM: s = sigmoid(logits) (exp in double, rounded once, as the
// reference), c = s + bias, top-k of c in rank order (ties: lower id), weights from the
// unbiased scores summed in rank order. logits [T, E] fp32 -> ids [T, k], weights [T, k],
// scores [T, E] (may be null). E <= 4096, k <= 32. Bit-exact with the reference for equal logits.
cudaError_t LaunchRouterTopK(const float* logits, const float* bias, int tokens, int experts,
                             int top_k, bool renormalize, float scaling_factor, int32_t* ids,
                             float* weights, float* scores, cudaStream_t stream);

// Step 4: r[t] = bf16(sum over the token's experts in ascending id of fp32(y[t, j]) * w[t, j]),
// each product rounded to fp32 before the add (no FMA): bit-exact with ref::Combine.
// y [T, k, D] bf16 in slot order -> r [T, D] bf16.
cudaError_t LaunchCombine(const uint16_t* y, const int32_t* ids, const float* weights, int tokens,
                          int top_k, int latent, uint16_t* r, cudaStream_t stream);

// Step 5: n = bf16(r * 1/sqrt(mean(r^2) + eps)), out = bf16(gamma * n). The sum of squares is a
// tree reduction (order differs from the reference: tolerance in tests/gpu).
cudaError_t LaunchRmsNorm(const uint16_t* r, int tokens, int dim, const uint16_t* gamma, float eps,
                          uint16_t* out, cudaStream_t stream);

// One expert's MXFP4 matrices on the device.
struct DeviceExpert {
  const uint8_t* w1_packed;  // gate [I, D/2], scales [I, D/32]
  const uint8_t* w1_scales;
  const uint8_t* w3_packed;  // up [I, D/2]
  const uint8_t* w3_scales;
  const uint8_t* w2_packed;  // down [D, I/2], scales [D, I/32]
  const uint8_t* w2_scales;
};

// A tile of 16 consecutive rows of one group (rows of one expert).
struct RowTile {
  int32_t group;    // index into the experts array
  int32_t row;      // first row of the tile in the activations
  int32_t row_end;  // one past the group's last row
};

// Appends the 16-row tiles of one group's rows [start, end) (tiles never straddle groups).
inline void AppendRowTiles(int32_t group, int32_t start, int32_t end, std::vector<RowTile>* tiles) {
  for (int32_t r = start; r < end; r += 16) tiles->push_back({group, r, end});
}

// Step 3 for grouped rows (rows of one expert are contiguous): FC1 with SiTU fused,
// h = bf16(SiTU(bf16(z W1^T), bf16(z W3^T))), then FC2, y = bf16(h W2^T). bf16 tensor-core MMA
// (WMMA 16x16x16) with fp32 accumulation; MXFP4 decoded to bf16 in shared memory per 32-column
// block. z [R, D], h [R, I] (scratch), y [R, D]; D and I multiples of 64.
cudaError_t LaunchExpertFfn(const DeviceExpert* experts, const RowTile* tiles, int num_tiles,
                            const uint16_t* z, int latent, int intermediate, float beta,
                            float linear_beta, uint16_t* h, uint16_t* y, cudaStream_t stream);

}  // namespace moe::numerics::cuda

#endif  // MOE_SERVICES_NUMERICS_CUDA_KERNELS_H_
