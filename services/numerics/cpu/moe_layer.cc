#include "services/numerics/cpu/moe_layer.h"

#include <cstdio>
#include <cstdlib>

#include "services/common/status_macros.h"
#include "services/numerics/combine.h"
#include "services/numerics/cpu/expert_ffn.h"
#include "services/numerics/dynamic_k.h"
#include "services/numerics/precision_mode.h"
#include "services/numerics/rms_norm.h"
#include "services/numerics/situ.h"

namespace moe::numerics::cpu {

using tensor::Bf16;

namespace {

std::vector<float> ToFloat(const Bf16* x, int64_t n) {
  std::vector<float> f(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) f[i] = x[i].ToFloat();
  return f;
}

// y: [tokens, padded] fp32 -> [tokens, out] bf16.
std::vector<Bf16> ToBf16(const std::vector<float>& y, int64_t tokens, int64_t padded, int64_t out) {
  std::vector<Bf16> r(static_cast<size_t>(tokens * out));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t o = 0; o < out; ++o) r[t * out + o] = Bf16::FromFloat(y[t * padded + o]);
  }
  return r;
}

template <typename T>
void Release(std::vector<T>& v) {
  std::vector<T>().swap(v);
}

}  // namespace

absl::StatusOr<std::unique_ptr<CpuMoeLayer>> CpuMoeLayer::Create(const ModelConfig& cfg,
                                                                 MoeLayerWeights weights,
                                                                 const CpuLayerOptions& options) {
  MOE_RETURN_IF_ERROR(ValidateConfig(cfg));
  MOE_RETURN_IF_ERROR(ValidateLayerWeights(cfg, weights, /*need_dense=*/true,
                                           /*need_experts=*/options.experts));
  std::unique_ptr<CpuMoeLayer> l(new CpuMoeLayer());
  l->cfg_ = cfg;
  l->has_experts_ = options.experts;
  l->w4a8_h_ = options.w4a8_h;
  l->pool_ = std::make_unique<ThreadPool>(options.threads, "layer-compute");
  if (options.kernels != nullptr) {
    l->kernels_ = options.kernels;
  } else if (options.experts) {
    KernelChoiceOptions ko;
    ko.sets = options.isa;
    ko.latent = cfg.latent;
    ko.intermediate = cfg.intermediate;
    ko.pool = l->pool_.get();
    l->kernels_ = &ChooseKernels(ko).table;
  } else {
    l->kernels_ = &KernelsFor(CapIsa(options.isa.automatic ? Isa::kAvx512 : options.isa.only));
  }
  const int64_t h = cfg.hidden, d = cfg.latent, e = cfg.num_experts, s = cfg.shared_intermediate();
  l->gate_ = PackedLinear::Pack(weights.gate.data(), e, h);
  l->down_ = PackedLinear::Pack(weights.down_proj.data(), d, h);
  l->up_ = PackedLinear::Pack(weights.up_proj.data(), h, d);
  l->shared_gate_ = PackedLinear::Pack(weights.shared_gate.data(), s, h);
  l->shared_up_ = PackedLinear::Pack(weights.shared_up.data(), s, h);
  l->shared_down_ = PackedLinear::Pack(weights.shared_down.data(), h, s);
  Release(weights.gate);
  Release(weights.down_proj);
  Release(weights.up_proj);
  Release(weights.shared_gate);
  Release(weights.shared_up);
  Release(weights.shared_down);
  l->weights_ = std::move(weights);
  return l;
}

size_t CpuMoeLayer::packed_dense_bytes() const {
  return gate_.bytes() + down_.bytes() + up_.bytes() + shared_gate_.bytes() + shared_up_.bytes() +
         shared_down_.bytes();
}

absl::StatusOr<LayerOutput> CpuMoeLayer::Forward(absl::Span<const Bf16> x, int64_t tokens,
                                                 int64_t width, const float* bias,
                                                 LayerTimings* timings, Precision precision,
                                                 const BudgetRule* budget) {
  MOE_ASSIGN_OR_RETURN(RoutedBatch batch, RouteAndProject(x, tokens, width, bias, timings));
  if (budget != nullptr) {
    ApplyBudget(batch.scores.data(), cfg_.num_experts, *budget, cfg_.renormalize,
                cfg_.routed_scaling_factor, &batch.routing);
  }
  std::vector<Bf16> y;
  {
    StageTimer timer(timings, &LayerTimings::experts);
    y = RunLocalExperts(batch.routing, batch.z.data(), precision);
  }
  std::vector<Bf16> r(static_cast<size_t>(tokens * cfg_.latent));
  {
    StageTimer timer(timings, &LayerTimings::combine_norm);
    std::vector<const Bf16*> rows(static_cast<size_t>(tokens * cfg_.top_k));
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = y.data() + i * cfg_.latent;
    CombineRows(batch.routing, rows.data(), cfg_.latent, r.data(), pool_.get());
  }
  LayerOutput result;
  result.out = Finish(batch, r.data(), timings);
  result.routing = std::move(batch.routing);
  return result;
}

absl::StatusOr<RoutedBatch> CpuMoeLayer::RouteAndProject(absl::Span<const Bf16> x, int64_t tokens,
                                                         int64_t width, const float* bias,
                                                         LayerTimings* timings) {
  MOE_RETURN_IF_ERROR(ValidateHiddenStates(cfg_, x, tokens, width));
  const KernelTable& k = *kernels_;
  ThreadPool* pool = pool_.get();
  const int64_t d = cfg_.latent, e = cfg_.num_experts;
  RoutedBatch batch;
  batch.tokens = tokens;
  batch.xf = ToFloat(x.data(), tokens * cfg_.hidden);
  {
    StageTimer timer(timings, &LayerTimings::router);
    std::vector<float> logits(static_cast<size_t>(tokens * gate_.padded_out()));
    gate_.Apply(k, pool, batch.xf.data(), tokens, logits.data());
    batch.scores.resize(static_cast<size_t>(tokens * e));
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < e; ++j)
        batch.scores[t * e + j] = Sigmoid(logits[t * gate_.padded_out() + j]);
    }
    batch.routing =
        SelectExperts(batch.scores.data(), bias != nullptr ? bias : weights_.bias.data(), tokens, e,
                      cfg_.top_k, cfg_.renormalize, cfg_.routed_scaling_factor);
  }
  {
    StageTimer timer(timings, &LayerTimings::down_proj);
    std::vector<float> zf(static_cast<size_t>(tokens * down_.padded_out()));
    down_.Apply(k, pool, batch.xf.data(), tokens, zf.data());
    batch.z = ToBf16(zf, tokens, down_.padded_out(), d);
  }
  return batch;
}

std::vector<Bf16> CpuMoeLayer::RunLocalExperts(const Routing& routing, const Bf16* z,
                                               Precision precision) {
  if (!has_experts_) {  // a programming error, not bad traffic
    std::fprintf(stderr, "CpuMoeLayer::RunLocalExperts on a layer created without experts\n");
    std::abort();
  }
  return RunExperts(*kernels_, pool_.get(), cfg_, weights_, routing, z, precision, w4a8_h_);
}

std::vector<float> CpuMoeLayer::SharedExperts(const RoutedBatch& batch, LayerTimings* timings) {
  StageTimer timer(timings, &LayerTimings::shared);
  const KernelTable& k = *kernels_;
  ThreadPool* pool = pool_.get();
  const int64_t tokens = batch.tokens, h = cfg_.hidden, s = cfg_.shared_intermediate();
  const int64_t sp = shared_gate_.padded_out();
  std::vector<float> g(static_cast<size_t>(tokens * sp)), u(g.size());
  shared_gate_.Apply(k, pool, batch.xf.data(), tokens, g.data());
  shared_up_.Apply(k, pool, batch.xf.data(), tokens, u.data());
  std::vector<float> hs(static_cast<size_t>(tokens * s));
  pool->ParallelFor(tokens, [&](int64_t t) {
    k.situ(g.data() + t * sp, u.data() + t * sp, s, cfg_.situ_beta, cfg_.situ_linear_beta,
           hs.data() + t * s);
  });
  const int64_t shp = shared_down_.padded_out();
  std::vector<float> sh(static_cast<size_t>(tokens * shp));
  shared_down_.Apply(k, pool, hs.data(), tokens, sh.data());
  std::vector<float> out(static_cast<size_t>(tokens * h));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < h; ++i) out[t * h + i] = tensor::RoundBf16(sh[t * shp + i]);
  }
  return out;
}

std::vector<Bf16> CpuMoeLayer::Finish(const RoutedBatch& batch, const Bf16* r,
                                      LayerTimings* timings, const std::vector<float>* shared) {
  const KernelTable& k = *kernels_;
  ThreadPool* pool = pool_.get();
  const int64_t tokens = batch.tokens, h = cfg_.hidden, d = cfg_.latent;
  std::vector<Bf16> normed(static_cast<size_t>(tokens * d));
  {
    StageTimer timer(timings, &LayerTimings::combine_norm);
    ref::RmsNorm(r, tokens, d, weights_.norm.data(), cfg_.rms_norm_eps, normed.data());
  }
  std::vector<float> of(static_cast<size_t>(tokens * up_.padded_out()));
  {
    StageTimer timer(timings, &LayerTimings::up_proj);
    const std::vector<float> nf = ToFloat(normed.data(), tokens * d);
    up_.Apply(k, pool, nf.data(), tokens, of.data());
  }
  std::vector<float> own;
  if (shared == nullptr) {
    own = SharedExperts(batch, timings);
    shared = &own;
  }
  std::vector<Bf16> out(static_cast<size_t>(tokens * h));
  const int64_t op = up_.padded_out();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < h; ++i) {
      const float o = tensor::RoundBf16(of[t * op + i]);
      out[t * h + i] = Bf16::FromFloat(o + (*shared)[t * h + i]);
    }
  }
  return out;
}

}  // namespace moe::numerics::cpu
