// The expert server's end of the out-of-band data plane (docs/data-plane.md): its UCX worker,
// the clients that opened it, the hello that binds a client to the endpoint UCX made for it,
// and the two payload moves of a batch: the activations in (MAC checked before anything reads
// them) and the outputs back (MAC attached). The attention node's end is UcxExpertChannel.
// No protobuf here: the server converts OutOfBand to OutOfBandHeader.
//
//   MOE_ASSIGN_OR_RETURN(auto dp, UcxDataPlane::Start({.shard = "shard-0", .tls = "posix"}));
//   MOE_ASSIGN_OR_RETURN(DataPlaneClient c, dp->Open("attention-0"));  // OpenDataPlane
//   dp->Receive(header, deadline, [](const absl::Status& s, std::string_view payload) {...});
//   MOE_RETURN_IF_ERROR(dp->Reply(header, outputs, deadline, put_mac_in_header, on_sent));
#ifndef MOE_EXPERT_SVC_DATAPLANE_UCX_UCX_DATA_PLANE_H_
#define MOE_EXPERT_SVC_DATAPLANE_UCX_UCX_DATA_PLANE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "expert-svc/data_plane_clients.h"
#include "expert-svc/dataplane/server_half.h"
#include "services/dataplane/ucx_worker.h"

namespace moe::expert_svc {

// The server half's options (server_half.h); tls in UCX_TLS syntax (empty: the environment's),
// bind_host and poll_spin as UcxOptions takes them. Without on_batch every batch message is
// dropped (the previous protocol only).
using UcxDataPlaneOptions = ServerHalfOptions;

class UcxDataPlane {
 public:
  static absl::StatusOr<std::unique_ptr<UcxDataPlane>> Start(UcxDataPlaneOptions options);
  ~UcxDataPlane();

  const std::string& address() const;
  const std::string& tls() const;
  size_t chunk_bytes() const;

  // A new client (OpenDataPlane): see DataPlaneClients::Open.
  absl::StatusOr<DataPlaneClient> Open(const std::string& node);

  // Receives a batch's activations: `done` runs once (UCX progress thread; it must not block
  // for long) with the payload, valid only during the call, once it arrived whole and its MAC
  // matched; otherwise with the error, naming the shard and the batch: FAILED_PRECONDITION
  // (unknown client, no hello yet), INVALID_ARGUMENT (sizes), DATA_LOSS (integrity check),
  // DEADLINE_EXCEEDED (never came).
  using Received = std::function<void(const absl::Status&, std::string_view payload)>;
  void Receive(const OutOfBandHeader& h, absl::Time deadline, Received done);

  // Sends a batch's outputs to its client: `seal` gets the payload's MAC (for the reply's
  // header) before the send starts, `sent` runs once UCX is done with the payload (progress
  // thread). An error (the payload's size differs from the header's reply_bytes, unknown
  // client, no buffer) runs neither.
  using Sent = std::function<void(const absl::Status&)>;
  absl::Status Reply(const OutOfBandHeader& h, std::string_view payload, absl::Time deadline,
                     const std::function<void(const std::string& mac)>& seal, Sent sent);

  // Answers a batch with one message: its reply's protobuf header (at most
  // dataplane::kMaxReplyHeaderBytes) then `payload`, sealed under the client's key. `sent` runs
  // once UCX is done (any thread). An error (unknown client, no buffer) runs nothing.
  absl::Status ReplyBatch(const BatchSource& to, std::string_view header, std::string_view payload,
                          absl::Time deadline, Sent sent);
  // A registered buffer for a reply's payload of `bytes`, written at
  // data() + kReplyPayloadOffset (the header goes in the room before it), then sent by
  // ReplyBatchFrom without a copy. RESOURCE_EXHAUSTED when the pool has none.
  static constexpr size_t kReplyPayloadOffset = dataplane::kMaxReplyHeaderBytes;
  // A request message lands so that its activations start at this alignment (the batch is
  // computed from the receive buffer: BatchSource::activations_owner).
  static constexpr size_t kActivationAlignment = 64;
  absl::StatusOr<std::shared_ptr<dataplane::UcxBuffer>> ReplyBuffer(size_t bytes);
  absl::Status ReplyBatchFrom(const BatchSource& to, std::string_view header,
                              std::shared_ptr<dataplane::UcxBuffer> buffer, size_t bytes,
                              absl::Time deadline, Sent sent);

  // Polls the worker from the calling thread (UcxWorker::PollUntil), and how long a thread that
  // waits anyway should keep doing so (UcxOptions::poll_spin).
  void PollUntil(std::chrono::steady_clock::time_point until, const std::function<bool()>& stop) {
    worker_->PollUntil(until, stop);
  }
  std::chrono::microseconds poll_spin() const { return worker_->poll_spin(); }

  int clients() const { return clients_.size(); }
  const dataplane::UcxWorker& worker() const { return *worker_; }
  // The lanes of the latest client's endpoint, as UCX reports them here ("" before any hello).
  std::string lanes() const;

 private:
  explicit UcxDataPlane(UcxDataPlaneOptions options);
  void OnHello(std::string_view hello, uint64_t endpoint, const std::string& lanes);
  // Where a request message lands (the worker's sink), and what checks it once it did.
  dataplane::UcxWorker::MessageSink OnRequest(std::string_view frame, size_t length);
  // Counts a rejection and logs it at most once a minute per kind and peer.
  void Rejected(const std::string& event, const std::string& peer, const std::string& detail);

  UcxDataPlaneOptions options_;
  DataPlaneClients clients_;
  mutable std::mutex mu_;
  // Each client's acknowledgement buffer, registered by Open (the hello runs on the progress
  // thread, which must not wait for a registration).
  std::map<uint64_t, std::shared_ptr<dataplane::UcxBuffer>> ack_buffers_;
  std::map<std::string, absl::Time> last_logged_;
  std::string lanes_;                             // guarded by mu_
  std::unique_ptr<dataplane::UcxWorker> worker_;  // last: stopped first
};

}  // namespace moe::expert_svc

#endif  // MOE_EXPERT_SVC_DATAPLANE_UCX_UCX_DATA_PLANE_H_
