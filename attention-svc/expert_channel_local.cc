#include "attention-svc/expert_channel_local.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/numerics/combine.h"
#include "services/numerics/cpu/expert_ffn.h"

namespace moe::attention_svc {

namespace {

class DoneCall final : public ExpertCall {
 public:
  explicit DoneCall(absl::StatusOr<ExpertReply> reply) : reply_(std::move(reply)) {}
  absl::StatusOr<ExpertReply> Wait(absl::Time /*deadline*/) override { return std::move(reply_); }
  const char* transport() const override { return "local"; }

 private:
  absl::StatusOr<ExpertReply> reply_;
};

}  // namespace

LocalExpertChannel::LocalExpertChannel(std::string shard, const ModelConfig& cfg,
                                       const numerics::MoeLayerWeights* weights,
                                       const numerics::cpu::KernelTable& kernels,
                                       numerics::cpu::ThreadPool* pool)
    : shard_(std::move(shard)), cfg_(cfg), weights_(weights), kernels_(kernels), pool_(pool) {}

std::unique_ptr<ExpertCall> LocalExpertChannel::Send(const DispatchHeader& header,
                                                     const DispatchMessage& message) {
  return std::make_unique<DoneCall>(Run(header, message));
}

absl::StatusOr<ExpertReply> LocalExpertChannel::Run(const DispatchHeader& header,
                                                    const DispatchMessage& m) const {
  const int64_t d = header.latent, rows = m.rows();
  numerics::Routing routing;  // one row per (token, expert) pair
  routing.tokens = rows;
  routing.top_k = 1;
  for (const auto& [expert, n] : m.groups) {
    if (!weights_->HostsExpert(expert)) {
      return absl::NotFoundError(absl::StrCat("shard ", shard_, ": expert ", expert,
                                              " is not hosted here [", weights_->expert_lo, ", ",
                                              weights_->expert_hi, ")"));
    }
    routing.expert_ids.insert(routing.expert_ids.end(), static_cast<size_t>(n), expert);
  }
  routing.weights.assign(static_cast<size_t>(rows), 1.0f);
  const tensor::Activations z = m.z.Gather(m.row_source.data(), rows);  // [rows, D]
  std::vector<tensor::Bf16> y;
  switch (z.format()) {
    case tensor::ActivationFormat::kMxfp8:
      y = numerics::cpu::RunExperts(kernels_, pool_, cfg_, *weights_, routing, z.mxfp8());
      break;
    case tensor::ActivationFormat::kBf16:
      y = numerics::cpu::RunExperts(kernels_, pool_, cfg_, *weights_, routing, z.bf16().data());
      break;
  }
  ExpertReply reply;
  if (header.mode == ReplyMode::kPerPair) {
    reply.rows = rows;
    reply.Own(std::move(y));
    return reply;
  }
  const std::vector<int64_t> tokens = numerics::PartialSums(
      y.data(), rows, d, m.token_index.data(), m.weights.data(), header.num_tokens, &reply.f32);
  reply.rows = static_cast<int64_t>(tokens.size());
  return reply;
}

}  // namespace moe::attention_svc
