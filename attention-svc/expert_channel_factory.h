// The one place the attention node chooses how a shard's messages travel (the twin of
// expert-svc's MakeBatchEndpoint): in process when the shard's experts are here, out of band on
// the node's data plane when it has one (dataplane/client_half.h: shm, UCX, the fake; under
// --data_plane=auto the first backend that opens to the shard, and the last falls back in band),
// in-band gRPC otherwise.
//
//   ExpertChannelConfig c;  c.max_message_bytes = ...;  c.data_planes = {shm, ucx};  // or {}
//   std::shared_ptr<ExpertChannel> ch = MakeExpertChannel(c, shard_ref);
#ifndef MOE_ATTENTION_SVC_EXPERT_CHANNEL_FACTORY_H_
#define MOE_ATTENTION_SVC_EXPERT_CHANNEL_FACTORY_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "attention-svc/dataplane/client_half.h"
#include "attention-svc/dispatch_plan.h"
#include "attention-svc/expert_channel.h"
#include "services/common/model_config.h"
#include "services/common/thread_pool.h"
#include "services/numerics/cpu/kernels.h"
#include "services/numerics/layer_weights.h"

namespace moe::attention_svc {

struct ExpertChannelConfig {
  int max_message_bytes = 256 << 20;
  std::string cluster_token;
  std::string node;  // this attention node's name (OpenDataPlane, logs)
  // The data plane's halves of this node in the order it prefers them (empty: in band): a
  // shard's channel is the first one's, which sends to the next one's where it cannot open
  // (ChannelOptions::next); whether the last falls back in band (--data_plane=auto), and their
  // events and lanes.
  std::vector<ClientHalf*> data_planes;
  bool fallback_in_band = true;
  size_t detach_reply_tag_from = dataplane::kDetachTagFromBytes;
  DataPlaneEventFn on_event;
  DataPlaneLanesFn on_lanes;
  // In process: the experts of a shard when they are here (null: not here). cfg, kernels and
  // pool must then be set; they and the weights must outlive the channels.
  std::function<const numerics::MoeLayerWeights*(const ShardRef&)> local_weights;
  const ModelConfig* cfg = nullptr;
  const numerics::cpu::KernelTable* kernels = nullptr;
  ThreadPool* pool = nullptr;
};

std::shared_ptr<ExpertChannel> MakeExpertChannel(const ExpertChannelConfig& config,
                                                 const ShardRef& shard);

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_EXPERT_CHANNEL_FACTORY_H_
