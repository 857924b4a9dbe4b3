// The routed experts on CPU: every (token, slot) of a Routing through its expert's MXFP4 FFN
// with SiTU-GLU, weights read in their packed checkpoint layout.
//
// Tokens are grouped by expert, so each expert's weights stream once per batch; an expert with
// the table's panel_from or more tokens runs the panel (prefill) kernel where the table has one
// (kernel_choice.h measures where that pays). Two phases,
// each a ParallelFor over (active expert x block of 64 rows): FC1 (w1 and w3 rows together,
// SiTU fused right after, into the permuted h of that expert), then FC2. Each output element
// is produced by one work item in a fixed order: results do not depend on the thread count.
//
//   std::vector<Bf16> y = cpu::RunExperts(kernels, &pool, cfg, weights, routing, z.data());
#ifndef MOE_SERVICES_NUMERICS_CPU_EXPERT_FFN_H_
#define MOE_SERVICES_NUMERICS_CPU_EXPERT_FFN_H_

#include <vector>

#include "absl/types/span.h"
#include "services/common/model_config.h"
#include "services/common/thread_pool.h"
#include "services/numerics/cpu/kernels.h"
#include "services/numerics/layer_weights.h"
#include "services/numerics/mxfp8.h"
#include "services/numerics/precision_mode.h"
#include "services/numerics/router.h"
#include "services/tensor/bf16.h"

namespace moe::numerics::cpu {

// Rows per work item: 128 rows of a K3 expert matrix are 230 KB of weights, enough to hide the
// per-item cost at one token per expert (64 rows: 0.68 -> 0.63 of the read bandwidth on AVX2,
// cpu_layer_bench).
inline constexpr int64_t kExpertRowBlock = 128;

// z: [T, D] bf16 -> y: [T, k, D] bf16 in routing's slot order. Every routed expert must be
// hosted by w. W4A8 quantizes z per token to MXFP8 (as an attention node does before it sends
// it) and runs the overload below.
std::vector<tensor::Bf16> RunExperts(const KernelTable& kernels, ThreadPool* pool,
                                     const ModelConfig& cfg, const MoeLayerWeights& w,
                                     const Routing& routing, const tensor::Bf16* z,
                                     Precision precision = Precision::kW4A16,
                                     W4A8H h_order = W4A8H::kFromFp32);
// W4A8 on z already in MXFP8 ([T, D], as it arrives at an expert server): each FC reads
// MXFP8 activations (z here, h quantized after SiTU: from fp32 unless h_order says via bf16),
// as ref::ExpertFfn in kW4A8.
std::vector<tensor::Bf16> RunExperts(const KernelTable& kernels, ThreadPool* pool,
                                     const ModelConfig& cfg, const MoeLayerWeights& w,
                                     const Routing& routing, const Mxfp8Rows& z,
                                     W4A8H h_order = W4A8H::kFromFp32);

// The same, writing y where the caller says (every one of its T * k * D values is written:
// each output element by one work item, whatever the memory held before). z_rows: the row of z
// each of routing's tokens reads (an expert server's batch: its (token, expert) pairs over the
// distinct tokens that arrived, read in place instead of gathered first); empty: token t
// reads row t. The caller checks that each lies within z.
void RunExperts(const KernelTable& kernels, ThreadPool* pool, const ModelConfig& cfg,
                const MoeLayerWeights& w, const Routing& routing, const tensor::Bf16* z,
                absl::Span<const int32_t> z_rows, tensor::Bf16* y,
                Precision precision = Precision::kW4A16, W4A8H h_order = W4A8H::kFromFp32);
void RunExperts(const KernelTable& kernels, ThreadPool* pool, const ModelConfig& cfg,
                const MoeLayerWeights& w, const Routing& routing, const Mxfp8Rows& z,
                absl::Span<const int32_t> z_rows, tensor::Bf16* y,
                W4A8H h_order = W4A8H::kFromFp32);

// One expert for `tokens` rows of z [tokens, D] -> y [tokens, D] (single-threaded; tests).
void ExpertFfn(const KernelTable& kernels, const ExpertWeights& w, const tensor::Bf16* z,
               int64_t tokens, float beta, float linear_beta, tensor::Bf16* y,
               Precision precision = Precision::kW4A16, W4A8H h_order = W4A8H::kFromFp32);

}  // namespace moe::numerics::cpu

#endif  // MOE_SERVICES_NUMERICS_CPU_EXPERT_FFN_H_
