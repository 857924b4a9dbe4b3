// The Stable LatentMoE layer on the optimized CPU path. Same stages and rounding points as
// ref::MoeLayerForward (moe_layer.h); what differs:
//  * dense projections (router fp32, latent down/up, shared experts) run on PackedLinear:
//    bit-exact with the reference, so expert selection is always identical;
//  * routed experts read MXFP4 in place and sum in vector lanes, and SiTU uses vectorized
//    exp/tanh: outputs agree with the reference to within the tolerances of
//    tests/numerics/cpu/consistency_test.cc;
//  * everything runs on a thread pool; results do not depend on the thread count.
// Create() repacks the dense weights and frees the row-major copies, so the layer holds the
// packed dense weights once plus the borrowed (mapped) experts. Forward uses the layer's own
// thread pool and is not reentrant (nor are its stages): concurrent callers must serialize (a
// server queues batches).
//
//   MOE_ASSIGN_OR_RETURN(auto layer, cpu::CpuMoeLayer::Create(cfg, std::move(weights), {}));
//   MOE_ASSIGN_OR_RETURN(LayerOutput y, layer->Forward(x, tokens, cfg.hidden));
#ifndef MOE_SERVICES_NUMERICS_CPU_MOE_LAYER_H_
#define MOE_SERVICES_NUMERICS_CPU_MOE_LAYER_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "services/common/model_config.h"
#include "services/common/thread_pool.h"
#include "services/numerics/cpu/cpu_isa.h"
#include "services/numerics/cpu/kernel_choice.h"
#include "services/numerics/cpu/kernels.h"
#include "services/numerics/cpu/packed_linear.h"
#include "services/numerics/layer_weights.h"
#include "services/numerics/moe_layer.h"
#include "services/numerics/mxfp8.h"
#include "services/numerics/precision_mode.h"

namespace moe::numerics::cpu {

struct CpuLayerOptions {
  int threads = 0;  // 0: one per hardware thread
  // The expert kernels: measured per CPU (kernel_choice.h) or one set, capped at what the CPU
  // supports. A dense-only layer runs that set's (or auto: the AVX-512 or best) dense GEMM,
  // bit-exact on every set.
  KernelSets isa = DefaultKernelSets();
  // A table to run instead of choosing one (tests pin the per-set tables, KernelsFor(isa), whose
  // panel kernel starts at kPrefillTokens). Must outlive the layer.
  const KernelTable* kernels = nullptr;
  bool experts = true;  // false: dense part only (an attention node; experts are remote)
  W4A8H w4a8_h = W4A8H::kFromFp32;  // where W4A8 quantizes h (precision_mode.h)
};

// Steps 1 and 2 of one batch, kept for the rest of the layer.
struct RoutedBatch {
  int64_t tokens = 0;
  Routing routing;
  std::vector<float> scores;    // [T, E] sigmoid scores, unbiased (Quantile Balancing input)
  std::vector<tensor::Bf16> z;  // [T, D] latent activations
  std::vector<float> xf;        // [T, H] the input as fp32 (the shared experts read it)
};

class CpuMoeLayer {
 public:
  static absl::StatusOr<std::unique_ptr<CpuMoeLayer>> Create(const ModelConfig& cfg,
                                                             MoeLayerWeights weights,
                                                             const CpuLayerOptions& options);

  // budget: dynamic k's rule (dynamic_k.h) after the top-k; null: every token keeps k.
  absl::StatusOr<LayerOutput> Forward(absl::Span<const tensor::Bf16> x, int64_t tokens,
                                      int64_t width, const float* bias = nullptr,
                                      LayerTimings* timings = nullptr,
                                      Precision precision = Precision::kW4A16,
                                      const BudgetRule* budget = nullptr);

  // The stages of Forward, for the disaggregated path (the attention node runs steps 1-2,
  // sends z to the expert servers, and finishes from the combined latent r).
  // Steps 1-2; validates x. bias overrides the checkpoint's bias when not null ([E]).
  absl::StatusOr<RoutedBatch> RouteAndProject(absl::Span<const tensor::Bf16> x, int64_t tokens,
                                              int64_t width, const float* bias,
                                              LayerTimings* timings);
  // Step 3 on this layer's own experts: y [T, k, D] in routing's slot order (needs experts).
  std::vector<tensor::Bf16> RunLocalExperts(const Routing& routing, const tensor::Bf16* z,
                                            Precision precision = Precision::kW4A16);
  // Step 7 alone: the shared experts' output [T, H] as fp32 (rounded to bf16 values). An
  // attention node runs it while the expert servers work.
  std::vector<float> SharedExperts(const RoutedBatch& batch, LayerTimings* timings);
  // Steps 5-8 from the combined latent r: [T, D] -> out: [T, H]. shared: SharedExperts() of
  // this batch when already computed, else null.
  std::vector<tensor::Bf16> Finish(const RoutedBatch& batch, const tensor::Bf16* r,
                                   LayerTimings* timings,
                                   const std::vector<float>* shared = nullptr);

  Isa isa() const { return kernels_->isa; }
  const KernelTable& kernels() const { return *kernels_; }
  int threads() const { return pool_->size(); }
  // The layer's threads, for work beside its stages (the attention node's combine); callers of
  // the stages serialize as above, others take it only when free (ThreadPool::TryParallelFor).
  ThreadPool* pool() const { return pool_.get(); }
  size_t packed_dense_bytes() const;
  const MoeLayerWeights& weights() const { return weights_; }

 private:
  CpuMoeLayer() = default;

  ModelConfig cfg_;
  bool has_experts_ = true;
  W4A8H w4a8_h_ = W4A8H::kFromFp32;
  MoeLayerWeights weights_;  // bias, norm and experts; the dense matrices live packed below
  const KernelTable* kernels_ = nullptr;
  std::unique_ptr<ThreadPool> pool_;
  PackedLinear gate_, down_, up_, shared_gate_, shared_up_, shared_down_;
};

}  // namespace moe::numerics::cpu

#endif  // MOE_SERVICES_NUMERICS_CPU_MOE_LAYER_H_
