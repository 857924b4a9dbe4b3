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
  // The last backend's channel first: each one before it sends to it where it cannot open.
  std::shared_ptr<ExpertChannel> next;
  for (auto it = c.data_planes.rbegin(); it != c.data_planes.rend(); ++it) {
    ChannelOptions o;
    o.shard = s.shard;
    o.endpoint = s.endpoint;
    o.node = c.node;
    o.cluster_token = c.cluster_token;
    o.max_message_bytes = c.max_message_bytes;
    o.fallback_in_band = c.fallback_in_band;
    o.next = std::move(next);
    o.detach_reply_tag_from = c.detach_reply_tag_from;
    o.on_event = c.on_event;
    o.on_lanes = c.on_lanes;
    next = (*it)->MakeChannel(std::move(o));
  }
  if (next != nullptr) return next;
  return std::make_shared<GrpcExpertChannel>(s.shard, s.endpoint, c.max_message_bytes,
                                             c.cluster_token);
}

}  // namespace moe::attention_svc
