// ExpertChannel to experts in this process: each message runs at once on the CPU expert kernels
// (numerics::cpu::RunExperts) over a hosted expert range, and partial sums come from
// numerics::PartialSums, exactly what an expert server computes for the same batch. Used by the
// tests of the plan and the gather, without processes.
//
//   LocalExpertChannel ch("shard-0", cfg, &weights, kernels, &pool);  // weights: [lo, hi)
#ifndef MOE_ATTENTION_SVC_EXPERT_CHANNEL_LOCAL_H_
#define MOE_ATTENTION_SVC_EXPERT_CHANNEL_LOCAL_H_

#include <memory>
#include <string>

#include "attention-svc/expert_channel.h"
#include "services/common/model_config.h"
#include "services/common/thread_pool.h"
#include "services/numerics/cpu/kernels.h"
#include "services/numerics/layer_weights.h"

namespace moe::attention_svc {

class LocalExpertChannel final : public ExpertChannel {
 public:
  // weights, kernels and pool must outlive the channel.
  LocalExpertChannel(std::string shard, const ModelConfig& cfg,
                     const numerics::MoeLayerWeights* weights,
                     const numerics::cpu::KernelTable& kernels, ThreadPool* pool);

  std::unique_ptr<ExpertCall> Send(const DispatchHeader& header,
                                   const DispatchMessage& message) override;
  const std::string& shard() const override { return shard_; }
  const char* transport() const override { return "local"; }

 private:
  absl::StatusOr<ExpertReply> Run(const DispatchHeader& header, const DispatchMessage& m) const;

  const std::string shard_;
  const ModelConfig cfg_;
  const numerics::MoeLayerWeights* weights_;
  const numerics::cpu::KernelTable& kernels_;
  ThreadPool* pool_;
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_EXPERT_CHANNEL_LOCAL_H_
