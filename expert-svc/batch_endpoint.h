// The expert side of the seam between the wire and the experts, the twin of attention-svc's
// ExpertChannel: a BatchEndpoint delivers one Dispatch request with its activation bytes, and
// the BatchReply it hands over takes the batch's answer back. The core (expert_core.h) computes
// between the two and knows nothing of how the bytes moved; the domain Batch carries no
// transport fields.
//
// Implementations, chosen by one factory (MakeBatchEndpoint) per request:
//   in band (gRPC)  the bytes inside the request; the answer on the same Dispatch stream
//   a data plane    one message each way (dataplane/server_half.h: UCX, the fake): the
//                   answer through MakeMessageReply; a backend's previous protocol (UCX: the
//                   header on the stream, the payload out of band) through its StreamEndpoint
//   local           the bytes inside the request; the answer to a callback (tests, in process)
//
//   auto endpoint = MakeBatchEndpoint(req, ctx);  // ctx: the stream, the data plane or null
//   endpoint->Receive(std::move(req), [&](v1::DispatchRequest& r, std::string_view bytes,
//                                         std::unique_ptr<BatchReply> reply) {
//     core.Admit(r, bytes, std::move(reply));  // the answer goes to reply->Send(...) later
//   });
#ifndef MOE_EXPERT_SVC_BATCH_ENDPOINT_H_
#define MOE_EXPERT_SVC_BATCH_ENDPOINT_H_

#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "expert-svc/batch_reply.h"
#include "expert-svc/dataplane/server_half.h"
#include "moe/v1/expert.pb.h"
#include "services/transport/stream_reactor.h"

namespace moe::expert_svc {

using DispatchReactor = transport::StreamReactor<v1::DispatchRequest, v1::DispatchReply>;

class BatchEndpoint {
 public:
  using Admit = std::function<void(v1::DispatchRequest& req, std::string_view activations,
                                   std::unique_ptr<BatchReply> reply)>;
  virtual ~BatchEndpoint() = default;
  // Fetches the request's activation bytes and calls `admit` once with them (the view valid
  // during the call), maybe later and on another thread; or answers the request's error on its
  // own. Nothing of the endpoint is used after Receive returns (it may be destroyed).
  virtual void Receive(v1::DispatchRequest req, Admit admit) = 0;
};

struct EndpointContext {
  std::string shard;
  DispatchReactor* stream = nullptr;  // the Dispatch stream of the request
  ServerHalf* data_plane = nullptr;   // null: this server offers no out-of-band data plane
  // The local endpoint's answers (no stream).
  std::function<void(v1::DispatchReply)> local_reply;
  // Every error a transport answers on its own (metrics).
  std::function<void(const absl::Status&)> on_error;
};

// The answer to a batch that came as one data-plane message (ServerHalf::on_batch): one message
// back, with the reply's header and, for an answer, its outputs (which must have the
// reply_capacity_bytes the caller announced in the request's OutOfBand; INTERNAL otherwise).
// `data_plane` outlives it (the server answers every batch before it stops the data plane).
std::unique_ptr<BatchReply> MakeMessageReply(ServerHalf* data_plane, const BatchSource& from,
                                             int64_t reply_bytes, std::string shard,
                                             absl::Time deadline);

// The request's endpoint: the data plane's StreamEndpoint when it has an out_of_band header
// (FAILED_PRECONDITION answered when there is none), in band otherwise; local when the context
// has no stream.
std::unique_ptr<BatchEndpoint> MakeBatchEndpoint(const v1::DispatchRequest& req,
                                                 const EndpointContext& ctx);

}  // namespace moe::expert_svc

#endif  // MOE_EXPERT_SVC_BATCH_ENDPOINT_H_
