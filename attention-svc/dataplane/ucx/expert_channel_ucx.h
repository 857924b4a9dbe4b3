// ExpertChannel over the UCX data plane (docs/data-plane.md): each batch is one UCX active
// message to the shard (the Dispatch header, then the activations, from one registered buffer:
// shared memory, TCP or RDMA verbs, as UCX_TLS says) and one back, sealed with an AES-GMAC under
// the connection's key (data_plane.h, BatchFrame); the thread that waits for the reply polls
// the worker for it first (UcxWorker::Await). The first batch opens the data plane
// (ExpertService.OpenDataPlane, then a UCX hello on our endpoint to the shard's worker,
// acknowledged); an endpoint error or the shard's control connection leaving READY (it died or
// restarted) makes the next batch open it again. A shard of the previous release (no
// batch_messages in its OpenDataPlane reply) gets the previous protocol: the header on its
// gRPC Dispatch stream, the payloads as tagged messages with random tags.
//
// With fallback_in_band (--data_plane=auto) a batch goes in band (counted as a "fallback" event)
// while the shard offers no UCX; otherwise such batches fail with UNAVAILABLE naming the shard.
// Made by the UCX client half (ucx_client_half.h), which owns the worker.
//
//   UcxExpertChannel ch({.shard = "shard-0", .endpoint = "127.0.0.1:5001",
//                        .node = "attention-0"}, worker);
#ifndef MOE_ATTENTION_SVC_DATAPLANE_UCX_EXPERT_CHANNEL_UCX_H_
#define MOE_ATTENTION_SVC_DATAPLANE_UCX_EXPERT_CHANNEL_UCX_H_

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/time/time.h"
#include "attention-svc/dataplane/client_half.h"
#include "attention-svc/dataplane/reply_liveness.h"
#include "attention-svc/expert_channel.h"
#include "services/common/poll_window.h"
#include "services/dataplane/data_plane.h"

namespace moe::dataplane {
class UcxWorker;
class PayloadMac;
}  // namespace moe::dataplane
namespace moe::transport {
class ExpertStream;
}
namespace grpc {
class Channel;
}

namespace moe::attention_svc {

class GrpcExpertChannel;

class UcxExpertChannel final : public ExpertChannel {
 public:
  // on_lanes: the lanes UCX selected on our side and the shard's view of its side.
  UcxExpertChannel(ChannelOptions options, dataplane::UcxWorker* worker);
  ~UcxExpertChannel() override;

  std::unique_ptr<ExpertCall> Send(const DispatchHeader& header,
                                   const DispatchMessage& message) override;
  const std::string& shard() const override { return shard_; }
  // "ucx" once the data plane is open, "grpc" while batches go in band.
  const char* transport() const override {
    return client_id_.load() != 0 ? "ucx" : next_ != nullptr ? next_->transport() : "grpc";
  }
  // The lanes UCX selected for our endpoint to the shard (read from UCX when the data plane
  // opened), and the shard's own view of its endpoint back (its hello acknowledgement).
  dataplane::UcxLanes lanes() const;
  std::string peer_lanes() const;
  // Dispatch streams this channel opened to the shard (none while batches travel as UCX
  // messages; the previous protocol and the in-band fallback use one).
  int64_t dispatch_streams_opened() const;
  // Batches that asked for their reply's MAC after the reply (ChannelOptions::
  // detach_reply_tag_from).
  int64_t detached_tag_batches() const { return detached_tag_batches_.load(); }

 private:
  // One open data plane: what a batch needs of it, read together.
  struct Connection {
    uint64_t ep = 0;
    uint64_t client_id = 0;
    std::shared_ptr<const dataplane::PayloadMac> mac;
    size_t chunk_bytes = 0;
    bool batch_messages = false;              // one UCX message per batch each way
    bool detached_tags = false;               // the shard detaches reply tags when asked
    std::shared_ptr<grpc::Channel> control;   // its state: whether the shard is alive
    std::shared_ptr<ReplyLiveness> liveness;  // whether a timed-out batch means it is gone
  };
  // Opens (or reopens) the data plane; an error: send in band / fail.
  absl::StatusOr<Connection> EnsureOpen(absl::Time deadline);
  // A batch as one UCX message each way (the shard said batch_messages).
  std::unique_ptr<ExpertCall> SendMessage(const Connection& c, const DispatchHeader& header,
                                          const DispatchMessage& m, size_t bytes,
                                          size_t reply_bytes, absl::Time deadline);
  // The events of a failed transfer and of a failed integrity check (counted, logged).
  std::function<void()> TransferFailed() const;
  std::function<void()> IntegrityFailed() const;

  const std::string shard_, endpoint_, node_, cluster_token_;
  const int max_message_bytes_;
  dataplane::UcxWorker* const worker_;
  const bool fallback_in_band_;
  const std::shared_ptr<ExpertChannel> next_;  // ChannelOptions::next
  const size_t detach_reply_tag_from_;
  DataPlaneEventFn on_event_;
  DataPlaneLanesFn on_lanes_;
  std::shared_ptr<transport::ExpertStream> stream_;
  std::unique_ptr<GrpcExpertChannel> inband_;  // on the same stream
  // How long a caller polls for this shard's reply, learned from its round trips.
  const std::shared_ptr<PollWindow> reply_window_;
  std::mutex open_mu_;
  uint64_t ep_ = 0;
  std::shared_ptr<const dataplane::PayloadMac> mac_;
  size_t chunk_bytes_ = 0;
  bool batch_messages_ = false;
  bool detached_tags_ = false;
  std::shared_ptr<grpc::Channel> control_;
  std::shared_ptr<ReplyLiveness> liveness_;
  std::atomic<uint64_t> client_id_{0};
  std::atomic<uint64_t> sequence_{1};  // the MAC nonce: each batch of this connection once
  std::atomic<int64_t> detached_tag_batches_{0};
  // When an integrity failure was last logged (unix seconds; shared with the calls).
  std::shared_ptr<std::atomic<int64_t>> last_integrity_log_ =
      std::make_shared<std::atomic<int64_t>>(0);
  mutable std::mutex lanes_mu_;
  dataplane::UcxLanes lanes_;
  std::string peer_lanes_;
  // Set by the endpoint's error handler and by calls that learned the data plane is gone
  // (unknown client after a shard restart): the next batch opens it again.
  std::shared_ptr<std::atomic<bool>> broken_ = std::make_shared<std::atomic<bool>>(false);
  absl::Time retry_after_ = absl::InfinitePast();  // no UCX on the shard: in band until then
  std::string without_ucx_;                        // and why (the shard's answer)
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_DATAPLANE_UCX_EXPERT_CHANNEL_UCX_H_
