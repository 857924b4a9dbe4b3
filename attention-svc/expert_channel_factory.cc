#include "attention-svc/expert_channel_factory.h"

#include "attention-svc/expert_channel_grpc.h"
#include "attention-svc/expert_channel_local.h"

namespace moe::attention_svc {

std::shared_ptr<ExpertChannel> MakeExpertChannel(const ExpertChannelConfig& c, const ShardRef& s) {
  if (c.local_weights) {
    if (const numerics::MoeLayerWeights* w = c.local_weights(s); w != nullptr) {
      return std::make_shared<LocalExpertChannel>(s.shard, *c.cfg, w, *c.kernels, c.pool);
    }
  }
  if (c.ucx != nullptr) {
    return std::make_shared<UcxExpertChannel>(s.shard, s.endpoint, c.max_message_bytes, c.ucx,
                                              c.mode, c.node, c.on_event, c.cluster_token,
                                              c.on_lanes);
  }
  return std::make_shared<GrpcExpertChannel>(s.shard, s.endpoint, c.max_message_bytes,
                                             c.cluster_token);
}

}  // namespace moe::attention_svc
