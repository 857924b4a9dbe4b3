// The attention node's links to the expert shards: its halves of the out-of-band data plane
// (dataplane/client_half.h, started by --data_plane's name: under auto shm then UCX; none: in
// band) and one channel per shard (shard@endpoint), made on first use by MakeExpertChannel and
// closed when the shard is no longer placed. Channels and the halves go together: Close drops
// every channel before the halves go. Thread-safe; what travels is the channels' business.
//
//   MOE_ASSIGN_OR_RETURN(auto links, ExpertLinks::Start(options, metrics));  // metrics required
//   std::shared_ptr<ExpertChannel> ch = links->ChannelFor(shard_ref);
//   links->KeepOnly([&](const std::string& key) { return view.Placed(key); });
#ifndef MOE_ATTENTION_SVC_EXPERT_LINKS_H_
#define MOE_ATTENTION_SVC_EXPERT_LINKS_H_

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "attention-svc/dataplane/client_half.h"
#include "attention-svc/expert_channel.h"
#include "attention-svc/expert_channel_factory.h"
#include "services/dataplane/data_plane.h"

namespace moe::metrics {
class AttentionMetrics;
}

namespace moe::attention_svc {

// Experts in this process (tests, without processes): the shards whose weights are here are
// served by LocalExpertChannel (expert_channel_factory.h). Everything must outlive the links.
struct LocalExperts {
  std::function<const numerics::MoeLayerWeights*(const ShardRef&)> weights;
  const numerics::cpu::KernelTable* kernels = nullptr;
  ThreadPool* pool = nullptr;
};

struct ExpertLinksOptions {
  std::string node = "attention-0";
  std::string bind_host = "127.0.0.1";  // the interface the data plane may listen on
  dataplane::DataPlane data_plane;      // in band, automatic, or a backend by name
  std::string ucx_tls;                  // empty: UCX_TLS from the environment
  int ucx_poll_us = 100;
  int ucx_poll_max_us = dataplane::kPollMaxUs;
  int ucx_progress_spin_us = 0;
  // ChannelOptions::detach_reply_tag_from (0: never).
  int64_t ucx_detach_tag_from = dataplane::kDetachTagFromBytes;
  int max_message_bytes = 256 << 20;
  std::string cluster_token;
  LocalExperts local;
  const ModelConfig* cfg = nullptr;  // required with local experts
};

class ExpertLinks {
 public:
  // Starts the data plane's halves when asked for one: a backend named by --data_plane that
  // cannot start is FAILED_PRECONDITION; under auto the node goes without it (in band when
  // none starts) and says so.
  static absl::StatusOr<std::unique_ptr<ExpertLinks>> Start(const ExpertLinksOptions& options,
                                                            metrics::AttentionMetrics* metrics);
  // The channel of one shard, made once per shard@endpoint (its failover and hedge series
  // start at 0 then).
  std::shared_ptr<ExpertChannel> ChannelFor(const ShardRef& s);
  // Closes the channels of shards `placed` says are gone (a restarted shard on a new port).
  void KeepOnly(const std::function<bool(const std::string& shard_at_endpoint)>& placed);
  // Drops every channel (calls in flight finish on their own references).
  void Close();
  // The halves started, in the order the node prefers them.
  const std::vector<std::unique_ptr<ClientHalf>>& data_planes() const { return halves_; }
  ~ExpertLinks() = default;  // the channels go before the halves (declared after them)

 private:
  explicit ExpertLinks(metrics::AttentionMetrics* m) : metrics_(m) {}
  absl::Status StartHalves(const ExpertLinksOptions& options);

  metrics::AttentionMetrics* const metrics_;
  // Every channel's configuration, made once at Start (the half, the callbacks).
  ExpertChannelConfig config_;
  // Declared before the channels so that they outlive them.
  std::vector<std::unique_ptr<ClientHalf>> halves_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<ExpertChannel>> channels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_EXPERT_LINKS_H_
