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
                                       const numerics::cpu::KernelTable& kernels, ThreadPool* pool)
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
  // Each (token, expert) row reads its token's z in place through row_source (no gathered
  // [rows, D] copy), as an expert server does.
  std::vector<tensor::Bf16> y(static_cast<size_t>(rows * cfg_.latent));
  switch (m.z.format()) {
    case tensor::ActivationFormat::kMxfp8:
      numerics::cpu::RunExperts(kernels_, pool_, cfg_, *weights_, routing, m.z.mxfp8(),
                                m.row_source, y.data());
      break;
    case tensor::ActivationFormat::kBf16:
      numerics::cpu::RunExperts(kernels_, pool_, cfg_, *weights_, routing, m.z.bf16().data(),
                                m.row_source, y.data());
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
