// The attention node's half of an out-of-band data plane (docs/data-plane.md, "Adding a
// transport"): what one backend (UCX, the in-process fake) keeps per process (UCX: its worker)
// and the ExpertChannel it makes per shard. The node starts the half its --data_plane names
// through the registry (registry.h) and asks it for each shard's channel; everything about the
// wire stays in the backend's folder. The twin of expert-svc/dataplane/server_half.h.
//
//   MOE_ASSIGN_OR_RETURN(auto half, StartClientHalf("ucx", {.node = "attention-0"}));
//   std::shared_ptr<ExpertChannel> ch = half->MakeChannel({.shard = "shard-0", ...});
#ifndef MOE_ATTENTION_SVC_DATAPLANE_CLIENT_HALF_H_
#define MOE_ATTENTION_SVC_DATAPLANE_CLIENT_HALF_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "attention-svc/expert_channel.h"
#include "services/dataplane/data_plane.h"

namespace moe::attention_svc {

struct ClientHalfOptions {
  std::string node;       // this attention node's name (logs)
  std::string bind_host;  // the node's --host: the only interface the backend listens on
  std::string tls;        // the backend's transports (UCX: UCX_TLS syntax); empty: its default
  // A thread waiting for a shard's reply polls this long before it sleeps.
  std::chrono::microseconds poll_spin{100};
  // ...and up to this long where its recent waits were that short (UcxOptions::poll_spin_max).
  std::chrono::microseconds poll_spin_max{1000};
  // The backend's own progress thread keeps polling this long after its last activity before
  // it sleeps (UcxOptions::spin; 0: at once).
  std::chrono::microseconds progress_spin{0};
};

// A data-plane event of a shard: "connected", "fallback", "transfer_failed", "integrity_failed"
// (metrics).
using DataPlaneEventFn = std::function<void(const std::string& shard, const std::string& event)>;
// Called when a shard's data plane opens: the lanes on our side and the shard's view of its own.
using DataPlaneLanesFn = std::function<void(const std::string& shard, const dataplane::Lanes& ours,
                                            const std::string& theirs)>;

struct ChannelOptions {
  std::string shard, endpoint;  // the shard's name and its gRPC address (OpenDataPlane)
  std::string node;             // this node's name (OpenDataPlane)
  std::string cluster_token;
  int max_message_bytes = 256 << 20;
  // --data_plane=auto: a batch goes in band (counted "fallback") while the shard offers no data
  // plane of this backend; otherwise such batches fail UNAVAILABLE naming the shard.
  bool fallback_in_band = true;
  // --data_plane=auto: the channel of the node's next backend to this shard (the attention
  // node's ExpertLinks chains them in DataPlane::backends() order). A backend that cannot open
  // to the shard (the shard does not offer it, or it cannot be reached from here) sends its
  // batches there instead of in band, as it does those it does not carry (too large); null:
  // fallback_in_band decides.
  std::shared_ptr<ExpertChannel> next;
  // A batch whose reply has at least this many bytes asks for the reply's MAC in a message after
  // it, so that the shard and this node hash at once (UCX: of a shard that offers it); 0: never.
  size_t detach_reply_tag_from = dataplane::kDetachTagFromBytes;
  DataPlaneEventFn on_event;
  DataPlaneLanesFn on_lanes;
};

class ClientHalf {
 public:
  virtual ~ClientHalf() = default;
  // The registry's name of the backend ("ucx", "fake"): the channels' transport().
  virtual const char* name() const = 0;
  // One line for the start-up log ("UCX 1.13.1, UCX_TLS posix").
  virtual std::string Describe() const = 0;
  // The channel to one shard. The half outlives its channels.
  virtual std::shared_ptr<ExpertChannel> MakeChannel(ChannelOptions options) = 0;
  // Messages the backend's library dropped before any handler saw them, by kind
  // (moe_ucx_messages_dropped_total for UCX); empty: none are.
  virtual std::vector<std::pair<std::string, double>> DroppedByKind() const { return {}; }
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_DATAPLANE_CLIENT_HALF_H_
